"""The `rlctl` command: one thin typer module per subcommand, registered here.

Nothing heavy is imported at module level anywhere under rlctl/cli: `rlctl --help` and shell
completion must stay fast. Every UserError becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import sys

from rlctl import __version__

HELP = """rlctl: post-train LLMs (SFT, GRPO, PPO, DPO, reward models) from one command.

rlctl picks a plan for your model and hardware (FSDP2 or Megatron, SGLang / vLLM / HF rollout,
micro batches, offload), explains every choice, estimates the memory before you rent a GPU,
launches the distributed job and leaves checkpoints that convert to Hugging Face models.
"""

EPILOG = """Examples:

  rlctl estimate memory --model Qwen2.5-7B --method grpo --gpus 8 --gpu H100-80GB

  rlctl grpo --model Qwen2.5-7B --gpus 8 --dry-run

  rlctl sft --model ./tiny --data chats.jsonl --device cpu --nproc 2

  rlctl report runs/grpo-x --compare runs/grpo-y

  rlctl convert fsdp-to-hf runs/grpo/checkpoints out/hf
"""


def build_app():
    """The typer application with every subcommand (imported only when a command runs: ``rlctl --version``
    needs none of it)."""
    import typer

    from rlctl.cli import bench, chat, convert, estimate, presets, report, train
    from rlctl.cli import eval as eval_cmd
    from rlctl.cli.help import FlagsCommand
    from rlctl.names import Method, choices

    app = typer.Typer(
        name="rlctl",
        help=HELP,
        epilog=EPILOG,
        no_args_is_help=True,
        rich_markup_mode="rich",
        pretty_exceptions_enable=False,
        add_completion=False,  # static scripts in completions/ (make completions)
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    for method in choices(Method):
        app.command(method, epilog=train.EXAMPLES[method], cls=FlagsCommand)(getattr(train, method))
    app.command("report", epilog=report.EXAMPLES)(report.report)
    app.command("eval", epilog=eval_cmd.EXAMPLES)(eval_cmd.run_eval)
    app.command("chat", epilog=chat.EXAMPLES)(chat.chat)
    app.add_typer(convert.app, name="convert")
    app.add_typer(estimate.app, name="estimate")
    app.add_typer(bench.app, name="bench")
    app.add_typer(presets.app, name="presets")

    def _version(value: bool) -> None:
        if value:
            typer.echo(f"rlctl {__version__}")
            raise typer.Exit()

    @app.callback()
    def _root(
        version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
    ) -> None:
        pass

    return app


def __getattr__(name: str):
    """``rlctl.cli.app.app``: built on first use (PEP 562), once."""
    if name == "app":
        globals()["app"] = built = build_app()
        return built
    raise AttributeError(name)


def main() -> None:
    """Console-script entry point: user errors and OS errors (rlctl.errors.os_error_line) become one
    line and exit code 2. ``rlctl --version`` answers before anything else is imported.

    Usage errors (an unknown option, a missing argument) are click's, also exit code 2.
    """
    if sys.argv[1:] == ["--version"]:
        sys.stdout.write(f"rlctl {__version__}\n")
        return
    from rlctl.errors import UserError
    from rlctl.terminal import inert  # a message quotes paths, user code's exceptions, data: shown, never obeyed

    try:
        __getattr__("app")()
    except UserError as e:
        sys.stderr.write(f"error: {inert(e)}\n")
        sys.exit(e.exit_code)
    except OSError as e:  # a file-system problem anywhere (an unwritable output, a full disk): one line too
        from rlctl.errors import os_error_line

        sys.stderr.write(f"error: {inert(os_error_line(e))}\n")
        sys.exit(UserError.exit_code)

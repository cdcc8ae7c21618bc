"""`rlctl chat MODEL_OR_RUN`: talk to a model or a run's latest weights; `--prompt TEXT` for one reply.

A thin command over rlctl.evaluate.chat (imported inside: --help stays fast). The model's text is made
inert before it is printed (rlctl.evaluate.text): a reply cannot send escape sequences to the terminal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

EXAMPLES = """
Examples:

  rlctl chat runs/grpo                                  # interactive: /reset forgets, /exit leaves

  rlctl chat ./Qwen2.5-0.5B-Instruct --prompt "What is 12 * 7?"

  rlctl chat runs/grpo --temperature 0.7 --system-prompt "Answer briefly."
"""

HELP_LINE = "commands: /reset (forget the conversation), /exit (or Ctrl-D)"


def chat(
    model_or_run: Annotated[
        Path,
        typer.Argument(help="A Hugging Face model dir, or a run dir (its hf/ export, else its latest checkpoint)."),
    ],
    prompt: Annotated[str | None, typer.Option("--prompt", "-p", help="One message: print the reply and exit.")] = None,
    system_prompt: Annotated[
        str, typer.Option("--system-prompt", help="A system message before the conversation.")
    ] = "",
    temperature: Annotated[float, typer.Option("--temperature", help="0 is greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 512,
    max_model_len: Annotated[
        int, typer.Option("--max-model-len", help="Longest conversation in tokens (prompt + reply).")
    ] = 4096,
    rollout: Annotated[str, typer.Option("--rollout", help="Rollout engine: hf or vllm.")] = "hf",
    device: Annotated[
        str | None, typer.Option("--device", help="cpu or cuda (default: cuda when there is one).")
    ] = None,
    dtype: Annotated[
        str | None, typer.Option("--dtype", help="fp32 | bf16 | fp16 (default: bf16 on cuda, fp32 on cpu).")
    ] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    tools: Annotated[
        str | None,
        typer.Option(
            "--tools", help="Tools the model may call, as training takes them: FILE.py, FILE.py:a,b, verl YAML."
        ),
    ] = None,
    max_turns: Annotated[int, typer.Option("--max-turns", help="With --tools: model turns per reply at most.")] = 8,
    trust: Annotated[
        bool, typer.Option("--trust-checkpoint", help="Unpickle a checkpoint's files fully (see rlctl convert).")
    ] = False,
) -> None:
    """Chat with a model (its chat template, the history kept); --prompt for a single reply."""
    from rlctl.cli.eval import _engine
    from rlctl.evaluate.settings import chat_tools
    from rlctl.evaluate.source import check_source

    source = check_source(model_or_run)
    engine = _engine(rollout)
    _check_message(prompt, max_new_tokens, max_model_len)
    agent = chat_tools(tools or "", max_turns, max_new_tokens)  # a bad tools file fails before the model loads
    from rich.console import Console

    from rlctl.evaluate.chat import ChatSession
    from rlctl.evaluate.run import pick_device
    from rlctl.evaluate.source import materialize
    from rlctl.terminal import inert

    err = Console(stderr=True, soft_wrap=True, highlight=False)
    device, dtype = pick_device(device, dtype)
    with materialize(source, trust=trust, log=lambda m: err.print(inert(m), markup=False, style="dim")) as model_dir:
        session = ChatSession(
            model_dir, engine=engine, device=device, dtype=dtype, temperature=temperature, top_p=top_p,
            max_new_tokens=max_new_tokens, max_model_len=max_model_len, system=system_prompt, seed=seed,
            tools=agent,
        )  # fmt: skip
        _converse(session, prompt, err)


def _check_message(prompt: str | None, max_new_tokens: int, max_model_len: int) -> None:
    """--prompt, when given, has text; a reply has room in the conversation."""
    from rlctl.errors import UserError

    if prompt is not None and not prompt.strip():
        raise UserError("--prompt is empty; give the message text")
    if max_new_tokens < 1 or max_model_len <= max_new_tokens:
        raise UserError(f"need 1 <= --max-new-tokens < --max-model-len, got {max_new_tokens} and {max_model_len}")


def _converse(session, prompt: str | None, err) -> None:
    """One reply to --prompt (its tool turns on stderr), else the interactive loop; the session closed after."""
    from rlctl.terminal import inert

    try:
        if prompt is not None:
            answer = session.reply(prompt)
            show_tool_turns(session, err)
            typer.echo(inert(answer))
        else:
            _interactive(session, err)
    finally:
        session.close()


def _interactive(session, err) -> None:
    """Read a message, print the reply, until /exit or end of input; a turn's UserError is printed, not fatal."""
    from rich.console import Console
    from rich.prompt import Prompt

    from rlctl.errors import UserError
    from rlctl.terminal import inert

    out = Console(highlight=False)
    err.print(HELP_LINE, markup=False, style="dim")
    while True:
        try:
            text = Prompt.ask("[bold cyan]you[/]", console=out)
        except (EOFError, KeyboardInterrupt):
            out.print()
            return
        command = text.strip()
        if command in ("/exit", "/quit"):
            return
        if command == "/reset":
            session.reset()
            err.print("conversation reset", markup=False, style="dim")
            continue
        if not command:
            continue
        try:
            answer = session.reply(text)
        except UserError as e:
            err.print(inert(f"error: {e}"), markup=False, style="red")
            continue
        show_tool_turns(session, err)
        out.print("[bold green]model[/]: ", end="")
        out.print(inert(answer), markup=False)


def show_tool_turns(session, err) -> None:
    """The tool calls and results of the last reply (with --tools), before it, on stderr, made inert."""
    import json

    from rlctl.terminal import inert

    for m in session.last_turn[:-1]:
        name = f" {m['name']}" if m.get("name") else ""
        calls = [c.get("function", c) for c in m.get("tool_calls") or []]
        text = " ".join([m.get("content") or "", *(f"-> {json.dumps(c, default=str)}" for c in calls)]).strip()
        err.print(inert(f"[{m.get('role')}{name}] {text}"), markup=False, style="dim")

"""Tools, environments, verl tools and interactions: loading (schemas, errors) and running calls."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlctl.agents.tools import ToolCall, ToolOutcome, load_agent_spec, outcome_counts, run_calls
from rlctl.errors import UserError

FILES = Path(__file__).parent / "files"
CALC = str(FILES / "calc_tools.py")


def _fn(name: str, description: str, properties: dict, required: list[str], ret: dict) -> dict:
    parameters = {"type": "object", "properties": properties, "required": required}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters, "return": ret},
    }


def test_function_schemas_from_type_hints_and_docstrings():
    spec = load_agent_spec(tools=CALC)
    assert spec.tool_names == ["add", "power", "lookup", "divide", "sleepy", "async_echo", "async_sleepy"]
    by_name = {s["function"]["name"]: s for s in spec.schemas}
    number = {"type": "number"}
    assert by_name["add"] == _fn(
        "add",
        "Add two numbers.",
        {"a": {**number, "description": "The first number."}, "b": {**number, "description": "The second number."}},
        ["a", "b"],
        number,
    )
    assert by_name["power"] == _fn(
        "power",
        "Raise a number to a power.",
        {
            "base": {"type": "integer", "description": "The base."},
            "exponent": {"type": "integer", "description": "The exponent."},
            "mode": {
                "type": "string",
                "enum": ["exact", "float"],
                "description": "Whether to return an exact integer or a float.",
            },
        },
        ["base"],
        {"type": "string"},
    )
    assert by_name["lookup"] == _fn(
        "lookup",
        "Look names up.",
        {
            "names": {"type": "array", "items": {"type": "string"}, "description": "The names to look up."},
            "table": {
                "type": "object",
                "additionalProperties": {"type": "integer"},
                "nullable": True,
                "description": "Optional values by name.",
            },
        },
        ["names"],
        {"type": "object"},
    )
    chosen = load_agent_spec(tools=f"{CALC}:divide,add")
    assert chosen.tool_names == ["divide", "add"]
    with pytest.raises(UserError, match="has no function 'ad' .*did you mean add"):
        load_agent_spec(tools=f"{CALC}:ad")


def test_raising_tool_returns_error_and_output_is_capped():
    episode = load_agent_spec(tools=CALC, results="rlctl").open({})  # rlctl's texts (TRL's: tests/compat)
    out = run_calls(
        [
            (episode, ToolCall("divide", {"a": 1, "b": 0})),
            (episode, ToolCall("add", {"a": 1})),
            (episode, ToolCall("power", {"base": 3, "exponent": 4})),
            (episode, ToolCall("lookup", {"names": ["x" * 100]})),
            (episode, ToolCall("async_echo", {"text": "hi"})),
            (episode, ToolCall("multiply", {"a": 1})),
        ],
        timeout_s=5,
        max_chars=80,
    )
    assert out[0] == ToolOutcome("Error: ZeroDivisionError: division by zero", "error")
    assert out[1] == ToolOutcome("Error: invalid arguments for add: missing a required argument: 'b'", "error")
    assert out[2] == ToolOutcome("81", "ok")
    full = '{"' + "x" * 100 + '": 100}'
    assert out[3] == ToolOutcome(full[:80] + f"... [{len(full) - 80} more characters cut]", "ok")
    assert out[4] == ToolOutcome("HI", "ok")
    assert out[5].status == "unknown_tool" and "the tools are: add, power" in out[5].content
    assert outcome_counts(out) == {"tool/calls": 6, "tool/errors": 3, "tool/timeouts": 0}


def test_hanging_tools_time_out_while_the_other_calls_complete():
    spec = load_agent_spec(tools=CALC, env=f"{FILES / 'counter_env.py'}:HangingEnv", results="rlctl")
    a, b, c = spec.open({}), spec.open({}), spec.open({})
    timeout = 0.5
    start = time.monotonic()
    out = run_calls(
        [
            (a, ToolCall("sleepy", {"seconds": 10})),
            (b, ToolCall("add", {"a": 2, "b": 3})),
            (c, ToolCall("async_sleepy", {"seconds": 10})),
            (b, ToolCall("wait", {"seconds": 10})),  # a stateful environment method
            (b, ToolCall("wait", {"seconds": 0})),  # same trajectory: its environment died with the overrun call
            (a, ToolCall("async_echo", {"text": "ok"})),
        ],
        timeout_s=timeout,
        max_chars=1000,
    )
    elapsed = time.monotonic() - start
    assert [o.status for o in out] == ["timeout", "ok", "timeout", "timeout", "error", "error"]
    assert out[0].content == "Error: sleepy took longer than 0.5 s and was stopped"
    assert out[1].content == "5"
    assert "the environment was lost" in out[4].content
    assert elapsed < 5 * timeout, elapsed  # the three hanging trajectories wait in parallel: about one timeout
    assert outcome_counts(out) == {"tool/calls": 6, "tool/errors": 2, "tool/timeouts": 3}
    # the overrun call's process was killed: a trajectory of plain functions goes on in a fresh one at once
    plain = load_agent_spec(tools=CALC, results="rlctl").open({})
    assert plain.call(ToolCall("async_sleepy", {"seconds": 10}), 0.5).status == "timeout"
    assert plain.call(ToolCall("async_echo", {"text": "x"})) == ToolOutcome("X", "ok")
    assert c.call(ToolCall("async_echo", {"text": "x"})).status == "error"  # its environment is gone


def test_trl_environment_class_runs_unchanged():
    spec = load_agent_spec(env=f"{FILES / 'counter_env.py'}:CounterEnv")
    assert spec.schemas == [
        {
            "type": "function",
            "function": {
                "name": "increment",
                "description": "Add a step to the counter.",
                "parameters": {
                    "type": "object",
                    "properties": {"step": {"type": "integer", "description": "How much to add."}},
                    "required": ["step"],
                },
                "return": {"type": "string"},
            },
        },
        {
            "type": "function",
            "function": {
                "name": "read",
                "description": "Read the counter.",
                "parameters": {"type": "object", "properties": {}},
                "return": {"type": "integer"},
            },
        },
    ]
    one = spec.open({"prompt": [{"role": "user", "content": "count"}], "target": 5})
    two = spec.open({"prompt": [{"role": "user", "content": "count"}], "target": 2})
    assert one.prompt_suffix == "Reach exactly 5."
    out = run_calls(
        [
            (one, ToolCall("increment", {"step": 2})),
            (two, ToolCall("increment", {"step": 2})),
            (one, ToolCall("increment", {"step": 3})),
            (one, ToolCall("read", {})),
        ],
        timeout_s=5,
        max_chars=100,
    )
    assert [o.content for o in out] == ["total=2", "total=2", "total=5", "5"]
    assert one.reward() == {"env": 1.0} and two.reward() == {"env": 1.0}
    assert one.call(ToolCall("get_reward", {})).status == "unknown_tool"  # life cycle, not a tool
    assert one.user_turn([]) == (False, None)


def test_verl_tool_config_and_class_run_unchanged():
    spec = load_agent_spec(tools=str(FILES / "verl_tools.yaml"), verl_lifecycle="trajectory")  # per call: tests/compat
    assert spec.schemas == [
        {
            "type": "function",
            "function": {
                "name": "submit_answer",
                "description": "Submit the final answer to the question",
                "parameters": {
                    "type": "object",
                    "properties": {"answer": {"type": "string", "description": "The final answer, digits only"}},
                    "required": ["answer"],
                },
            },
        }
    ]
    row = {"extra_info": {"tools_kwargs": {"submit_answer": {"create_kwargs": {"ground_truth": "42"}}}}}
    episode = spec.open(row)
    wrong = episode.call(ToolCall("submit_answer", {"answer": "41"}))
    assert wrong == ToolOutcome("Current parsed answer='41' reward=0.0", "ok", -0.1)  # config.penalty reached the class
    right = episode.call(ToolCall("submit_answer", {"answer": "42"}))
    assert right == ToolOutcome("Current parsed answer='42' reward=1.0", "ok", 0.0)
    assert episode.reward() == {"submit_answer": 1.0}
    tool = spec.sources[0].tools[0]
    assert len(tool._instance_dict) == 1
    episode.close()
    assert tool._instance_dict == {} and len(tool.released) == 1 and not episode.errors


def test_verl_interaction_runs_unchanged():
    spec = load_agent_spec(interaction=str(FILES / "guess_interaction.yaml"))
    row = {"extra_info": {"interaction_kwargs": {"name": "guess", "ground_truth": "7"}}}
    episode = spec.open(row)
    convo = [{"role": "user", "content": "guess"}, {"role": "assistant", "content": "6"}]
    assert episode.user_turn(convo) == (False, "Wrong, try again.")
    assert episode.reward() == {"interaction": 0.0}
    convo += [{"role": "user", "content": "Wrong, try again."}, {"role": "assistant", "content": "7"}]
    assert episode.user_turn(convo) == (True, "Correct!")
    assert episode.turn_scores == [0.0, 1.0] and episode.reward() == {"interaction": 1.0}
    episode.close()
    assert spec.sources[0].objects["guess"]._instance_dict == {} and not episode.errors


def _one_line_error(**kwargs) -> str:
    with pytest.raises(UserError) as info:
        load_agent_spec(**kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_bad_inputs_are_one_line_user_errors(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_package_xyz\n")
    assert "broken.py failed to import: ModuleNotFoundError: No module named 'no_such_package_xyz'" in _one_line_error(
        tools=str(broken)
    )
    undocumented = tmp_path / "undocumented.py"
    undocumented.write_text('def f(x: int) -> int:\n    """Double."""\n    return 2 * x\n')
    assert "tool 'f' in" in _one_line_error(tools=str(undocumented))
    assert "not found" in _one_line_error(tools=str(tmp_path / "missing.py"))
    assert "names no class" in _one_line_error(env=str(FILES / "counter_env.py"))
    assert "has no class 'Counter'" in _one_line_error(env=f"{FILES / 'counter_env.py'}:Counter")
    no_list = tmp_path / "tools.yaml"
    no_list.write_text("tool: []\n")
    assert "has no 'tools:' list" in _one_line_error(tools=str(no_list))
    builtin = tmp_path / "verl_builtin.yaml"
    builtin.write_text("tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n    config: {type: native}\n")
    assert "pip install 'verl<=0.7.1'" in _one_line_error(tools=str(builtin))  # the last verl that bundles it
    assert "defined twice" in _one_line_error(tools=f"{CALC}:add;{CALC}:add")
    assert load_agent_spec() is None


def test_loading_imports_no_torch():
    tools = f"{CALC};{FILES / 'verl_tools.yaml'}"
    env = f"{FILES / 'counter_env.py'}:CounterEnv"
    interaction = str(FILES / "guess_interaction.yaml")
    code = (
        "import sys\n"
        "from rlctl.agents.tools import load_agent_spec\n"
        f"load_agent_spec(tools={tools!r}, env={env!r}, interaction={interaction!r})\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_tools_file_that_does_not_import_is_one_line_before_launch(tiny_model_dir, tmp_path):
    from tests.support.cli import run_cli
    from tests.support.rl import error_line
    from tests.support.sft import write_jsonl

    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "What is 1 + 2?", "answer": "3"}])
    broken = tmp_path / "tools.py"
    broken.write_text("import no_such_package_xyz\n")
    base = ["grpo", "--model", str(tiny_model_dir), "--data", str(data), "--device", "cpu", "--reward", "exact"]
    for extra in (["--dry-run"], ["--output-dir", str(tmp_path / "run")]):
        res = run_cli(*base, "--tools", str(broken), *extra)
        line = error_line(res)
        assert res.returncode == 2 and "failed to import: ModuleNotFoundError" in line and "Traceback" not in res.stderr
    assert not (tmp_path / "run").exists()  # refused before a run directory exists
    res = run_cli(*base, "--env", f"{FILES / 'counter_env.py'}:Nope", "--dry-run")
    assert res.returncode == 2 and "has no class 'Nope'" in error_line(res)

"""TRL users' files, in TRL's exact shapes (written here, not copied), run through the CLI on TRL's data layouts
and mean what they mean in TRL: ``reward_funcs`` (completions, dataset columns as keywords, None), environments
(``reset(**row)``, ``get_reward``) on rows without an answer, the refusal of a run with no reward source, sync
tools on a main thread (``signal.alarm``), and a tool's result as ``str(result)``."""

from __future__ import annotations

import pytest

from rlctl.agents.tools import ToolCall, load_agent_spec
from tests.compat.conftest import agent_run, samples, write
from tests.support.cli import run_cli
from tests.support.rl import error_line, failure, train_records
from tests.support.sft import write_jsonl

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is 3 + 4?"}]

TRL_REWARDS = '''def accuracy_reward(completions, solution, **kwargs):
    """TRL's reward_funcs form: a list of completions (chat messages here) and the dataset's columns."""
    rewards = []
    for completion, sol in zip(completions, solution):
        content = completion[0]["content"]
        rewards.append(1.0 if completion[0]["role"] == "assistant" and isinstance(content, str) and sol == "7" else 0.0)
    return rewards


async def only_for_code(prompts, completions, completion_ids, task, **kwargs):
    """Async (TRL awaits it); None: not applicable to that sample (TRL adds nothing for it)."""
    assert len(prompts) == len(completions) == len(completion_ids) == len(task)
    return [None if t == "math" else 5.0 for t in task]
'''


def test_trl_reward_funcs_on_trl_rows(tiny_model_dir, tmp_path):
    """TRL's layout (a prompt and a solution column, no answer field) and reward_funcs: each function gets
    completions and the columns by keyword; the score is their sum, None adding nothing: 1.0 here, as in TRL."""
    rewards = write(tmp_path / "rewards.py", TRL_REWARDS)
    rows = [{"prompt": QUESTION, "solution": "7", "task": "math"} for _ in range(4)]
    run = tmp_path / "run"
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    args = [
        "--model", str(tiny_model_dir), "--data", str(data), "--output-dir", str(run), "--device", "cpu",
        "--nproc", "1", "--batch-size", "2", "--n", "4", "--max-prompt-len", "64", "--max-response-len", "16",
        "--lr", "1e-4", "--rollout", "hf", "--max-steps", "1", "--set", "checkpoint.export_hf=false",
        "--reward", f"{rewards}:accuracy_reward", "--reward", f"{rewards}:only_for_code",
    ]  # fmt: skip
    res = run_cli("grpo", *args)
    assert res.returncode == 0, failure(res, run)
    r = train_records(run)[0]
    assert r["reward/mean"] == 1.0 and r["reward/failed"] == 0


GAME_ENV = '''class Game2048Env:
    """An environment that owns its task and has no get_reward (TRL's 2048 example, without its reward)."""

    def __init__(self):
        self.board = None

    def reset(self, **kwargs) -> str:
        self.board = [[0] * 4 for _ in range(4)]
        return "Play."

    def move(self, direction: str) -> str:
        """Slide the tiles.

        Args:
            direction: up, down, left or right.
        """
        return str(self.board)
'''


def test_a_run_with_no_reward_source_is_refused_before_launch(agent_model_dir, tmp_path):
    """TRL raises "No reward source provided"; rlctl refuses in one line before launching anything."""
    env = write(tmp_path / "game.py", GAME_ENV)
    res, _, run = agent_run(
        agent_model_dir, tmp_path, [{"prompt": QUESTION}] * 2, "--env", f"{env}:Game2048Env", ok=False
    )
    line = error_line(res)
    assert res.returncode != 0 and "No reward source provided" in line and "get_reward" in line, res.stderr[-2000:]
    assert not (run / "metrics.jsonl").exists()  # nothing trained


ADDER_ENV = '''class AdderEnv:
    """TRL's environment_factory convention: reset(**row) with the row's columns, tools, get_reward."""

    def __init__(self):
        self.target = None
        self.last = None

    def reset(self, **kwargs) -> None:
        self.target = kwargs["target"]
        self.last = None

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.last = a + b
        return self.last

    def get_reward(self) -> float:
        return 1.0 if self.last == self.target else 0.0
'''


def test_a_trl_environment_runs_on_trl_rows_without_an_answer(agent_model_dir, tmp_path):
    """Rows of a prompt and the environment's columns (TRL's docs' layout), no answer and no flag: the
    environment's get_reward scores each trajectory (weight 1, as TRL)."""
    env = write(tmp_path / "adder.py", ADDER_ENV)
    rows = [{"prompt": QUESTION, "target": 7}] * 2
    res, records, run = agent_run(agent_model_dir, tmp_path, rows, "--env", f"{env}:AdderEnv")
    assert records[0]["tool/calls"] > 0 and records[0]["tool/errors"] == 0, failure(res, run)
    got = samples(run)
    assert len(got) == 8 and records[0]["reward/mean"] > 0
    for s in got:  # get_reward's value, computed here from the conversation: the last sum is the target
        results = [m["content"] for m in s["messages"] if m["role"] == "tool"]
        assert s["rewards"] == {"env": 1.0 if results and results[-1] == "7" else 0.0}
        assert s["reward"] == s["rewards"]["env"]


SELF_SERVE_ENV = '''class SelfServeEnv:
    """An environment that samples its own task: no dataset, reset() returns the prompt (TRL's convention)."""

    def reset(self, **kwargs) -> str:
        self.last = None
        return "What is 3 + 4?"

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.last = a + b
        return self.last

    def get_reward(self) -> float:
        return 1.0 if self.last == 7 else 0.0
'''


def test_an_environment_samples_its_own_tasks_without_a_dataset(agent_model_dir, tmp_path):
    """TRL trains an environment_factory without a train_dataset (max_steps set): reset() gives each prompt."""
    env = write(tmp_path / "self_serve.py", SELF_SERVE_ENV)
    run = tmp_path / "run"
    args = [
        "--model", str(agent_model_dir), "--output-dir", str(run), "--device", "cpu", "--nproc", "1",
        "--batch-size", "2", "--n", "4", "--max-prompt-len", "200", "--max-response-len", "96", "--lr", "1e-4",
        "--rollout", "hf", "--max-turns", "3", "--samples-every", "1", "--set", "log.samples=8",
        "--set", "checkpoint.export_hf=false", "--env", f"{env}:SelfServeEnv",
    ]  # fmt: skip
    res = run_cli("grpo", *args)
    assert res.returncode != 0 and "--max-steps" in error_line(res), res.stderr[-2000:]
    res = run_cli("grpo", *args, "--max-steps", "1")
    assert res.returncode == 0, failure(res, run)
    r = train_records(run)[0]
    assert r["tool/calls"] > 0 and r["reward/mean"] > 0
    for s in samples(run):
        assert s["messages"][0] == {"role": "user", "content": "What is 3 + 4?"}
        results = [m["content"] for m in s["messages"] if m["role"] == "tool"]
        assert s["reward"] == (1.0 if results and results[-1] == "7" else 0.0)


SQL_TOOL = '''import signal


class QueryTimeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise QueryTimeout("the query took too long")


def add(a: int, b: int) -> dict:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    signal.signal(signal.SIGALRM, _on_alarm)  # TRL's grpo_agent.py times its SQL queries this way
    signal.alarm(5)
    try:
        return {"sum": a + b}
    finally:
        signal.alarm(0)
'''


def test_a_sync_tool_runs_on_a_main_thread_and_answers_str_of_its_result(agent_model_dir, tmp_path):
    """A sync tool using signal.alarm (main thread only) works, as when TRL calls it on its main thread, and
    the model sees str(result), TRL's text: "{'sum': 7}"."""
    tools = write(tmp_path / "sql_tools.py", SQL_TOOL)
    reward = write(tmp_path / "r.py", "def one(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    rows = [{"prompt": QUESTION}] * 2
    res, records, run = agent_run(agent_model_dir, tmp_path, rows, "--tools", str(tools), "--reward", f"{reward}:one")
    r = records[0]
    assert r["tool/calls"] > 0 and r["tool/errors"] == 0, failure(res, run)
    contents = [m["content"] for s in samples(run) for m in s["messages"] if m["role"] == "tool"]
    assert contents and set(contents) == {str({"sum": 7})}


def test_a_trl_tool_error_is_the_error_dict_trl_shows(tmp_path):
    """A raising tool, an unknown tool: the model sees str({"error": str(e)}), TRL's text."""
    tools = write(
        tmp_path / "tools.py",
        'def divide(a: float, b: float) -> float:\n    """Divide.\n\n    Args:\n        a: A.\n        b: B.\n    """\n'
        "    return a / b\n",
    )
    episode = load_agent_spec(tools=str(tools)).open({})
    assert episode.call(ToolCall("divide", {"a": 1, "b": 0})).content == str({"error": "division by zero"})
    assert episode.call(ToolCall("nope", {})).content == str({"error": "Tool nope not found."})
    missing = episode.call(ToolCall("divide", {"a": 1})).content
    assert missing == str({"error": "divide() missing 1 required positional argument: 'b'"})
    episode.close()

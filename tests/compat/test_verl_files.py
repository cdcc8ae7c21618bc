"""verl users' files, in verl's exact shapes (written here, not copied), run through the CLI and mean what they
mean in verl: rewards called by keyword, ``verl.utils.reward_score`` helpers, tool and interaction classes
importing verl's modules (with or without some verl installed), the score of a verl tool run, ``agent_data``."""

from __future__ import annotations

import re

import pytest

from tests.compat.conftest import agent_run, samples, write
from tests.support.cli import run_cli
from tests.support.rl import error_line, failure, train_records
from tests.support.sft import write_jsonl

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is 3 + 4?"}]


def verl_rows(n: int, source: str = "my/arith") -> list[dict]:
    """Rows as verl's preprocessing scripts write them."""
    return [
        {
            "data_source": source,
            "prompt": QUESTION,
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "7"},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(n)
    ]


def single_turn(model_dir, tmp, rows, reward: str, *extra: str):
    run = tmp / "run"
    data = write_jsonl(tmp / "data.jsonl", rows)
    args = [
        "--model", str(model_dir), "--data", str(data), "--output-dir", str(run), "--device", "cpu", "--nproc", "1",
        "--batch-size", "2", "--n", "4", "--max-prompt-len", "64", "--max-response-len", "24", "--lr", "1e-4",
        "--rollout", "hf", "--max-steps", "1", "--samples-every", "1", "--set", "log.samples=8",
        "--set", "checkpoint.export_hf=false", "--reward", reward, *extra,
    ]  # fmt: skip
    res = run_cli("grpo", *args)
    assert res.returncode == 0, failure(res, run)
    return train_records(run), run


def test_a_verl_reward_is_called_by_keyword(tiny_model_dir, tmp_path):
    """verl's reward managers pass data_source=, solution_str=, ground_truth=, extra_info=: a function whose
    parameters are in another order scores what verl scores (1.0 here), not 0.0."""
    reward = write(
        tmp_path / "my_reward.py",
        "def compute_score(solution_str, ground_truth, data_source, extra_info=None):\n"
        "    ok = data_source == 'my/arith' and ground_truth == '7' and extra_info['split'] == 'train'\n"
        "    return 1.0 if ok and isinstance(solution_str, str) else 0.0\n",
    )
    records, _ = single_turn(tiny_model_dir, tmp_path, verl_rows(4), str(reward))
    assert records[0]["reward/mean"] == 1.0 and records[0]["reward/failed"] == 0


def _verl_gsm8k_flexible(text: str, truth: str, format_score: float) -> float:
    """verl's flexible GSM8K rule, computed here independently: the last number-like run of the last 300
    characters (not '' or '.'), exactly equal to the ground truth."""
    runs = [r for r in re.findall(r"-?[0-9.,]+", text[-300:]) if r not in ("", ".")]
    if not runs:
        return 0.0
    return 1.0 if runs[-1] == truth else format_score


def test_a_verl_reward_importing_verl_reward_score_helpers_runs_without_verl(tiny_model_dir, tmp_path):
    """A custom reward that imports verl.utils.reward_score (as verl's own examples do) runs unchanged."""
    reward = write(
        tmp_path / "shaped_reward.py",
        "from typing import Any, Optional\n\n"
        "from verl.utils.reward_score import gsm8k\n"
        "from verl.utils.reward_score.gsm8k import compute_score as gsm8k_compute_score\n\n\n"
        "def compute_score(\n"
        "    data_source: Optional[str], solution_str: str, ground_truth: str,\n"
        "    extra_info: Optional[dict[str, Any]] = None, **kwargs\n"
        ") -> float:\n"
        "    base = gsm8k_compute_score(solution_str, ground_truth, 'flexible', 0.25, 1.0)\n"
        "    assert gsm8k.extract_solution('#### 1,234', method='strict') == '1234'\n"
        "    return float(base)\n",
    )
    records, run = single_turn(tiny_model_dir, tmp_path, verl_rows(4), str(reward))
    assert records[0]["reward/failed"] == 0
    got = samples(run)
    assert got, "no samples written"
    for s in got:
        assert s["reward"] == _verl_gsm8k_flexible(s["response"], "7", 0.25), s["response"]


VERL_TOOL = '''"""A verl tool in verl's shape: verl's base class, schemas, tracing and reward_score helpers."""

import logging
from typing import Any, Optional
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.utils.reward_score import gsm8k
from verl.utils.rollout_trace import rollout_trace_op

logger = logging.getLogger(__name__)


class AddTool(BaseTool):
    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._instance_dict = {}

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
        if instance_id is None:
            instance_id = str(uuid4())
        truth = kwargs.get("create_kwargs", {}).get("ground_truth")
        self._instance_dict[instance_id] = {"ground_truth": truth}
        return instance_id, ToolResponse()

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        agent_data = kwargs["agent_data"]  # verl's tool agent loop passes it
        assert agent_data.messages[0]["role"] == "user" and agent_data.request_id
        total = int(parameters["a"]) + int(parameters["b"])
        truth = self._instance_dict[instance_id]["ground_truth"]
        right = gsm8k.compute_score(f"#### {total}", truth)
        return ToolResponse(text=str(total)), -0.05, {"right": right}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 1.0

    async def release(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]
'''

VERL_YAML = """tools:
  - class_name: add_tool.AddTool
    config:
      type: native
    tool_schema:
      type: function
      function:
        name: add
        description: Add two integers.
        parameters:
          type: object
          properties:
            a:
              type: integer
              description: The first integer.
            b:
              type: integer
              description: The second integer.
          required: ["a", "b"]
        return:  # not read by verl; the tiny model learnt its tool with it in the rendered schema
          type: integer
"""


def test_a_verl_tool_run_scores_compute_score_alone(agent_model_dir, tmp_path):
    """A verl tool YAML and class (importing verl's modules) run unchanged, execute gets agent_data=, and the
    score is compute_score alone, as in verl's tool agent loop: the tool's step reward (-0.05 per call) is
    reported (samples.jsonl, with every rule reward, the automatic one of the rows' data_source included),
    not added."""
    write(tmp_path / "add_tool.py", VERL_TOOL)
    tools = write(tmp_path / "tool_config.yaml", VERL_YAML)
    reward = write(
        tmp_path / "score.py",
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 1.0 if ground_truth == '7' else 0.0\n",
    )
    rows = verl_rows(2, "openai/gsm8k")
    for r in rows:
        r["extra_info"]["tools_kwargs"] = {"add": {"create_kwargs": {"ground_truth": "7"}}}
    extra = ("--tools", str(tools), "--reward", str(reward), "--reward", "auto")  # auto: the GSM8K rule
    res, records, run = agent_run(agent_model_dir, tmp_path, rows, *extra)
    r = records[0]
    assert r["tool/calls"] > 0 and r["tool/errors"] == 0, failure(res, run)
    got = samples(run)
    called = [s for s in got if any(m["role"] == "tool" for m in s["messages"])]
    assert called and all(m["content"] == "7" for s in called for m in s["messages"] if m["role"] == "tool")
    for s in got:
        calls = sum(m["role"] == "tool" for m in s["messages"])
        strict = re.findall(r"#### (-?[0-9.,]+)", s["response"][-300:])  # verl's GSM8K rule, computed here
        gsm8k = 1.0 if strict and strict[-1].replace(",", "") == "7" else 0.0
        assert s["rewards"]["score"] == 1.0 and s["rewards"]["auto"] == gsm8k
        assert s["reward"] == 1.0 + gsm8k  # the rule rewards alone; summing the tool's would give less
        assert s["rewards"].get("tool", 0.0) == pytest.approx(-0.05 * calls)


INSTALLED_VERL_08 = {  # a stand-in for an installed verl 0.8+ (which has no verl.interactions): real verl does not
    "verl/__init__.py": '__version__ = "0.8.0"\n',  # install here (ray, vLLM...); only its module layout matters
    "verl/tools/__init__.py": "",
}

INTERACTION = """from typing import Any, Optional
from uuid import uuid4

from verl.interactions.base import BaseInteraction


class GuessInteraction(BaseInteraction):
    def __init__(self, config: dict):
        super().__init__(config)
        self._instance_dict = {}

    async def start_interaction(
        self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None, **kwargs
    ) -> str:
        if instance_id is None:
            instance_id = str(uuid4())
        self._instance_dict[instance_id] = {"ground_truth": ground_truth}
        return instance_id

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs
    ) -> tuple[bool, str, float, dict]:
        return True, "Thanks.", 0.0, {}

    async def calculate_score(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]
"""


def test_a_verl_interaction_runs_with_a_newer_verl_installed(agent_model_dir, tmp_path):
    """An interaction importing verl.interactions.base loads when the installed verl lacks that module (0.8+):
    the stand-in covers it module by module; and a verl-bundled class names the verl that has it."""
    site = tmp_path / "site"
    for rel, text in INSTALLED_VERL_08.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    write(tmp_path / "guess.py", INTERACTION)
    config = write(
        tmp_path / "interaction_config.yaml",
        "interaction:\n  - name: guess\n    class_name: guess.GuessInteraction\n    config: {}\n",
    )
    data = write_jsonl(tmp_path / "data.jsonl", verl_rows(2, "openai/gsm8k"))
    base = ["--model", str(agent_model_dir), "--data", str(data), "--device", "cpu", "--dry-run"]
    base += ["--max-prompt-len", "256", "--max-response-len", "128"]  # within the tiny model's 512 tokens
    env = {"PYTHONPATH": f"{site}:{tmp_path}"}
    res = run_cli("grpo", *base, "--interaction", str(config), env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    bundled = write(tmp_path / "bundled.yaml", "tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n")
    res = run_cli("grpo", *base, "--tools", str(bundled), env=env)
    assert res.returncode != 0 and "pip install 'verl<=0.7.1'" in error_line(res), res.stderr[-2000:]

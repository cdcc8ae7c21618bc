"""Each rule of what runs with what is written once, in :mod:`rlctl.support`: no other module of rlctl restates
its condition or its message.

Every rule of ``rlctl.support.RULES`` names what a copy of it looks like (``Rule.restated``: regular
expressions). The scanner reads every other module as ``ast.unparse`` writes it (docstrings dropped, one
quoting style), statement by statement: each simple statement, and each ``if`` (or conditional expression)
with the simple statements of its own body, so a condition is seen beside the refusal it guards. A copy
of a rule put back anywhere fails the first test; the second shows the scanner finds one.
"""

from __future__ import annotations

import ast
import re
import shutil
import textwrap
from pathlib import Path

from rlctl.support import RULES

PACKAGE = Path(__file__).resolve().parents[2] / "rlctl"
HOME = "support"  # the package where the rules live
ASKS = re.compile(r"\b(JobFacts|refuse|problems)\(")  # a statement that builds the facts or asks the table
COMPOUND = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try, ast.FunctionDef, ast.ClassDef)


def _drop_docstrings(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]


def units(source: str) -> list[str]:
    """The pieces of ``source`` the rules' patterns are matched against, each on one line."""
    tree = ast.parse(source)
    _drop_docstrings(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            own = [ast.unparse(s) for s in node.body if not isinstance(s, COMPOUND)]
            out.append(" ".join([ast.unparse(node.test), *own]))
        elif isinstance(node, ast.IfExp):
            out.append(ast.unparse(node))
        elif isinstance(node, ast.stmt) and not isinstance(node, COMPOUND):
            out.append(ast.unparse(node))
    return [" ".join(u.split()) for u in out]


def restatements(root: Path) -> list[str]:
    """``rule: module: code`` for every piece of code under ``root`` (but rlctl/support/) that restates a rule."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] == HOME:
            continue
        for unit in units(path.read_text()):
            if ASKS.search(unit):
                continue
            for rule in RULES.values():
                if any(re.search(p, unit) for p in rule.restated):
                    found.append(f"{rule.name}: {path.relative_to(root)}: {unit[:160]}")
    return found


def test_every_rule_says_what_a_copy_looks_like():
    assert len(RULES) >= 15, sorted(RULES)
    assert all(rule.restated for rule in RULES.values()), [r.name for r in RULES.values() if not r.restated]


def test_no_module_restates_a_rule():
    found = restatements(PACKAGE)
    assert not found, "restated outside rlctl/support/ (ask the rule instead):\n" + "\n".join(found)


# The copies this table replaced, as they stood (one per rule): each is found again if someone re-adds it.
COPIES = {
    "pure_bf16_dtype": """
        if self.pure_bf16 and self.dtype != "bf16":
            raise UserError(f"pure bf16 training needs dtype bf16, got {self.dtype}")
    """,
    "no_shard_one_gpu": """
        if not spec.shard and self.world > 1:
            raise UserError(f"parallel.shard=false runs the plain module on one device, not {self.world}")
    """,
    "critic_vision": """
        if self.vision and role == "critic":
            raise UserError("a vision-language model cannot be a PPO critic yet; train it with grpo (no critic)")
    """,
    "megatron_forced": """
        if cfg.parallel.backend == "megatron":
            raise UserError(f"rlctl {cfg.method} runs on the FSDP engine: use --backend fsdp (or leave it to the plan)")
    """,
    "megatron_pp": """
        if self.pp > 1 and pipeline_split(spec.num_layers, self.pp) is None:
            raise UserError(f"pp {self.pp} cannot split {spec.num_layers} layers")
    """,
    "megatron_ep": """
        if self.ep > 1 and (not spec.is_moe or spec.num_experts % self.ep or (self.gpus // self.pp) % self.ep):
            raise UserError(f"ep {self.ep} must divide the experts ({spec.num_experts}) and the GPUs per stage")
    """,
    "megatron_grid": """
        problem = world_problem(world, tp, pp, cp)
        if problem:
            raise UserError(f"{world} processes cannot be split into tp {tp} x pp {pp} x cp {cp}: {problem}")
    """,
    "rollout_tp_world": """
        if self.is_rl and self.gpus % self.rollout_tp:
            raise UserError(f"rollout tp {self.rollout_tp} must divide the {self.gpus} GPUs")
    """,
    "agent_vision": """
        if vision is not None and agent_spec is not None:
            raise UserError("multi-turn agent runs take text models only; a vision-language model runs single-turn")
    """,
    "fsdp_layout": """
        if self.backend == "fsdp" and (self.tp, self.pp, self.ep, self.cp) != (1, 1, 1, 1):
            raise UserError("the fsdp engine has no tensor, pipeline, expert or context parallelism")
    """,
    "greedy_groups": """
        if cfg.method == "grpo" and float(cfg.rollout.temperature) == 0.0 and int(cfg.rollout.n) > 1:
            raise UserError("--temperature 0 with grpo: ...")
    """,
    "distill_full_engine": """
        if cfg.algo.distill == "full" and spec.backend == "megatron" and (spec.pp > 1 or spec.cp > 1):
            raise UserError(f"algo.distill=full runs on Megatron without pipeline stages (pp={spec.pp})")
    """,
    "teacher_data_split": """
        if cfg.algo.teacher_data and cfg.rollout.procs > 0:
            raise UserError("--teacher-data needs colocated rollout")
    """,
    "sp_backend": """
        if self.backend != "fsdp":
            raise UserError(f"sp {self.sp}: Ulysses sequence parallelism is the fsdp engine's; Megatron uses --cp")
    """,
    "sp_attn": """
        if cfg.model.attn not in (None, "sdpa"):
            return f"model.attn={cfg.model.attn}: Ulysses sequence parallelism runs attention with sdpa per document"
    """,
    "sp_vision": """
        if is_vision_config(c):
            raise UserError(f"parallel.sp={spec.sp}: a vision-language model is not split by sequence")
    """,
    "sp_size": """
        problem = sp_problem(self.sp, self.gpus, spec.num_heads, None)
    """,
    "rollout_tp_node": """
        if tp > 1 and per_node % tp:
            raise UserError(f"rollout.tp={tp} would split a rollout engine across nodes ({per_node} per node)")
    """,
    "split_stream": """
        if r.stream_chunk < 1:
            return f"rollout.stream_chunk={r.stream_chunk} must be >= 1 (tokens between weight checks; 32 by default)"
    """,
    "split_values": """
        if r.procs < 0:
            raise UserError(f"rollout.procs={r.procs} must be >= 0 (0: no split; N: N processes only generate)")
    """,
    "split_method": """
        if cfg.method not in ("grpo",):
            problem = f"{cfg.method} is not supported with {flag}"
    """,
    "split_trainer": """
        split = c.rollout.procs if 0 < c.rollout.procs < job.world else 0
    """,
    "split_nodes": """
        if nodes > 1:
            problem = f"{flag} runs on one node ({nodes} given): use --nodes 1"
    """,
    "split_rollout_tp": """
        if r.tp > 1:
            problem = f"{flag} runs one rollout engine per process (rollout.tp={r.tp}): use --rollout-tp 1"
    """,
    "split_megatron": """
        if cfg.rollout.procs and cfg.parallel.backend == "megatron":
            problem = "no split with megatron"
    """,
    "split_sp": """
        if cfg.rollout.procs:
            return f"rollout.procs={cfg.rollout.procs}: one-step-off-policy runs without sequence parallelism"
    """,
    "split_vision": """
        if self.vision is not None and d.split is not None:
            raise UserError("--rollout-procs runs text models only (a vision-language model's images are not sent)")
    """,
    "behaviour_weighed_twice": """
        if facts.weighs_behaviour and a.rollout_correction in ("tis", "mis"):
            raise UserError("decoupled and a rollout correction: each token weighted twice")
    """,
    "split_sampling": """
        if cfg.rollout.procs and (facts.needs_greedy or a.dynamic_sampling):
            raise UserError("not with a split")
    """,
}


def test_a_copy_put_back_is_found(tmp_path):
    """Each rule's old copy, written into a module of a tree like rlctl's, is found and named; the tree
    without it is clean."""
    assert set(COPIES) == set(RULES), set(RULES) ^ set(COPIES)
    shutil.copytree(PACKAGE / HOME, tmp_path / HOME)  # the home itself is skipped
    (tmp_path / "plain.py").write_text("def f(x):\n    '''procs >= sp'''\n    return x\n")  # docstrings are prose
    assert restatements(tmp_path) == []
    for name, code in COPIES.items():
        copy = tmp_path / "engines" / "copy.py"
        copy.parent.mkdir(exist_ok=True)
        copy.write_text(
            "def guard(self, cfg, spec, c, d, r, job, role, flag, nodes, facts, a, tp, per_node):\n"
            + textwrap.indent(textwrap.dedent(code), "    ")
        )
        names = {line.split(":")[0] for line in restatements(tmp_path)}
        assert name in names, (name, restatements(tmp_path))

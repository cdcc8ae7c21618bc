"""What runs with what: every rule once, over one record of a job (:class:`JobFacts`).

Each rule is a pure function of the facts returning a :class:`Problem` (the one-line message and its fix)
or None, registered in :data:`RULES` by name. The planner, the estimator, the pre-launch checks and the
ranks' guards build the facts they have and ask the rules by name (:func:`refuse`, :func:`problems`);
none restates a rule's condition (``tests/layout/test_rules_once.py`` greps for copies). Torch-free;
imports only layer-0 facts.

The frame is :mod:`.table`; the rules are grouped by what they are about: :mod:`.engine` (Megatron's
sizes, precision and sharding, Ulysses SP), :mod:`.method` (a critic, agents, GRPO's groups) and
:mod:`.split` (a split run, a rollout engine's tensor parallelism).
"""

from rlctl.support import method  # its rules register on import
from rlctl.support.engine import SP_REFUSALS, SP_RULES, megatron_gap
from rlctl.support.split import SPLIT_FLAG, SPLIT_RULES
from rlctl.support.table import RULES, JobFacts, Problem, Rule, model_facts, problems, refuse, rule

__all__ = [
    "RULES",
    "SPLIT_FLAG",
    "SPLIT_RULES",
    "SP_REFUSALS",
    "SP_RULES",
    "JobFacts",
    "Problem",
    "Rule",
    "method",
    "megatron_gap",
    "model_facts",
    "problems",
    "refuse",
    "rule",
]

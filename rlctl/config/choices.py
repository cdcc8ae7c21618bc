"""Which algorithm settings go together, checked once, before launch and again on the ranks.

The facts of each advantage estimator (does it need PPO's critic? does it compare the samples of one
prompt?) live here without torch, so `rlctl.job` can check a job in well under a second; the registry
in :mod:`rlctl.algos.registry` registers the same names with the same facts (a test holds them equal).
"""

from __future__ import annotations

from typing import NamedTuple

from rlctl.errors import UserError


class AdvFacts(NamedTuple):
    needs_critic: bool  # GAE: values from a critic, so `rlctl ppo`
    needs_groups: bool  # compares the samples of one prompt: rollout.n >= 2


ADV_FACTS = {
    "grpo": AdvFacts(needs_critic=False, needs_groups=True),
    "rloo": AdvFacts(needs_critic=False, needs_groups=True),
    "reinforce_pp": AdvFacts(needs_critic=False, needs_groups=False),
    "gae": AdvFacts(needs_critic=True, needs_groups=False),
}


def check_algorithm(method: str, adv: str, *, n: int, kl_coef: float, kl_target: float) -> None:
    """A one-line UserError for settings that cannot run together (the method's critic and the
    estimator, group advantages with one sample per prompt, adaptive KL without a start value)."""
    if method not in ("grpo", "ppo"):
        return
    if kl_target and not kl_coef:
        raise UserError("algo.kl_target (adaptive KL) needs an initial algo.kl_coef > 0, e.g. --kl-coef 0.001")
    facts = ADV_FACTS.get(adv)
    if facts is None:
        return  # an unknown name is the config's did-you-mean error, or a user-registered estimator
    if method == "grpo" and facts.needs_critic:
        raise UserError(f"grpo cannot use --adv {adv}: it needs a critic, use `rlctl ppo` (or --adv grpo | rloo)")
    if method == "ppo" and not facts.needs_critic:
        raise UserError(
            f"rlctl ppo trains a critic for GAE advantages; --adv {adv} needs no critic: "
            f"use `rlctl grpo --adv {adv}` or --adv gae"
        )
    if facts.needs_groups and n < 2:
        raise UserError(f"--adv {adv} compares the samples of a prompt; set rollout.n >= 2 (e.g. --n 8)")

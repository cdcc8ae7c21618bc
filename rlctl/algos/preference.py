"""Preference losses registered by name (``pref.loss``), as :mod:`rlctl.algos.registry` registers the
policy losses: the config names one, ``rlctl dpo`` looks it up; no recipe branches on the loss.

No torch here: the CLI checks ``pref.loss`` and what the loss needs (a reference model, pairs or
unpaired rows) before launch. A built-in's function is ``"module:function"``, imported on first use; a
plugin (``--plugin my_loss.py``) registers its own with :func:`register_pref_loss`.

Every loss has one signature, per pair (or per row for an unpaired loss such as KTO)::

    fn(inputs: PrefInputs, *, beta, label_smoothing, gamma) -> (losses [P], chosen_rewards [P], rejected_rewards [P])

where :class:`rlctl.algos.preference_losses.PrefInputs` holds the policy's and the reference's summed
log-probs of the chosen and rejected responses and their lengths (in tokens). The recipe averages
``losses`` over the global batch. The built-ins follow TRL's (1.x) ``loss_type`` names and formulas;
their sources are in docs/dpo.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlctl.algos.registry import Target, _load, _where
from rlctl.errors import UserError, did_you_mean


@dataclass(frozen=True)
class PrefLoss:
    name: str
    target: Target
    needs_ref: bool  # the reference model's log-probs enter the loss (SimPO, ORPO: no)
    paired: bool  # chosen and rejected of one prompt (KTO: unpaired rows with a good/bad label)
    beta: float  # its default beta (TRL's default for the trainer that has it)
    nll: bool = False  # adds the chosen responses' per-token NLL (ORPO's SFT term)

    @property
    def fn(self) -> Callable[..., Any]:
        return _load(self.target)


PREF_LOSSES: dict[str, PrefLoss] = {}


def register_pref_loss(name: str, *, needs_ref: bool, paired: bool = True, beta: float, nll: bool = False) -> Callable:
    """Decorator: register a preference loss under ``name`` (the value of ``pref.loss``)."""

    def wrap(fn: Target) -> Target:
        if not isinstance(name, str) or not name.strip():
            raise UserError(f"pref.loss: a registered name must be a non-empty string, got {name!r}")
        if name in PREF_LOSSES:
            raise UserError(
                f"pref.loss {name!r} is already registered ({_where(PREF_LOSSES[name].target)}); "
                f"register {_where(fn)} under another name"
            )
        PREF_LOSSES[name] = PrefLoss(name, fn, needs_ref, paired, beta, nll)
        return fn

    return wrap


def get_pref_loss(name: str) -> PrefLoss:
    if name not in PREF_LOSSES:
        raise UserError(
            f"unknown preference loss pref.loss={name!r}{did_you_mean(name, PREF_LOSSES)}; choose one of "
            f"{', '.join(PREF_LOSSES)} (a plugin can register more: docs/plugins.md)"
        )
    return PREF_LOSSES[name]


def pref_loss_names() -> tuple[str, ...]:
    return tuple(PREF_LOSSES)


# ---------------------------------------------------------------------------------------------
# The built-ins (TRL's names; beta: TRL's DPOConfig 0.1, CPOConfig for SimPO, ORPOConfig, KTOConfig)

_L = "rlctl.algos.preference_losses"
register_pref_loss("sigmoid", needs_ref=True, beta=0.1)(f"{_L}:sigmoid_loss")
register_pref_loss("robust", needs_ref=True, beta=0.1)(f"{_L}:robust_loss")
register_pref_loss("hinge", needs_ref=True, beta=0.1)(f"{_L}:hinge_loss")
register_pref_loss("ipo", needs_ref=True, beta=0.1)(f"{_L}:ipo_loss")
register_pref_loss("simpo", needs_ref=False, beta=2.0)(f"{_L}:simpo_loss")
register_pref_loss("orpo", needs_ref=False, beta=0.1, nll=True)(f"{_L}:orpo_loss")
register_pref_loss("kto", needs_ref=True, paired=False, beta=0.1)(f"{_L}:kto_loss")

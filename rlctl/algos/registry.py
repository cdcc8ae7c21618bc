"""Advantage estimators and policy losses registered by name (as verl's ``register_adv_est`` /
``register_policy_loss``): the config names one (``algo.adv``, ``algo.policy_loss``) and the recipe
looks it up; no recipe branches on the algorithm.

This module imports no torch: the CLI checks a config's names and the algorithm's facts against it
before launch. A built-in's function is named as ``"module:function"`` and imported on first use; a
plugin (``--plugin my_loss.py``, docs/plugins.md) registers its own with the same decorators, and a
name registered twice is refused.

A policy loss carries its OWN defaults (clip range, dual clip, loss aggregation): PPO clips at
0.2/0.2 with a dual clip of 3 and averages over tokens; GSPO clips its sequence ratio at 3e-4/4e-4
with no dual clip and aggregates seq-mean-token-mean (Zheng et al. 2025). A config key the user set
(not None) wins over the loss's default: :func:`resolve_policy_loss`.

Every advantage estimator has one signature, on the global batch (rows ordered by uid, ``n``
consecutive rows per prompt)::

    estimator(rewards [B, T], mask [B, T], *, n, values [B, T] | None, gamma, lam, norm_by_std)
        -> (advantages [B, T], returns [B, T])

(plus ``reward_baselines [B]``, the score of each row's prompt's greedy response, for an estimator
registered with ``needs_greedy``: remax.)

Every policy loss: ``fn(ctx) -> (loss, metrics)`` on one :class:`rlctl.algos.losses.PolicyLossContext`
(log-probs, advantages, mask, the resolved clip settings and aggregation, the denominators, the rollout
correction's weights, the behaviour log-probs). A plugin written for the older keyword form,
``fn(logp, old_logp, advantages, mask, *, clip_low, clip_high, dual_clip, agg, norm_len, global_tokens,
global_seqs[, is_weights])``, is told apart by its parameters when it registers and called that way
(:func:`call_style`); any other form is refused.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from rlctl.errors import UserError, did_you_mean
from rlctl.names import LossAgg, choices

Target = Callable[..., Any] | str  # the function, or "module:function" imported on first use


def _load(target: Target) -> Callable[..., Any]:
    if callable(target):
        return target
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def _where(target: Target) -> str:
    return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


@dataclass(frozen=True)
class AdvEstimator:
    name: str
    target: Target
    needs_critic: bool  # GAE: values from a critic (rlctl ppo)
    needs_groups: bool  # compares the samples of one prompt: rollout.n >= 2
    # the score of one greedy (temperature 0) response per prompt, ``reward_baselines=`` [B] (remax): the
    # recipe generates and scores it
    needs_greedy: bool = False

    @property
    def fn(self) -> Callable[..., Any]:
        return _load(self.target)


CallStyle = Literal["context", "keywords"]


def call_style(fn: Callable[..., Any], name: str) -> CallStyle:
    """How a policy loss takes its inputs, from its parameters: one positional (``fn(ctx)``), or the older
    four positional tensors with the settings as keywords. Anything else is a one-line :class:`UserError`."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return "context"  # a builtin or C function: called as documented
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p.name for p in params if p.kind in positional and p.default is p.empty]
    takes_rest = any(p.kind is p.VAR_POSITIONAL for p in params)
    if len(required) == 1 or (not required and takes_rest):
        return "context"
    if len(required) == 4:
        return "keywords"
    raise UserError(
        f"policy loss {name!r} ({_where(fn)}) takes {len(required)} positional parameter(s) "
        f"({', '.join(required) or 'none'}); write it as fn(ctx) on rlctl.algos.losses.PolicyLossContext "
        "(docs/plugins.md)"
    )


def _keywords_call(fn: Callable[..., Any], ctx: Any, **knobs: Any) -> Any:
    """A keyword-form loss called as before: the four tensors, the settings, ``is_weights`` only when on."""
    settings = {k: getattr(ctx, k) for k in ("clip_low", "clip_high", "dual_clip", "agg")}
    denoms = {k: getattr(ctx, k) for k in ("global_tokens", "global_seqs", "norm_len")}
    weights = {} if ctx.is_weights is None else {"is_weights": ctx.is_weights}
    return fn(ctx.logp, ctx.old_logp, ctx.advantages, ctx.mask, **settings, **denoms, **weights, **knobs)


@dataclass(frozen=True)
class PolicyLoss:
    name: str
    target: Target
    clip_low: float
    clip_high: float
    dual_clip: float | None
    agg: str
    style: CallStyle | None = None  # a callable's, told at registration; a "module:function"'s, on first use
    # the loss weighs each token by proximal / behaviour itself (ctx.behav_logp: decoupled PPO), so the rollout
    # correction, which weighs by the same ratio, stays off (rlctl.support.behaviour_weighed_twice)
    weighs_behaviour: bool = False
    metrics: tuple[str, ...] = ()  # the loss's own per-token-mean metrics, logged as pg/<name>

    @property
    def fn(self) -> Callable[..., Any]:
        """The loss as ``fn(ctx, **knobs)``, whichever form it was written in."""
        fn = _load(self.target)
        style = self.style or call_style(fn, self.name)
        return fn if style == "context" else functools.partial(_keywords_call, fn)


@dataclass(frozen=True)
class PolicyLossSettings:
    """What reaches the loss after the user's keys and the loss's defaults are merged."""

    loss: PolicyLoss
    clip_low: float
    clip_high: float
    dual_clip: float | None  # None: off
    agg: str
    knobs: tuple[tuple[str, float], ...] = ()  # the loss's own keyword arguments set from the config (decoupled: cap)

    def call(self, ctx: Any) -> tuple[Any, dict[str, Any]]:
        """The loss on ``ctx`` with its knobs."""
        return self.loss.fn(ctx, **dict(self.knobs))

    def as_metrics(self) -> dict[str, float | str]:
        return {
            "policy_loss": self.loss.name,
            "clip_low": self.clip_low,
            "clip_high": self.clip_high,
            "dual_clip": self.dual_clip or 0.0,
            "loss_agg": self.agg,
            **dict(self.knobs),
        }


ADV_ESTIMATORS: dict[str, AdvEstimator] = {}
POLICY_LOSSES: dict[str, PolicyLoss] = {}


def _add(table: dict, key: str, entry: AdvEstimator | PolicyLoss) -> None:
    if not isinstance(entry.name, str) or not entry.name.strip():
        raise UserError(f"{key}: a registered name must be a non-empty string, got {entry.name!r}")
    old = table.get(entry.name)
    if old is not None:
        raise UserError(
            f"{key} {entry.name!r} is already registered ({_where(old.target)}); "
            f"register {_where(entry.target)} under another name"
        )
    table[entry.name] = entry


def register_adv_est(
    name: str, *, needs_critic: bool = False, needs_groups: bool = False, needs_greedy: bool = False
) -> Callable:
    """Decorator: register an advantage estimator under ``name`` (the value of ``algo.adv``). With
    ``needs_greedy`` the recipe also generates one greedy response per prompt and passes its score,
    per row, as ``reward_baselines=``."""

    def wrap(fn: Target) -> Target:
        _add(ADV_ESTIMATORS, "algo.adv", AdvEstimator(name, fn, needs_critic, needs_groups, needs_greedy))
        return fn

    return wrap


def register_policy_loss(
    name: str,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    agg: str,
    weighs_behaviour: bool = False,
    metrics: tuple[str, ...] = (),
) -> Callable:
    """Decorator: register a policy loss under ``name`` (the value of ``algo.policy_loss``) with its
    defaults; ``agg`` is one of :data:`rlctl.names.LossAgg`. ``weighs_behaviour``: the loss weighs tokens by
    proximal / behaviour log-probs itself (the rollout correction is then off); ``metrics``: names of the
    token means it returns besides ``clip_frac`` and ``approx_kl``, logged as ``pg/<name>``."""
    if agg not in choices(LossAgg):
        raise UserError(
            f"policy loss {name!r}: agg={agg!r} is not valid{did_you_mean(agg, choices(LossAgg))}; "
            f"choose one of {', '.join(choices(LossAgg))}"
        )

    def wrap(fn: Target) -> Target:
        style = call_style(fn, name) if callable(fn) else None
        entry = PolicyLoss(name, fn, clip_low, clip_high, dual_clip, agg, style, weighs_behaviour, tuple(metrics))
        _add(POLICY_LOSSES, "algo.policy_loss", entry)
        return fn

    return wrap


def adv_names(*, needs_critic: bool | None = None) -> tuple[str, ...]:
    """The registered estimators (those with or without a critic when ``needs_critic`` is given)."""
    return tuple(n for n, e in ADV_ESTIMATORS.items() if needs_critic in (None, e.needs_critic))


def policy_loss_names() -> tuple[str, ...]:
    return tuple(POLICY_LOSSES)


def _get(table: dict, key: str, what: str, name: str):
    if name not in table:
        raise UserError(
            f"unknown {what} {key}={name!r}{did_you_mean(name, table)}; choose one of {', '.join(table)} "
            f"(a plugin can register more: docs/plugins.md)"
        )
    return table[name]


def get_adv_estimator(name: str) -> AdvEstimator:
    return _get(ADV_ESTIMATORS, "algo.adv", "advantage estimator", name)


def get_policy_loss(name: str) -> PolicyLoss:
    return _get(POLICY_LOSSES, "algo.policy_loss", "policy loss", name)


def resolve_policy_loss(
    name: str,
    *,
    clip_low: float | None,
    clip_high: float | None,
    dual_clip: float | None,
    agg: str | None,
    knobs: dict[str, float] | None = None,
) -> PolicyLossSettings:
    """The loss ``name`` with the user's settings where given (not None) and its own defaults elsewhere.
    ``dual_clip=0`` (set by the user) turns the dual clip off; ``knobs``: the loss's own keyword arguments."""
    loss = get_policy_loss(name)
    return PolicyLossSettings(
        loss,
        loss.clip_low if clip_low is None else clip_low,
        loss.clip_high if clip_high is None else clip_high,
        (loss.dual_clip if dual_clip is None else dual_clip) or None,
        loss.agg if agg is None else agg,
        tuple(sorted((knobs or {}).items())),
    )


# ---------------------------------------------------------------------------------------------
# The built-ins (their functions are imported on first use)

register_policy_loss("ppo", clip_low=0.2, clip_high=0.2, dual_clip=3.0, agg="token-mean")(
    "rlctl.algos.losses:ppo_policy_loss"
)
register_policy_loss("gspo", clip_low=3e-4, clip_high=4e-4, dual_clip=None, agg="seq-mean-token-mean")(
    "rlctl.algos.losses:gspo_policy_loss"
)
register_adv_est("grpo", needs_groups=True)("rlctl.algos.estimators:grpo_advantages")
register_adv_est("rloo", needs_groups=True)("rlctl.algos.estimators:rloo_advantages")
register_adv_est("reinforce_pp")("rlctl.algos.estimators:reinforce_pp_advantages")
register_adv_est("gae", needs_critic=True)("rlctl.algos.estimators:gae_advantages")

# More of verl's registry, under verl's names (a verl config ports by name; docs/algos.md)
_PL = "rlctl.algos.policy_losses"
register_policy_loss("cispo", clip_low=10.0, clip_high=0.2, dual_clip=None, agg="token-mean")(
    f"{_PL}:cispo_policy_loss"
)
register_policy_loss("gpg", clip_low=0.2, clip_high=0.2, dual_clip=None, agg="token-mean")(f"{_PL}:gpg_policy_loss")
register_policy_loss("geo_mean", clip_low=0.4, clip_high=0.4, dual_clip=None, agg="seq-mean-token-mean")(
    f"{_PL}:geo_mean_policy_loss"
)
register_policy_loss("clip_cov", clip_low=0.2, clip_high=0.2, dual_clip=None, agg="token-mean")(
    f"{_PL}:clip_cov_policy_loss"
)
register_policy_loss("kl_cov", clip_low=0.2, clip_high=0.2, dual_clip=None, agg="token-mean")(
    f"{_PL}:kl_cov_policy_loss"
)
register_policy_loss("sapo", clip_low=0.2, clip_high=0.2, dual_clip=None, agg="seq-mean-token-mean")(
    f"{_PL}:sapo_policy_loss"
)
# streaming RL (docs/async.md): AReaL's decoupled PPO, clipped against the proximal policy, weighted by
# proximal / behaviour
register_policy_loss(
    "decoupled",
    clip_low=0.2,
    clip_high=0.2,
    dual_clip=None,
    agg="token-mean",
    weighs_behaviour=True,
    metrics=("behav_w_mean", "behav_w_masked"),
)("rlctl.algos.decoupled:decoupled_policy_loss")
register_adv_est("grpo_passk", needs_groups=True)("rlctl.algos.estimators:grpo_passk_advantages")
register_adv_est("reinforce_plus_plus_baseline", needs_groups=True)(
    "rlctl.algos.estimators:reinforce_pp_baseline_advantages"
)
register_adv_est("opo", needs_groups=True)("rlctl.algos.estimators:opo_advantages")
register_adv_est("gpg", needs_groups=True)("rlctl.algos.estimators:gpg_advantages")
register_adv_est("remax", needs_greedy=True)("rlctl.algos.estimators:remax_advantages")

"""The algorithm settings of a config, checked against the registry (:mod:`rlctl.algos.registry`, no
torch): the names of ``algo.adv`` and ``algo.policy_loss`` (the built-ins and any plugin's), and the
settings that cannot run together. Checked before launch (:mod:`rlctl.checks`) and again on the ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlctl.algos.preference import PREF_LOSSES
from rlctl.algos.registry import ADV_ESTIMATORS, POLICY_LOSSES
from rlctl.errors import UserError, did_you_mean
from rlctl.names import PAIR_METHODS, RL_METHODS
from rlctl.support import JobFacts, refuse

if TYPE_CHECKING:
    from rlctl.config.schema import RunConfig

PLUGIN_HINT = "a plugin can register more: --plugin FILE.py, docs/plugins.md"


def check_registered_names(cfg: RunConfig) -> None:
    """``algo.adv`` and ``algo.policy_loss`` name registered entries (after the plugins are imported)."""
    for key, value, table in (
        ("algo.adv", cfg.algo.adv, ADV_ESTIMATORS),
        ("algo.policy_loss", cfg.algo.policy_loss, POLICY_LOSSES),
        ("pref.loss", cfg.pref.loss, PREF_LOSSES),
    ):
        if value not in table:
            raise UserError(
                f"{key}={value!r} is not valid{did_you_mean(str(value), table)}; "
                f"choose one of {', '.join(table)} ({PLUGIN_HINT})"
            )


def check_algorithm(cfg: RunConfig) -> None:
    """A one-line UserError for settings that cannot run together (the method's critic and the
    estimator, group advantages with one sample per prompt, adaptive KL without a start value)."""
    method, a, n = cfg.method, cfg.algo, cfg.rollout.n
    if method in PAIR_METHODS:
        return check_preference(cfg)
    if method not in RL_METHODS:
        return
    if a.kl_target and not a.kl_coef:
        raise UserError("algo.kl_target (adaptive KL) needs an initial algo.kl_coef > 0, e.g. --kl-coef 0.001")
    check_registered_names(cfg)
    check_correction(cfg)
    check_dapo(cfg)
    check_distill(cfg)
    facts = ADV_ESTIMATORS[a.adv]
    if method == "grpo" and facts.needs_critic:
        others = " | ".join(name for name, e in ADV_ESTIMATORS.items() if not e.needs_critic)
        raise UserError(f"grpo cannot use --adv {a.adv}: it needs a critic, use `rlctl ppo` (or --adv {others})")
    if method == "ppo" and not facts.needs_critic:
        critics = " | ".join(name for name, e in ADV_ESTIMATORS.items() if e.needs_critic)
        raise UserError(
            f"rlctl ppo trains a critic for GAE advantages; --adv {a.adv} needs no critic: "
            f"use `rlctl grpo --adv {a.adv}` or --adv {critics}"
        )
    if facts.needs_groups and n < 2:
        raise UserError(f"--adv {a.adv} compares the samples of a prompt; set rollout.n >= 2 (e.g. --n 8)")
    refuse(JobFacts.of(cfg), "split_sampling", "behaviour_weighed_twice")


def check_correction(cfg: RunConfig) -> None:
    """The rollout-correction bounds (algo.correction_*) make an interval around 1."""
    a = cfg.algo
    if not a.correction_threshold >= 1:
        raise UserError(
            f"algo.correction_threshold={a.correction_threshold} must be >= 1 (the upper bound U, e.g. 2.0)"
        )
    if a.correction_lower is not None and not 0 < a.correction_lower <= 1:
        raise UserError(f"algo.correction_lower={a.correction_lower} must be in (0, 1] (e.g. 0.5; unset: 1/U)")
    if a.correction_reject is not None and not a.correction_reject >= 1:
        raise UserError(f"algo.correction_reject={a.correction_reject} must be >= 1 (sequences outside [1/R, R] drop)")
    if not a.decoupled_cap > 1:
        raise UserError(
            f"algo.decoupled_cap={a.decoupled_cap} must be > 1 (--policy-loss decoupled drops tokens whose "
            "proximal / behaviour weight exceeds it; AReaL's 5.0)"
        )


def check_distill(cfg: RunConfig) -> None:
    """On-policy distillation: the teacher's weight mixes two advantages, so it is a share."""
    a = cfg.algo
    if not 0 <= a.teacher_weight <= 1:
        raise UserError(
            f"algo.teacher_weight={a.teacher_weight} must be in [0, 1] (1: distillation only, 0.5: half the task "
            f"reward's advantage), e.g. --teacher-weight 1"
        )
    if a.teacher_baseline and not a.teacher:
        raise UserError("algo.teacher_baseline is set without a teacher; pass --teacher MODEL (or drop it)")
    if a.teacher_weight != 1 and not a.teacher:
        raise UserError("algo.teacher_weight is set without a teacher; pass --teacher MODEL (or drop --teacher-weight)")
    if a.distill == "full" and not a.teacher:
        raise UserError("algo.distill=full is set without a teacher; pass --teacher MODEL (or drop it)")
    if a.distill == "full" and a.teacher_baseline:
        raise UserError("algo.teacher_baseline is for algo.distill=sampled (full has no sampled gap); drop one")
    if not 0 <= a.distill_beta <= 1:
        raise UserError(
            f"algo.distill_beta={a.distill_beta} must be in [0, 1] (1: reverse KL, 0: forward KL, 0.5: JSD)"
        )
    if a.distill_beta != 1 and a.distill != "full":
        raise UserError("algo.distill_beta picks algo.distill=full's divergence; add --set algo.distill=full")
    check_teacher_data(cfg)
    refuse(JobFacts.of(cfg), "distill_full_engine")
    refuse(JobFacts.of(cfg), "teacher_data_split")


def check_teacher_data(cfg: RunConfig) -> None:
    """GKD's mixture: steps on the teacher's own responses train the full-vocabulary loss only (a policy
    gradient on samples the student did not draw would be biased), so it needs ``algo.distill=full``."""
    a = cfg.algo
    if not 0 <= a.teacher_data_fraction <= 1:
        raise UserError(
            f"algo.teacher_data_fraction={a.teacher_data_fraction} must be in [0, 1] (the share of the steps "
            "on --teacher-data's rows; TRL GKD's 1 - lmbda)"
        )
    if a.teacher_data_warmup < 0:
        raise UserError(f"algo.teacher_data_warmup={a.teacher_data_warmup} must be >= 0 (steps)")
    if not a.teacher_data:
        from rlctl.config.schema import AlgoConfig

        if a.teacher_data_warmup or a.teacher_data_fraction != AlgoConfig.teacher_data_fraction:
            raise UserError("algo.teacher_data_fraction / _warmup are set without --teacher-data FILE; add it")
        return
    if not a.teacher:
        raise UserError("--teacher-data is set without a teacher; pass --teacher MODEL (or drop it)")
    if a.distill != "full":
        raise UserError(
            "--teacher-data trains the full-vocabulary loss on the teacher's responses; add --set algo.distill=full"
        )


def teacher_vocab_problem(student: dict[str, int], teacher: dict[str, int], model: str, name: str) -> str | None:
    """The one line refusing a teacher whose tokenizer maps tokens to other ids than the student's (token ->
    id, added tokens included): it would score the student's ids as other tokens."""
    if student == teacher:
        return None
    odd = sorted(set(student.items()) ^ set(teacher.items()), key=lambda kv: kv[1])
    first = f"; first difference: token {odd[0][0]!r}" if odd else ""
    return (
        f"--teacher {name} has a different vocabulary from --model {model} ({len(teacher)} vs {len(student)} "
        f"tokens{first}); the teacher scores the student's token ids: pick a teacher with the student's tokenizer"
    )


def check_dapo(cfg: RunConfig) -> None:
    """DAPO's settings: the soft overlong buffer fits under the generation cap; dynamic sampling compares
    the samples of a prompt (rollout.n >= 2) in a bounded number of rounds."""
    a, cap = cfg.algo, cfg.rollout.max_response_len
    if not 0 <= a.overlong_buffer <= cap:
        raise UserError(
            f"algo.overlong_buffer={a.overlong_buffer} must be in 0..rollout.max_response_len ({cap}): "
            f"the penalty ramps over the last overlong_buffer tokens before the cap; set e.g. "
            f"--overlong-buffer {cap // 5} (DAPO: 4096 of 20480) or 0 (off)"
        )
    if a.dynamic_sampling and cfg.rollout.n < 2:
        raise UserError("algo.dynamic_sampling drops prompts whose samples all score the same; set rollout.n >= 2")
    if a.dynamic_max_rounds < 1:
        raise UserError(
            f"algo.dynamic_max_rounds={a.dynamic_max_rounds} must be >= 1 (rounds of rollout per step, e.g. 10)"
        )


def check_preference(cfg: RunConfig) -> None:
    """`rlctl dpo` / `rlctl rm`: the loss's settings in range, and the engine that runs them."""
    p = cfg.pref
    check_registered_names(cfg)
    refuse(JobFacts.of(cfg), "megatron_forced")
    if p.beta is not None and p.beta <= 0:
        raise UserError(f"pref.beta={p.beta} must be > 0 (e.g. --beta 0.1), or unset for the loss's default")
    if not 0 <= p.label_smoothing < 0.5:
        raise UserError(f"pref.label_smoothing={p.label_smoothing} must be in [0, 0.5) (the share of flipped labels)")
    if p.desirable_weight <= 0 or p.undesirable_weight <= 0:
        raise UserError("pref.desirable_weight and pref.undesirable_weight must be > 0 (kto's class weights)")
    if p.center_rewards < 0:
        raise UserError(f"pref.center_rewards={p.center_rewards} must be >= 0 (e.g. 0.01; 0 = off)")
    pair_budget(cfg)


def pair_budget(cfg: RunConfig) -> int:
    """dpo / rm: tokens per packed micro-batch: train.max_tokens_per_micro_batch, else micro_batch_size pairs of
    two sequences of train.max_len; a whole pair must fit."""
    pairs = cfg.train.micro_batch_size or 1
    budget = cfg.train.max_tokens_per_micro_batch or pairs * 2 * cfg.train.max_len
    if budget < 2 * cfg.train.max_len:
        raise UserError(
            f"train.max_tokens_per_micro_batch={budget} is below 2 x train.max_len={2 * cfg.train.max_len}; a pair "
            f"(its chosen and rejected sequences) must fit in one micro-batch: raise it or lower --max-len"
        )
    return budget

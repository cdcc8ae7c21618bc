"""What a method runs with: a PPO critic, multi-turn agents and GRPO's sampled groups, by the model and the
sampling; a policy loss with a rollout correction; on-policy distillation's full-vocabulary loss by the layout."""

from __future__ import annotations

from rlctl.support.table import JobFacts, Problem, rule


@rule(
    r"is_vl\s+and\s+[\w.]*method\s*==\s*'ppo'",
    r"vision\s+and\s+role\s*==\s*'critic'",
    r"cannot be a PPO critic|critic, which a vision",
)
def critic_vision(f: JobFacts) -> Problem | None:
    if f.method == "ppo" and f.vision:
        return Problem(
            "critic_vision", "ppo trains a critic, which a vision-language model cannot be yet", "use grpo (no critic)"
        )
    return None


@rule(
    r"(is_vl|vision)\b[^,;]{0,30}\s+and\s+[\w.]*agent",
    r"\bagent\w*[^,;]{0,30}\s+and\s+[\w.]*(is_vl|vision)\b",
    r"take text models only",
)
def agent_vision(f: JobFacts) -> Problem | None:
    """The agent loop's turns are text: a vision-language model's images are not carried across turns yet."""
    if f.agent and f.vision:
        return Problem(
            "agent_vision",
            f"multi-turn agent runs (--tools / --env / --interaction) take text models only: {f.model} is a "
            "vision-language model, which runs single-turn",
            "drop the agent options for this model",
        )
    return None


@rule(r"'grpo'.{0,60}temperature\)?\s*==\s*0", r"temperature 0 with grpo")
def greedy_groups(f: JobFacts) -> Problem | None:
    """GRPO compares the samples of a prompt: greedy ones are all the same, every advantage 0."""
    if f.method == "grpo" and f.temperature == 0.0 and f.samples > 1:
        return Problem(
            "greedy_groups",
            "--temperature 0 with grpo: the n responses to a prompt are all the same greedy one, so every "
            "advantage is 0 and nothing is learned",
            "sample with --temperature 1.0 (0.6 or more)",
        )
    return None


@rule(r"weighs_behaviour.{0,80}rollout_correction\s*in", r"would weigh each token twice")
def behaviour_weighed_twice(f: JobFacts) -> Problem | None:
    """Decoupled PPO weighs each token by proximal / behaviour, the ratio the rollout correction weighs by."""
    if f.behaviour_loss and f.correction in ("tis", "mis"):
        return Problem(
            "behaviour_weighed_twice",
            f"--policy-loss {f.behaviour_loss} weighs each token by proximal / behaviour itself; "
            f"algo.rollout_correction={f.correction} would weigh each token twice",
            "drop algo.rollout_correction (unset or none), or use --policy-loss ppo with it",
        )
    return None


# ---------------------------------------------------------------------------------------------
# on-policy distillation (algo.distill, docs/distill.md)


@rule(r"distill\s*==\s*'full'.{0,80}\b(pp|cp)\b")
def distill_full_engine(f: JobFacts) -> Problem | None:
    """The full-vocabulary reverse KL forwards the teacher inside the student's loss, on the last pipeline
    stage: a teacher split into Megatron pipeline stages (or context-parallel sequence shards) cannot run there.
    Ulysses sp and Megatron TP run it (the sequence shard, or the vocabulary columns, of both models)."""
    if f.distill == "full" and f.backend == "megatron" and (f.pp > 1 or f.cp > 1):
        where = f"parallel.pp={f.pp}" if f.pp > 1 else f"parallel.cp={f.cp}"
        return Problem(
            "distill_full_engine",
            f"algo.distill=full does not run on Megatron with {where} yet (the teacher is forwarded inside the "
            "last pipeline stage's loss)",
            "use parallel.pp=1 parallel.cp=1 (tp is fine), --backend fsdp, or algo.distill=sampled",
        )
    return None


@rule(r"teacher_data\b.{0,60}\b(rollout_)?procs\b", r"rollout processes sample every step")
def teacher_data_split(f: JobFacts) -> Problem | None:
    """The trainers decide which steps read --teacher-data's rows; a split run's rollout processes sample every
    step ahead of them."""
    if f.teacher_data and f.rollout_procs > 0:
        return Problem(
            "teacher_data_split",
            f"--teacher-data with --rollout-procs {f.rollout_procs}: the rollout processes sample every step, "
            "so the steps on the teacher's responses would waste theirs",
            "drop --rollout-procs (colocated rollout), or --teacher-data",
        )
    return None

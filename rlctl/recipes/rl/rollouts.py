"""Where a step's samples come from: the :class:`SampleSource` protocol and its colocated kind.

Two kinds implement it: :class:`ColocatedRollout`, this rank's own rollout engine (woken with the
actor's current weights, put to sleep for training), and :class:`rlctl.recipes.rl.offpolicy.TrainerFeed`,
the samples other processes generated (``rollout.procs``). The trainer chooses one when it is built and
then only asks it; :class:`ActorWeights` is what both read of the actor: its weights and how many updates
they have had."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from rlctl.config import RunConfig
from rlctl.data.rl import Prompt
from rlctl.errors import UserError
from rlctl.recipes.rl.batch import sampling_params
from rlctl.recipes.rl.metrics import Metrics, timed
from rlctl.rollout import RolloutSpec
from rlctl.runtime.dist import check_rollout_in_node


class ActorWeights:
    """The actor's weights as the rollout side sees them: their version (updates done in this process)
    and their full tensors in the rollout dtype (a collective over the actor's ranks)."""

    def __init__(self, actor, dtype: str):
        self.actor, self.dtype = actor, dtype  # dtype: "fp32" | "bf16"
        self.version = 0

    def stepped(self) -> None:
        self.version += 1

    def full(self):
        from rlctl.rollout.base import torch_dtype

        return self.actor.iter_full_params(dtype=torch_dtype(self.dtype))


class SampleSource(Protocol):
    """What a step's samples come from (the colocated engine, or the rollout processes' feed)."""

    stale: bool  # its samples may come from older weights (then the trainer's log-probs differ by design)

    def samples(self, shares: list[list[Prompt]], n: int, draw: int, metrics: Metrics) -> tuple[list, list]:
        """This rank's samples of ``shares`` (``n`` each) and the greedy ones remax needs (else [])."""

    def sleep(self) -> None:
        """The rollout phase is over."""

    def after_update(self, step: int) -> Metrics:
        """The actor finished step ``step``'s update."""

    def close(self) -> None: ...


def make_engine(cfg: RunConfig, dist, spec: RolloutSpec, *, device, dtype: str, evaluation_only: bool, log):
    """This rank's rollout engine: the run's ``spec`` (rlctl.recipes.rl.inputs: its weights' path set) with
    this rank's device, ``dtype`` and seed. ``evaluation_only``: a split run's trainer, on a GPU beside its
    training states."""
    from rlctl.rollout import make_rollout_engine

    tp, beside = spec.tp, ""
    if evaluation_only:
        spec = spec.replace(mem_fraction=cfg.rollout.eval_mem_fraction or spec.mem_fraction)
        beside = f", memory fraction {spec.mem_fraction:.2f} beside the trainer (rollout.eval_mem_fraction)"
    if dist.world_size % tp:
        raise UserError(f"rollout.tp={tp} does not divide the {dist.world_size} processes")
    check_rollout_in_node(tp, dist.local_world_size)
    engine = make_rollout_engine(
        spec.replace(
            device=f"cuda:{dist.local_rank}" if device.type == "cuda" else "cpu",
            dtype=dtype,
            seed=spec.seed + dist.rank,
        )
    )
    log(f"rollout: {spec.engine} engine on every rank ({dtype}){beside}")
    return engine


def prompt_images(prompts: list[Prompt]) -> list | None:
    """Each prompt's images for the rollout engine (None for a prompt without); None when no prompt has any."""
    images = [(p.pixel_values, p.image_grid_thw) if p.pixel_values is not None else None for p in prompts]
    return images if any(im is not None for im in images) else None


class ColocatedRollout:
    """This rank's rollout engine, beside its trainer: made now (``engine``) or at its first use
    (``make``), woken with the actor's weights when they moved, generating this rank's samples (or its
    multi-turn trajectories through ``turns``, rlctl.recipes.rl.turns)."""

    stale = False

    def __init__(
        self,
        make: Callable[[], object],
        weights: ActorWeights,
        cfg: RunConfig,
        *,
        rank: int,
        world_size: int,
        tp: int,
        turns,
        needs_greedy: bool = False,
        engine=None,
    ):
        self.make, self.weights, self.cfg, self.engine = make, weights, cfg, engine
        self.rank, self.world_size, self.tp = rank, world_size, tp
        self.turns, self.needs_greedy = turns, needs_greedy  # rl.turns: SingleTurn | MultiTurn
        self.synced: int | None = 0  # the weights version the engine holds (None: unknown)

    @property
    def logprobs_filtered(self) -> bool:
        """Its log-probs are of the top-k/top-p filtered distribution (vLLM), when the engine exists."""
        return getattr(self.engine, "logprobs_filtered", False)

    def params(self, draw: int, *, temperature: float, seed_offset: int = 0):
        """Sampling parameters with a seed of its own for each (draw, rollout group)."""
        tp = self.tp
        return sampling_params(
            self.cfg, draw, self.rank // tp, self.world_size // tp, temperature=temperature, seed_offset=seed_offset
        )

    def samples(self, shares: list[list[Prompt]], n: int, draw: int, metrics: Metrics) -> tuple[list, list]:
        self.wake(metrics)
        greedy = []
        with timed(metrics, "time/rollout"):
            samples = self.generate(shares, n, self.params(draw, temperature=self.cfg.rollout.temperature))
            if self.needs_greedy:  # remax: one greedy response per prompt, its score the baseline
                greedy = self.generate(shares, 1, self.params(draw, temperature=0.0, seed_offset=1))
        return samples, greedy

    def generate(self, shares: list[list[Prompt]], n: int, sampling) -> list:
        """This rank's samples (:meth:`group_generate`), or its multi-turn trajectories in agent runs."""
        return self.turns.generate(self, shares, n, sampling)

    def group_generate(self, shares: list[list[Prompt]], n: int, sampling) -> list:
        """Samples of this rank's prompts. ``shares[i]`` are the prompts of the i-th rank of this rank's
        rollout group (``rollout.tp`` consecutive ranks): a vLLM tensor-parallel group must generate the
        same requests on all its ranks, so the group generates every share and each rank keeps its own
        (``prompt_index`` relative to its share)."""
        own = self.rank % self.tp
        prompts = [p for share in shares for p in share]
        everything = [p.token_ids for p in prompts]
        samples = self.engine.generate(everything, n, sampling, images=prompt_images(prompts)) if everything else []
        start = sum(len(share) for share in shares[:own])
        return [
            replace(s, prompt_index=s.prompt_index - start)
            for s in samples
            if start <= s.prompt_index < start + len(shares[own])
        ]

    def wake(self, metrics: Metrics) -> None:
        """Wake the engine's weights, load the actor's into it when they are not current (their version
        moved since the engine's last sync, or the engine dropped its weights asleep; ``time/weight_sync``),
        then wake its KV cache. An engine still awake with the current weights (the rounds of dynamic
        sampling, the passes of an evaluation) does nothing."""
        if self.engine is None:  # a split run's first evaluation
            self.engine = self.make()
        if self.synced != self.weights.version:
            self.engine.trainer_stepped()

        def sync() -> None:
            with timed(metrics, "time/weight_sync"):
                self.engine.update_weights(self.weights.full())

        self.engine.ready(sync)
        self.synced = self.weights.version

    def weights_unknown(self) -> None:
        """A resumed run: the engine still holds the initial weights, whatever the version says."""
        self.synced = None

    def sleep(self) -> None:
        """The rollout phase is over: the engine gives the accelerator back (it may drop its weights)."""
        if self.engine is not None:
            self.engine.sleep()

    def after_update(self, step: int) -> Metrics:
        return {}  # the engine syncs when it wakes next

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()

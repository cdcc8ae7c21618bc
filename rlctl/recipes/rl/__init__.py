"""What the GRPO and PPO recipes share, by concern:

- :mod:`.main`: :func:`~.main.rl_main` and :func:`~.main.rl_step`, the one entry and step of GRPO and PPO
  (:data:`~.main.METHODS`: what differs between them, as data)
- :mod:`.inputs`: :class:`~.inputs.RLInputs`, what a process builds once from the config (model source,
  tokenizer, tools, prompts and their stream, the rollout spec with the rollout-init path) and hands to the
  trainer or the rollout worker
- :mod:`.turns`: single-turn and multi-turn runs as two objects chosen once; every sample a trajectory
- :mod:`.spec`: :class:`~.spec.AlgoSpec`, the algorithm read once from the resolved config
- :mod:`.batch`: which prompts a rank takes, :class:`~.batch.RolloutBatch`, packed micro-batches
- :mod:`.passes`: forward log-probs (and entropy) and the critic's values
- :mod:`.advantages`: token rewards and the advantage estimator ``algo.adv`` names
- :mod:`.update`: the one PPO-style update loop, for the actor (policy loss) and the critic (value loss)
- :mod:`.scoring`: :class:`~.scoring.RewardScorer`, the reward component the trainer owns
- :mod:`.stream`: :class:`~.stream.PromptStream`, the step sampler and the data position (with the run's
  step count and mini-batch size)
- :mod:`.rollouts`: the :class:`~.rollouts.SampleSource` protocol, :class:`~.rollouts.ColocatedRollout`
  (this rank's own rollout engine) and :class:`~.rollouts.ActorWeights` (what the rollout side reads of
  the actor)
- :mod:`.offpolicy`: split runs (``rollout.procs``): the trainer's :class:`~.offpolicy.TrainerFeed` (the
  other sample source) and the rollout processes
- :mod:`.dynamic`: DAPO's dynamic sampling, rounds of rollout until the groups that vary fill the batch
- :mod:`.metrics`: a step's metrics, :func:`~.metrics.timed` phases and :func:`~.metrics.merged` records
- :mod:`.sampling`: :class:`~.sampling.Sampling`, a part the trainer owns: a step's samples from the
  sample source, scored, and validation
- :mod:`.trainer`: :class:`~.trainer.RLTrainer`, the run's state and its steps; the outer loop is
  :func:`rlctl.runtime.fit.fit`

One RL step (:func:`~.main.rl_step` spells it out in order; every step returns its metrics, which
:func:`~.metrics.merged` joins into the step's record)::

    batch, m = rl.sample(step)    # prompts -> n samples each (the sample source: every rank's colocated
                                  # rollout engine, or the rollout processes), scored; dynamic sampling
                                  # (DAPO): more rounds until the groups vary
    batch = rl.pool(batch)        # the ranks of one model replica (Megatron TP x PP) pool their samples
    rl.ref_logprobs(batch)        # frozen reference policy (when algo.kl_coef > 0)
    rl.old_logprobs(batch)        # the trainer's log-probs of the samples (+ rollout/logprob_diff)
    rl.values(batch)              # PPO: the critic's values
    rl.advantages(batch)          # token rewards (KL in the reward for PPO) -> grpo/rloo/reinforce_pp/gae
    rl.update_critic(batch)       # PPO
    rl.update_actor(batch)        # ppo_epochs x mini-batches, one optimizer step per mini-batch

Where the samples live. The step's global batch is ``train.batch_size`` prompts, fixed by the step
number alone (:class:`~rlctl.data.packing.StepSampler`; with dynamic sampling by the data position, the
examples drawn so far). It is cut into mini-batches of
``algo.mini_batch_size`` prompts (one optimizer step each) and the prompts of each mini-batch are
dealt round-robin to the ranks (:func:`rank_positions`). A rank generates all ``n`` samples of its
prompts, so a prompt's group never crosses ranks, and every rank holds its share of every
mini-batch. Sample ``j`` of the prompt at position ``p`` of the step has the global id
``uid = p * n + j``. After scoring, the ranks that split one copy of the model between them
(Megatron's tensor and pipeline ranks: the engine's ``mp_group``) pool their samples, so every rank of
a data-parallel replica trains on the same batch (:meth:`RolloutBatch.join`); with FSDP every rank is
its own replica and no sample moves.

Why the update does not depend on the number of ranks. Advantages are computed on the gathered
global batch (ordered by uid), so batch-level statistics (whitening) are global. Each mini-batch's
loss is aggregated with *global* denominators (tokens and sequences all-reduced over the
data-parallel replicas: the engine's ``dp_group``), each replica back-propagates its share, and the
engine SUMS gradients over replicas (:mod:`rlctl.engines.base`). Micro-batches are packed per
replica under a token budget; replicas with fewer micro-batches run empty dummy ones, so the
collectives line up.
"""

from __future__ import annotations

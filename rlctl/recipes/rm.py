"""A Bradley-Terry reward model: ``python -m rlctl.recipes.rm --run-dir RUN`` (under torchrun), FSDP2.

The model is the causal LM's backbone with a scalar head (the engine's critic: ``role="critic"``), its
score read at each sequence's last non-pad token, on the text ``rlctl ppo/grpo --reward-model`` scores (the
rendered prompt, then the response: :func:`rlctl.data.preference.score_text_example`). Per pair, with
``r_c``, ``r_r`` the scores of the chosen and the rejected response::

    loss = -log sigmoid(r_c - r_r - margin) + pref.center_rewards * (r_c + r_r)^2

(the margin: the row's ``pref.margin_field``, 0 where absent; centering as TRL's center_rewards_coefficient),
averaged over the batch; accuracy = mean(r_c > r_r), on held-out pairs in the eval records.

The head's bias is held at 0 (its gradient dropped before each step): a constant shift cancels in the
Bradley-Terry loss, so it would only drift on rounding noise, and a Hugging Face sequence-classification head
(``score``) has no bias. The export is such a model: config ``<Arch>ForSequenceClassification`` with one label
and the tokenizer's pad token, weights ``model.*`` and ``score.weight``: what
:class:`rlctl.rewards.model.RewardModel` (``--reward-model DIR``) loads with ``AutoModelForSequenceClassification``.
"""

from __future__ import annotations

import torch

from rlctl.algos.preference_losses import bradley_terry_loss
from rlctl.config import total_steps
from rlctl.data.packing import steps_per_epoch
from rlctl.data.pref_batches import UnitMicroBatch
from rlctl.data.preference import build_pref_data
from rlctl.data.sft import use_chat_template
from rlctl.engines import EngineSpec, build_engine
from rlctl.engines.base import full_logits, load_tokenizer, model_source, write_model_meta
from rlctl.recipes.pairs import UnitTrainer
from rlctl.rewards.model import classifier_architecture
from rlctl.runtime.dist import barrier
from rlctl.runtime.entry import RunContext, recipe_main
from rlctl.runtime.fit import fit


def sequence_scores(values, mb) -> torch.Tensor:
    """The reward of each sequence ``[S]``: the value at its last non-pad token (0 for a dummy, in the graph)."""
    flat = full_logits(values).reshape(-1)
    if not isinstance(mb, UnitMicroBatch):
        return flat.sum()[None] * 0.0
    return flat[mb.last_pos]


class RMTrainer(UnitTrainer):
    SUMS = ("loss", "accuracy", "rewards/chosen", "rewards/rejected")

    def prepare(self, micro: list, indices: list[int], *, val: bool) -> dict:
        units = [(self.data.val if val else self.data.train)[i] for i in indices]
        for mb in micro:
            if isinstance(mb, UnitMicroBatch):
                mb.margins = torch.tensor([units[i].margin for i in mb.units], device=mb.input_ids.device)
        return {"units": len(units)}

    def unit_loss(self, output, mb, step: dict) -> tuple[torch.Tensor, torch.Tensor]:
        scores = sequence_scores(output, mb)
        if not isinstance(mb, UnitMicroBatch):
            return scores.sum(), torch.zeros(len(self.SUMS), device=scores.device)
        pairs = scores.view(-1, 2)
        chosen, rejected = pairs[:, 0], pairs[:, 1]
        losses, correct = bradley_terry_loss(
            chosen, rejected, margin=mb.margins, center_coef=self.ctx.cfg.pref.center_rewards
        )
        sums = torch.stack([losses.detach().sum(), correct.sum(), chosen.detach().sum(), rejected.detach().sum()])
        return losses.sum() / step["units"], sums

    def metrics(self, sums: dict[str, float], step: dict) -> dict:
        n = max(step["units"], 1)
        chosen, rejected = sums["rewards/chosen"] / n, sums["rewards/rejected"] / n
        return {  # TRL RewardTrainer's names, and each side's mean
            "loss": sums["loss"] / n,
            "accuracy": sums["accuracy"] / n,
            "margin": chosen - rejected,
            "mean_reward": (chosen + rejected) / 2,
            "rewards/chosen": chosen,
            "rewards/rejected": rejected,
        }

    def before_step(self) -> None:
        self.engine.model.value_head.bias.grad = None  # held at 0 (module docstring)


def classifier_config(hf_config, pad_token_id: int, model: str):
    """The causal LM's config as a one-label sequence classifier's."""
    config = type(hf_config).from_dict(hf_config.to_dict())
    config.architectures = [classifier_architecture(getattr(hf_config, "architectures", None), model)]
    config.num_labels = 1
    config.pad_token_id = pad_token_id
    return config


def export_name(name: str) -> str | None:
    """The critic's tensors under the sequence classifier's names: the head is ``score``, without a bias."""
    if name == "value_head.bias":
        return None
    return "score.weight" if name == "value_head.weight" else name


def run(ctx: RunContext) -> None:
    cfg, paths, d = ctx.cfg, ctx.paths, ctx.dist
    source = model_source(cfg.model.name, random_init=cfg.model.random_init)
    tokenizer = use_chat_template(load_tokenizer(source), cfg)
    data = build_pref_data(cfg, tokenizer, paired=True, loss="rlctl rm", score_text=True)
    ctx.log(f"data: {data.report.summary()}; {len(data.train)} train / {len(data.val)} val pairs")
    spec = EngineSpec.from_config(cfg)
    steps = total_steps(cfg, steps_per_epoch(len(data.train), cfg.train.batch_size))
    engine = build_engine(spec, role="critic", total_steps=steps, source=source)
    engine.export_names = export_name
    trainer = RMTrainer(ctx, engine, data, pad_id=tokenizer.pad_token_id)
    if d.is_main:
        config = classifier_config(source.load_config(), tokenizer.pad_token_id, cfg.model.name)
        write_model_meta(paths.model_meta, config, tokenizer, source)
    barrier()
    fit(ctx, trainer)


if __name__ == "__main__":
    recipe_main(run)

"""A reward model: a Hugging Face ``AutoModelForSequenceClassification`` scoring prompt + response."""

from __future__ import annotations

from rlctl.errors import UserError

__all__ = ["RewardModel", "classifier_architecture"]


def classifier_architecture(architectures: list[str] | None, model: str) -> str:
    """The sequence classifier of a causal LM (``Qwen2ForCausalLM`` -> ``Qwen2ForSequenceClassification``): what
    ``rlctl rm`` exports and this module loads."""
    arch = (architectures or [""])[0]
    if not arch.endswith("ForCausalLM"):
        raise UserError(
            f"rlctl rm builds a reward model from a causal LM (config.json architectures *ForCausalLM); {model} is "
            f"{arch or 'not named'}"
        )
    return arch.removesuffix("ForCausalLM") + "ForSequenceClassification"


class RewardModel:
    """Loaded once from ``path`` (its own tokenizer and ``dtype``); :meth:`score` runs micro batches of
    ``micro_batch`` texts ``prompt + response`` (right-padded) and returns logit 0 of each."""

    def __init__(self, path: str, *, dtype: str = "float32", micro_batch: int = 8, device: str = "cpu"):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise UserError(f"reward.model_dtype={dtype!r} is not a torch dtype; use float32, bfloat16 or float16")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.model = AutoModelForSequenceClassification.from_pretrained(path, torch_dtype=torch_dtype)
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot load reward model {path}: {str(exc).splitlines()[0]}") from exc
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.padding_side = "right"
        self.model.to(device).eval()
        self.device, self.micro_batch = device, max(1, int(micro_batch))

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        import torch

        texts = [p + r for p, r in zip(prompts, responses)]
        out: list[float] = []
        for start in range(0, len(texts), self.micro_batch):
            enc = self.tokenizer(texts[start : start + self.micro_batch], return_tensors="pt", padding=True)
            with torch.no_grad():
                logits = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits
            out.extend(logits[:, 0].float().tolist())
        return out

"""Check a converted Hugging Face model against its source, and write-then-verify pipelines.

What :func:`verify_model` checks (each a row of the verdict table):

* ``tensors``: every source tensor is in the output, equal to the source cast to the output dtype
  (exactly; or within one unit of the dtype's rounding for folded LoRA, whose reference is peft's
  own fp32 merge); tied aliases (``lm_head.weight``) equal the tensor they alias;
* ``names``: the output holds no tensor the source lacks;
* ``dtype``: floating tensors and config.json carry the requested dtype;
* ``load``: transformers loads the output with no missing or mismatched weights (keys it does not
  use, such as extra buffers, are listed but do not fail);
* ``logits``: on fixed token ids, the transformers-loaded output (plus its peft adapter when kept
  separate) gives the logits of a reference model built from the source tensors, in fp32.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlctl.data.vision import auto_model_class
from rlctl.errors import UserError
from rlctl.formats.hf_writer import config_dtype, dtype_name, save_hf_model


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class Verdict:
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def add(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append(Check(name, ok, detail))

    def table(self, title: str = "verification"):
        from rich.table import Table

        table = Table(title=f"{title}: {'[green]PASSED[/]' if self.ok else '[red]FAILED[/]'}")
        table.add_column("check")
        table.add_column("result")
        table.add_column("detail", overflow="fold")
        for c in self.checks:
            table.add_row(c.name, "[green]ok[/]" if c.ok else "[red]FAIL[/]", c.detail)
        return table

    def to_dict(self) -> dict:
        return {"ok": self.ok, "checks": [c.__dict__ for c in self.checks]}


class VerificationFailed(Exception):
    """Raised inside the writer so a failed output is never committed."""

    def __init__(self, verdict: Verdict):
        super().__init__("verification failed")
        self.verdict = verdict


# ----------------------------------------------------------------------------- the architecture


@dataclass
class Architecture:
    """What the HF architecture of a config expects: tensor shapes and tied aliases."""

    shapes: dict[str, tuple[int, ...]]
    aliases: dict[str, str]  # tied name -> the name it shares storage with

    @classmethod
    def from_dir(cls, meta_dir: Path) -> Architecture:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(str(meta_dir))
            with torch.device("meta"):
                model = auto_model_class(config).from_config(config)
        except Exception as e:  # noqa: BLE001 - any config transformers cannot build
            raise UserError(f"{meta_dir / 'config.json'}: transformers cannot build this model ({e})") from None
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        groups: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(param), []).append(name)
        aliases = {alias: names[0] for names in groups.values() for alias in names[1:]}
        return cls(shapes, aliases)

    def check(self, shapes: dict[str, tuple[int, ...]], where: str) -> list[str]:
        """Raise on a shape that disagrees with the config or a missing weight; return unknown names."""
        for name, shape in shapes.items():
            want = self.shapes.get(name)
            if want is not None and tuple(shape) != want:
                raise UserError(f"{where}: {name} has shape {list(shape)} but config.json implies {list(want)}")
        missing = [n for n in self.shapes if n not in shapes and n not in self.aliases]
        if missing:
            raise UserError(
                f"{where}: the checkpoint lacks {missing[0]} ({len(missing)} weight(s) of the architecture missing)"
            )
        return [n for n in shapes if n not in self.shapes]


# ----------------------------------------------------------------------------- verification


def model_from_state(config, state: dict[str, torch.Tensor]):
    """An fp32 model of ``config`` (:func:`auto_model_class`) whose weights are the tensors of ``state``
    (shared, not copied; no random initialisation of what ``state`` provides)."""
    cls = auto_model_class(config)._model_mapping[type(config)]
    return cls.from_pretrained(None, config=config, state_dict=state, dtype=torch.float32)


def _ulp_close(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Elementwise: within one unit of ``got``'s dtype rounding of ``ref`` (fp32 reference)."""
    eps = torch.finfo(got.dtype).eps if got.is_floating_point() else 0.0
    return (got.float() - ref.float()).abs() <= eps * ref.float().abs() + 1e-7


def verify_model(
    out_dir: Path,
    expected: Iterable[tuple[str, torch.Tensor]],
    *,
    dtype: torch.dtype | None = None,
    rounding: bool = False,
    adapter: dict[str, torch.Tensor] | None = None,
    reference: dict[str, torch.Tensor] | None = None,
    n_inputs: int = 2,
    seq_len: int = 16,
) -> Verdict:
    """Compare ``out_dir`` with the ``expected`` HF tensors (see the module doc for the checks).

    ``adapter``: peft-named tensors expected in ``out_dir/adapter`` (kept LoRA). ``reference``: the
    state of the logits reference model when it is not ``expected`` (e.g. peft's merge); it is
    consumed (emptied) to keep memory near one copy of the model.
    """
    from rlctl.convert.sources import SafetensorsSource

    verdict = Verdict()
    config = json.loads((out_dir / "config.json").read_text())
    arch = Architecture.from_dir(out_dir)
    out = SafetensorsSource(out_dir)
    out_names = set(out.keys())
    seen, state = _check_tensors(verdict, out, out_names, arch, expected, rounding=rounding, keep=reference is None)
    extra = sorted(out_names - seen)
    verdict.add(
        "names", not extra, "no tensor beyond the source" if not extra else f"not in the source: {', '.join(extra[:3])}"
    )
    if dtype is not None:
        wrong = [k for k in out_names if out.dtype(k).is_floating_point and out.dtype(k) != dtype]
        declared = config_dtype(config)
        ok = not wrong and declared in (None, dtype)
        verdict.add(
            "dtype",
            ok,
            f"{dtype_name(dtype)}" if ok else f"{len(wrong)} tensor(s) not {dtype_name(dtype)}; config says {declared}",
        )
    _check_logits(verdict, out_dir, reference if reference is not None else state, adapter, n_inputs, seq_len, rounding)
    return verdict


def _check_tensors(
    verdict: Verdict,
    out,
    out_names: set[str],
    arch: Architecture,
    expected: Iterable[tuple[str, torch.Tensor]],
    *,
    rounding: bool,
    keep: bool,
) -> tuple[set[str], dict[str, torch.Tensor]]:
    """The "tensors" check: each expected tensor is in the output (by its name or the architecture's alias)
    with its shape and its values (equal, or within dtype rounding). Returns the names seen and, with
    ``keep``, the expected tensors as the logits reference's state."""
    state: dict[str, torch.Tensor] = {}
    seen: set[str] = set()
    bad: list[str] = []
    worst = 0.0
    count = 0
    for name, ref in expected:
        seen.add(name)
        target = arch.aliases.get(name, name) if name not in out_names else name
        if target not in out_names:
            bad.append(f"{name} missing")
            continue
        got = out.get(target)
        ref_cast = ref.to(got.dtype) if ref.is_floating_point() else ref
        count += 1
        if got.shape != ref.shape:
            bad.append(f"{name} shape {list(got.shape)} != {list(ref.shape)}")
            continue
        if got.is_floating_point() and got.numel():
            worst = max(worst, (got.float() - ref.float()).abs().max().item())
        ok = bool(_ulp_close(got, ref).all()) if rounding and got.is_floating_point() else torch.equal(got, ref_cast)
        if not ok:
            bad.append(f"{name} differs")
        if target == name and keep:
            state[name] = ref_cast.float() if ref_cast.is_floating_point() else ref_cast
    rule = "within dtype rounding of peft's merge" if rounding else "equal to the source"
    detail = f"{count} tensors {rule}; max |diff| {worst:.3g}"
    verdict.add("tensors", not bad, detail if not bad else f"{len(bad)} bad: {', '.join(bad[:3])}")
    return seen, state


def _check_logits(
    verdict: Verdict,
    out_dir: Path,
    state: dict[str, torch.Tensor],
    adapter: dict | None,
    n_inputs: int,
    seq_len: int,
    loose: bool,
) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(out_dir))
    vocab = config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (n_inputs, seq_len), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, **fixed_image_inputs(config, ids)}  # a VL model: an image through its tower
    for k, v in state.items():
        if v.is_floating_point() and v.dtype != torch.float32:
            state[k] = v.float()
    ref_model = model_from_state(config, state).eval()
    with torch.no_grad():
        ref_logits = ref_model(**inputs).logits.float()
    del ref_model
    state.clear()
    try:
        model, info = auto_model_class(config).from_pretrained(
            str(out_dir), dtype=torch.float32, output_loading_info=True
        )
    except Exception as e:  # noqa: BLE001 - report, do not crash
        verdict.add("load", False, f"transformers cannot load the output: {type(e).__name__}: {e}")
        return
    missing = sorted(info.get("missing_keys", []))
    mismatched = sorted(str(k) for k in info.get("mismatched_keys", []))
    unused = sorted(info.get("unexpected_keys", []))
    detail = "transformers loads every weight"
    if unused:
        detail += f"; kept but unused by the architecture: {', '.join(unused[:3])}"
    ok = not missing and not mismatched
    verdict.add("load", ok, detail if ok else f"missing {missing[:3]}, mismatched {mismatched[:3]}")
    if adapter is not None:
        verdict.checks.extend(_check_adapter(out_dir / "adapter", adapter).checks)
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(out_dir / "adapter"), torch_device="cpu")
    with torch.no_grad():
        logits = model.eval()(**inputs).logits.float()
    diff = (logits - ref_logits).abs().max().item()
    scale = max(1.0, ref_logits.abs().max().item())
    tol = (1e-3 if loose or adapter is not None else 1e-4) * scale
    image = " and an image" if "pixel_values" in inputs else ""
    verdict.add(
        "logits",
        diff <= tol,
        f"max |diff| {diff:.3g} (tolerance {tol:.3g}) on {n_inputs}x{seq_len} fixed tokens{image}",
    )


def fixed_image_inputs(config, ids: torch.Tensor) -> dict:
    """For a vision-language model: one fixed random image (a 4 x 4 patch grid) per row of ``ids``, its image
    tokens written over the start of each row (the ids are changed in place); {} for a text model."""
    from rlctl.data.vision import is_vision_config

    if not is_vision_config(config) or getattr(config, "image_token_id", None) is None:
        return {}
    vc = config.vision_config
    merge = int(getattr(vc, "spatial_merge_size", 2))
    dim = int(getattr(vc, "in_channels", 3)) * int(getattr(vc, "temporal_patch_size", 2)) * int(vc.patch_size) ** 2
    grid = torch.tensor([[1, 2 * merge, 2 * merge]] * ids.shape[0])
    tokens = 4  # (2 merge x 2 merge) patches merged by merge x merge
    ids[ids == config.image_token_id] = 0
    ids[:, :tokens] = config.image_token_id
    pixels = torch.randn(int(grid.prod(-1).sum()), dim, generator=torch.Generator().manual_seed(1))
    return {"pixel_values": pixels, "image_grid_thw": grid, "mm_token_type_ids": (ids == config.image_token_id).int()}


def _check_adapter(adapter_dir: Path, expected: dict[str, torch.Tensor]) -> Verdict:
    from rlctl.convert.sources import SafetensorsSource

    verdict = Verdict()
    got = SafetensorsSource(adapter_dir / "adapter_model.safetensors")
    names = set(got.keys())
    bad = [k for k, v in expected.items() if k not in names or not torch.equal(got.get(k), v.to(got.dtype(k)))]
    extra = names - set(expected)
    ok = not bad and not extra
    verdict.add(
        "adapter",
        ok,
        f"{len(expected)} LoRA tensors equal to the source" if ok else f"differs: {(bad + sorted(extra))[:3]}",
    )
    return verdict


# ----------------------------------------------------------------------------- write, verify, commit


@contextmanager
def hf_quiet():
    """Silence transformers' load reports and progress bars (the verdict table says what matters)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def track(items: Iterable, total: int | None, description: str, enabled: bool) -> Iterator:
    """Yield ``items`` with a rich progress bar on stderr when ``enabled``."""
    if not enabled:
        yield from items
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(description, total=total)
        for item in items:
            yield item
            progress.advance(task)


@dataclass
class Written:
    """The outcome of :func:`write_verified`."""

    out_dir: Path
    committed: bool
    verdict: Verdict | None


def write_verified(
    out_dir: Path,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    meta_dir: Path,
    dtype: torch.dtype | None,
    force: bool,
    verify: Callable[[Path], Verdict] | None,
    before_verify: Callable[[Path], None] | None = None,
    total: int | None = None,
    progress: bool = False,
    max_shard_bytes: int = 5 * 2**30,
) -> Written:
    """Write an HF model, add extra files, verify it in its temporary dir, commit only if it passes.

    A failed verification leaves no output (the temporary directory is removed).
    """
    verdict: Verdict | None = None

    def finish(tmp: Path) -> None:
        nonlocal verdict
        if before_verify is not None:
            before_verify(tmp)
        if verify is not None:
            with hf_quiet():
                verdict = verify(tmp)
            if not verdict.ok:
                raise VerificationFailed(verdict)

    stream = track(tensors, total, "writing tensors", progress)
    try:
        save_hf_model(
            out_dir,
            stream,
            meta_dir=meta_dir,
            dtype=dtype,
            force=force,
            max_shard_bytes=max_shard_bytes,
            before_commit=finish,
        )
    except VerificationFailed as failed:
        return Written(Path(out_dir), False, failed.verdict)
    return Written(Path(out_dir), True, verdict)


def verify_roundtrip(hf_dir: Path, stream: Iterable[tuple[str, torch.Tensor]]) -> Verdict:
    """Tensors read back from a written checkpoint (e.g. Megatron shards) equal the HF source's."""
    from rlctl.convert.sources import SafetensorsSource

    source = SafetensorsSource(hf_dir)
    names = set(source.keys())
    aliases = Architecture.from_dir(hf_dir).aliases
    seen: set[str] = set()
    bad: list[str] = []
    for name, tensor in stream:
        target = name if name in names else aliases.get(name, name)
        seen.add(target)
        if target not in names:
            bad.append(f"{name} not in the source")
        elif not torch.equal(source.get(target), tensor.to(source.dtype(target))):
            bad.append(f"{name} differs")
    missing = sorted(names - seen)
    verdict = Verdict()
    verdict.add(
        "tensors",
        not bad,
        f"{len(seen)} tensors read back equal to the source" if not bad else f"{len(bad)} bad: {', '.join(bad[:3])}",
    )
    verdict.add(
        "names", not missing, "every source tensor written" if not missing else f"not written: {', '.join(missing[:3])}"
    )
    return verdict

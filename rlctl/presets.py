"""Presets: YAML files shipped inside the wheel (the top-level presets/ folder of the repository).

A preset file reads::

    description: one line shown by `rlctl presets list`
    method: grpo            # the method it applies to (omitted for tiers.yaml)
    config: {train: {lr: 1e-6}, rollout: {n: 8}}   # a config layer, same keys as --set

`sft`, `grpo` and `ppo` are the per-method defaults, always applied first. `--preset NAME` applies a
named preset on top of them. `tiers.yaml` holds the planner's hardware rules (see docs/presets.md).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from rlctl.errors import UserError, did_you_mean


def presets_dir() -> Path:
    here = Path(__file__).resolve().parent
    shipped = here / "_presets"  # inside an installed wheel
    return shipped if shipped.is_dir() else here.parent / "presets"


@cache
def _load(path: str) -> dict:
    import yaml

    return yaml.safe_load(Path(path).read_text()) or {}


def list_presets() -> dict[str, dict]:
    """name -> preset document, for every YAML file shipped."""
    return {p.stem: _load(str(p)) for p in sorted(presets_dir().glob("*.yaml"))}


def preset_names() -> list[str]:
    return sorted(p.stem for p in presets_dir().glob("*.yaml"))


def run_preset_names() -> list[str]:
    """The presets ``--preset`` takes: those with run settings (``config``), not the planner's rules."""
    return [name for name, doc in list_presets().items() if "config" in doc]


def load_preset(name: str) -> dict:
    path = presets_dir() / f"{name}.yaml"
    if not path.is_file():
        names = preset_names()
        raise UserError(
            f"unknown preset '{name}'{did_you_mean(name, names)}; `rlctl presets list` shows {len(names)} presets"
        )
    return _load(str(path))


def method_layers(method: str, preset: str | None) -> list[dict]:
    """Config layers for a method: its defaults, then the named preset when given."""
    layers = [load_preset(method).get("config", {})]
    if preset and preset != method:
        doc = load_preset(preset)
        if doc.get("method") not in (None, method):
            raise UserError(f"preset '{preset}' is for `rlctl {doc['method']}`, not `rlctl {method}`")
        if "config" not in doc:
            raise UserError(f"preset '{preset}' holds planner rules, not a run configuration")
        layers.append(doc.get("config", {}))
    return layers

"""Shared fixtures: one thread per process, and a tiny model built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen2 (GQA, head_dim 64) with a locally trained tokenizer, saved the HF way."""
    from rlctl.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(autouse=True)
def _no_stop_request_leaks():
    """A test that raises a stop request in this process (SIGINT to itself, ``note_stop``) must not leave
    it set for the next one: reward calls and the fit loop read it (rlctl.runtime.signals)."""
    from rlctl.runtime import signals

    saved = dict(signals._early)
    yield
    signals._early.clear()
    signals._early.update(saved)


@pytest.fixture(scope="module")
def process_group():
    """A one-process gloo group, as torchrun would give a single rank (left as found afterwards)."""
    import torch.distributed as dist

    from rlctl.runtime.net import free_port

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def tiny_vl_model_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen2-VL (the text model above, a 2-block vision tower) with its tokenizer and image
    processor, saved the HF way (rlctl.testing.build_tiny_vl_model)."""
    from rlctl.testing import build_tiny_vl_model

    return build_tiny_vl_model(tmp_path_factory.mktemp("tiny_vl") / "model", seed=0)

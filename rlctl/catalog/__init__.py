"""Offline catalogs of model architectures and GPUs, and exact parameter counting.

Nothing here imports torch or transformers: the CLI uses it for completion and --help.
"""

from .count import (
    active_params,
    count_params,
    embedding_params,
    kv_cache_bytes_per_token,
    layer_params,
)
from .gpus import list_gpus, resolve_gpu
from .hf_config import hf_config_dict
from .markdown import catalog_markdown
from .models import list_models, resolve_model
from .parallel import pipeline_split
from .spec import GpuSpec, ModelSpec

__all__ = [
    "GpuSpec",
    "ModelSpec",
    "active_params",
    "catalog_markdown",
    "count_params",
    "embedding_params",
    "hf_config_dict",
    "kv_cache_bytes_per_token",
    "layer_params",
    "list_gpus",
    "list_models",
    "pipeline_split",
    "resolve_gpu",
    "resolve_model",
]

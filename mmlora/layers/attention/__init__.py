"""Paged attention backends (torch reference; Triton kernels on CUDA), chosen by name."""

from mmlora.layers.attention import torch_ref, triton_backend  # noqa: F401  (register "torch", "triton")
from mmlora.layers.attention.base import (
    AttentionBackend,
    available_attention_backends,
    get_attention_backend,
    register_attention_backend,
    store_kv,
)

__all__ = [
    "AttentionBackend",
    "available_attention_backends",
    "get_attention_backend",
    "register_attention_backend",
    "store_kv",
]

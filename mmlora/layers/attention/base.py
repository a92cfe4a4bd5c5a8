"""The attention backend interface: store this forward's K/V into the paged cache, then attend."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor

from mmlora.forward.attention import AttentionMetadata
from mmlora.registry import NamedRegistry


class AttentionOptions(NamedTuple):
    """One attention layer's constants: score scale, sliding window and soft-cap (None: off)."""

    scale: float
    sliding_window: int | None
    logit_softcap: float | None


#: A layer's paged cache: (k_cache, v_cache), each [num_blocks, block_size, Hkv, D].
KVPages = tuple[torch.Tensor, torch.Tensor]


class AttentionBackend(ABC):
    """Paged causal attention with GQA, optional sliding window and logit soft-capping.

    ``forward(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], k_cache, v_cache, meta, ...) -> o [T, Hq, D]``.
    First writes k/v rows to ``k_cache.view(-1, Hkv, D)[meta.slot_mapping]`` (and v alike). Then query
    token at absolute position p of request b attends to that request's cached positions j with
    ``j <= p`` and, when ``sliding_window`` is set, ``j > p - sliding_window``. Scores are
    ``q.k * scale``, then ``softcap * tanh(score / softcap)`` when ``logit_softcap`` is set, then a
    softmax in fp32. Hq must be a multiple of Hkv (query head h uses KV head h // (Hq // Hkv)).
    """

    name: ClassVar[str]

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:
        return self._attend(
            q, k, v, (k_cache, v_cache), meta, AttentionOptions(scale, sliding_window, logit_softcap)
        )

    @abstractmethod
    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, kv: KVPages, meta: AttentionMetadata, opts: AttentionOptions
    ) -> torch.Tensor:
        """``forward`` with the layer's caches and constants bundled."""


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write new K/V rows into their cache slots."""
    hkv, d = k.shape[-2], k.shape[-1]
    k_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


_REGISTRY: NamedRegistry[AttentionBackend] = NamedRegistry("attention backend", "attention_backend")
register_attention_backend = _REGISTRY.register


def available_attention_backends() -> list[str]:
    return _REGISTRY.names()


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """``"auto"`` picks ``triton`` on CUDA when registered, ``torch`` otherwise."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and "triton" in _REGISTRY else "torch"
    return _REGISTRY.get(name)()

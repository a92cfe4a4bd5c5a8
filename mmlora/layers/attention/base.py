"""The attention backend interface: store this forward's K/V into the paged cache, then attend."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import torch

from mmlora.forward.attention import AttentionMetadata


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

    @abstractmethod
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
    ) -> torch.Tensor: ...


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write new K/V rows into their cache slots."""
    hkv, d = k.shape[-2], k.shape[-1]
    k_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


_REGISTRY: dict[str, Callable[[], AttentionBackend]] = {}


def register_attention_backend(name: str) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    def wrap(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        if name in _REGISTRY:
            raise ValueError(f"attention backend {name!r} registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def available_attention_backends() -> list[str]:
    return sorted(_REGISTRY)


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """``"auto"`` picks ``triton`` on CUDA when registered, ``torch`` otherwise."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and "triton" in _REGISTRY else "torch"
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown attention_backend {name!r}; registered: auto, {', '.join(available_attention_backends())}"
        )
    return _REGISTRY[name]()

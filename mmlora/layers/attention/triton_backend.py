"""The "triton" attention backend: Triton kernels over the paged KV cache (GPU, or CPU interpreter).

``forward`` stores this forward's K/V with a Triton scatter kernel (slots < 0 are skipped, so padded
rows of a CUDA-graph batch may point at slot -1), then runs the split-K decode kernels when every
request has one query token (``meta.is_decode``) and the varlen prefill kernel otherwise (prefill
chunks, prefill on a cached prefix, mixed prefill + decode batches).

CUDA graphs: the decode path syncs nothing with the host and allocates only tensors shaped by host
ints. Its grid is (num_seqs, Hkv, num_kv_splits); set ``num_kv_splits`` (constructor or attribute)
to fix it per engine, otherwise it is chosen per call from ``meta.max_seq_len``, a host int that
changes between steps and therefore is not suited to graph capture. The split count is baked into a
captured graph, so a runner may set the attribute per batch-size bucket before capturing it, e.g.
``auto_num_kv_splits(bucket, num_kv_heads, max_model_len, device)`` (on an H200 at Mistral-7B heads
that gives 2 splits for 32 requests and 1 for 128, the measured best at contexts 768 and 4096).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mmlora.backends.triton_common import next_pow2
from mmlora.forward.attention import AttentionMetadata
from mmlora.layers.attention.base import (
    AttentionBackend,
    AttentionOptions,
    KVPages,
    register_attention_backend,
)
from mmlora.layers.attention.decode_tuning import splits_for
from mmlora.layers.attention.triton_common import interpreting
from mmlora.layers.attention.triton_decode import decode_attention
from mmlora.layers.attention.triton_prefill import prefill_attention
from mmlora.triton_launch import fast


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_ch,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    dst = slot * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k_cache.view(-1, Hkv, D)[slot_mapping[t]] = k[t] (v alike) for every t with slot_mapping[t] >= 0."""
    t, hkv, d = k.shape
    if t == 0:
        return
    kc = k_cache.view(-1, hkv, d)
    fast(_store_kv_kernel)[(t,)](
        k,
        v,
        kc,
        v_cache.view(-1, hkv, d),
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kc.stride(0),
        kc.stride(1),
        NUM_HEADS=hkv,
        HEAD_DIM=d,
        BLOCK_H=next_pow2(hkv),
        BLOCK_D=next_pow2(d),
    )


def auto_num_kv_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Enough splits to give every SM a few programs, but no split shorter than a few hundred tokens
    (:func:`~mmlora.layers.attention.decode_tuning.splits_for`, its knobs in ``decode_tuning.TUNING``;
    CPU counts as 4 SMs)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return splits_for(num_seqs, num_kv_heads, max_seq_len, sms)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _validate(
    q: Tensor, k: Tensor, v: Tensor, kv: KVPages, meta: AttentionMetadata, opts: AttentionOptions
) -> None:
    k_cache, v_cache = kv
    sliding_window, logit_softcap = opts.sliding_window, opts.logit_softcap
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be [T, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must share one [num_blocks, block_size, Hkv, D] shape; "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache dtype {k_cache.dtype} != v_cache dtype {v_cache.dtype}")
    _, page, hkv, d = k_cache.shape
    if page & (page - 1):
        raise ValueError(f"block_size must be a power of two, got {page}")
    if k.shape[1:] != (hkv, d) or v.shape != k.shape:
        raise ValueError(f"k/v {tuple(k.shape)}/{tuple(v.shape)} do not match the cache's [*, {hkv}, {d}]")
    if q.shape[2] != d or q.shape[1] % hkv:
        raise ValueError(f"q {tuple(q.shape)}: head_dim must be {d} and num_heads a multiple of {hkv}")
    if q.shape[0] != k.shape[0] or q.shape[0] < meta.num_tokens:
        raise ValueError(
            f"q has {q.shape[0]} tokens, k has {k.shape[0]}, meta.num_tokens is {meta.num_tokens}"
        )
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} must equal the cache dtype {k_cache.dtype}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported dtype {q.dtype}; use float16, bfloat16 or float32")
    devices = {
        t.device for t in (q, k, v, k_cache, v_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens)
    }
    if len(devices) != 1:
        raise ValueError(
            f"q, k, v, caches and metadata must share one device; got {sorted(map(str, devices))}"
        )
    if q.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"the triton attention backend needs CUDA tensors (or TRITON_INTERPRET=1), got {q.device}"
        )
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
    if logit_softcap is not None and logit_softcap <= 0:
        raise ValueError(f"logit_softcap must be positive or None, got {logit_softcap}")


@register_attention_backend("triton")
class TritonAttention(AttentionBackend):
    """Paged attention in Triton. ``num_kv_splits``: fixed decode split count (None = per call)."""

    def __init__(self, num_kv_splits: int | None = None) -> None:
        if num_kv_splits is not None and num_kv_splits < 1:
            raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
        self.num_kv_splits = num_kv_splits

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, kv: KVPages, meta: AttentionMetadata, opts: AttentionOptions
    ) -> torch.Tensor:
        _validate(q, k, v, kv, meta, opts)
        k_cache, v_cache = kv
        scale, sliding_window, logit_softcap = opts
        q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
        store_kv_triton(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        B = meta.num_seqs
        if q.shape[0] > meta.num_tokens:  # padding rows (CUDA-graph buckets) get zeros, never junk
            out[meta.num_tokens :].zero_()
        if B == 0 or meta.num_tokens == 0:
            return out
        if meta.is_decode:
            splits = self.num_kv_splits or auto_num_kv_splits(B, k_cache.shape[2], meta.max_seq_len, q.device)
            decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, out, B, splits, scale,
                sliding_window, logit_softcap,
            )  # fmt: skip
        else:
            prefill_attention(
                q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, out, B,
                meta.max_query_len, scale, sliding_window, logit_softcap, meta.prefill_tiles,
            )  # fmt: skip
        return out

"""The torch attention backend: the reference every kernel is tested against; runs on CPU.

Decode batches gather every request's pages into one padded [B, L, Hkv, D] tensor and attend in one
batched call; batches with prefill chunks loop over their requests. On CPU, where the C kernels are built
(:mod:`mmlora.backends.cpu_kernels`), a batch in fp32 or bf16 instead reads the cache in place in one call
(:func:`~mmlora.backends.cpu_kernels.decode_attention`: no gather, no fp32 copy of K and V, no mask): a
decode batch, and a batch with prefill chunks of short sequences (:data:`PREFILL_IN_PLACE_MAX_KEYS`), each
of its tokens a row; the torch path stays the reference it is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mmlora.backends import cpu_kernels
from mmlora.forward.attention import AttentionMetadata
from mmlora.layers.attention.base import (
    AttentionBackend,
    AttentionOptions,
    KVPages,
    register_attention_backend,
    store_kv,
)


def _page_rows(block_tables: torch.Tensor, block_size: int, max_len: int) -> torch.Tensor:
    """[B, max_len] int64 flat cache rows of each request's first ``max_len`` positions."""
    pos = torch.arange(max_len, device=block_tables.device)
    return block_tables[:, pos // block_size].long() * block_size + (pos % block_size)


def _gather_pages(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """cache [N, bs, Hkv, D], rows [B, L] from :func:`_page_rows` -> [B, L, Hkv, D] (positions past a
    request's length are junk). One ``index_select`` of whole rows: on CPU it copies each row once."""
    flat = cache.view(-1, cache.shape[2] * cache.shape[3])
    return flat.index_select(0, rows.view(-1)).view(*rows.shape, *cache.shape[2:])


def _allowed(q_pos: torch.Tensor, kv_len: torch.Tensor, L: int, sliding_window: int | None) -> torch.Tensor:
    """[B, Tq, L] bool: key j is visible to the query at q_pos (causal, within kv_len and the window)."""
    j = torch.arange(L, device=q_pos.device)
    allowed = (j[None, None, :] <= q_pos[:, :, None]) & (j[None, None, :] < kv_len[:, None, None])
    if sliding_window:
        allowed &= j[None, None, :] > q_pos[:, :, None] - sliding_window
    return allowed


def _masked_attention(
    q: torch.Tensor,  # [B, Tq, Hq, D]
    k: torch.Tensor,  # [B, L, Hkv, D]
    v: torch.Tensor,
    allowed: torch.Tensor,  # [B, Tq, L] from _allowed
    scale: float,
    logit_softcap: float | None,
) -> torch.Tensor:
    B, Tq, Hq, D = q.shape
    Hkv = k.shape[2]
    if not logit_softcap and Tq == 1 and Hq > Hkv:
        # Decode: the query heads that share a KV head attend as that head's query rows ([B, Hkv, G,
        # D]: query head h reads KV head h // G, as enable_gqa), so SDPA runs one task per (request, KV
        # head) instead of one per query head (SmolLM2, 16 rows at context 97: 101 -> 88 us a layer).
        qg = q.float().reshape(B, Hkv, Hq // Hkv, D)
        kf, vf = k.float().transpose(1, 2), v.float().transpose(1, 2)  # [B, Hkv, L, D]
        out = F.scaled_dot_product_attention(qg, kf, vf, attn_mask=allowed[:, None], scale=scale)
        return out.nan_to_num(0.0).reshape(B, 1, Hq, D).to(q.dtype)
    qf = q.float().transpose(1, 2)  # [B, Hq, Tq, D]
    if not logit_softcap:
        # Same math as below in one fused call (GQA without copying K/V per query head); rows with
        # nothing allowed (padding) come out NaN and are zeroed.
        kf, vf = k.float().transpose(1, 2), v.float().transpose(1, 2)  # [B, Hkv, L, D]
        out = F.scaled_dot_product_attention(
            qf, kf, vf, attn_mask=allowed[:, None], scale=scale, enable_gqa=True
        )
        return out.nan_to_num(0.0).transpose(1, 2).to(q.dtype)
    group = q.shape[2] // k.shape[2]
    kf = k.float().repeat_interleave(group, dim=2).transpose(1, 2)  # [B, Hq, L, D]
    vf = v.float().repeat_interleave(group, dim=2).transpose(1, 2)
    scores = qf @ kf.transpose(-1, -2) * scale  # [B, Hq, Tq, L]
    scores = logit_softcap * torch.tanh(scores / logit_softcap)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return (probs @ vf).transpose(1, 2).to(q.dtype)  # [B, Tq, Hq, D]


@register_attention_backend("torch")
class TorchAttention(AttentionBackend):
    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, kv: KVPages, meta: AttentionMetadata, opts: AttentionOptions
    ) -> torch.Tensor:
        k_cache, v_cache = kv
        scale, sliding_window, logit_softcap = opts
        B = meta.num_seqs
        # The kernel keeps each request's key offsets on its thread's stack: bounded, far above SmolLM2's
        # 8k context; longer contexts take the torch path.
        in_place_keys = IN_PLACE_MAX_KEYS if meta.is_decode else PREFILL_IN_PLACE_MAX_KEYS
        if meta.max_seq_len <= in_place_keys and _in_place(q, k_cache, logit_softcap):
            slots = meta.slot_mapping
            if (
                cpu_kernels.store_kv_layout_ok(k, v, k_cache, v_cache)
                and slots.dtype == torch.int64
                and slots.is_contiguous()
            ):
                cpu_kernels.store_kv_unchecked(k, v, k_cache, v_cache, slots)
            else:
                store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            tables, seq_lens, scratch = _kernel_plan(meta, q.shape[1])
            return cpu_kernels.decode_attention_unchecked(
                q[: tables.shape[0]].contiguous(),
                k_cache,
                v_cache,
                tables,
                seq_lens,
                scale,
                sliding_window,
                scratch,
            )
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode:
            rows, allowed = _decode_plan(meta, k_cache.shape[1], sliding_window)
            out = _masked_attention(
                q[:B].unsqueeze(1),
                _gather_pages(k_cache, rows),
                _gather_pages(v_cache, rows),
                allowed,
                scale,
                logit_softcap,
            )
            return out.squeeze(1)
        out = torch.empty_like(q)
        start = 0
        for b in range(B):
            n, L = meta.query_lens_host[b], meta.seq_lens_host[b]
            if n == 0:
                continue
            rows, allowed = _prefill_plan(meta, b, k_cache.shape[1], sliding_window)
            if n == L:  # the whole sequence is new: its K/V are this step's own, no need to gather them
                kk, vv = k[start : start + n].unsqueeze(0), v[start : start + n].unsqueeze(0)
            else:
                kk, vv = _gather_pages(k_cache, rows), _gather_pages(v_cache, rows)
            o = _masked_attention(q[start : start + n].unsqueeze(0), kk, vv, allowed, scale, logit_softcap)
            out[start : start + n] = o[0]
            start += n
        return out


#: The longest context the in-place decode kernel attends over (8 bytes of stack per key).
IN_PLACE_MAX_KEYS = 1 << 16
#: A step with prefill chunks goes through the same kernel while its longest sequence has at most this many
#: keys: each query token is a row of its own, attending to its sequence's keys up to its position, which
#: stay in cache from one token's row to the next. Longer sequences are read again for every token, and the
#: batched torch path takes them. SmolLM2's 640-token prefill step, 2-core EPYC, C kernel / torch, fp32 and
#: bf16, two runs (``benchmarks/scripts/cpu_prefill_attention_ab.py``, 2026-12-04,
#: ``benchmarks/results/cpu-2026-12-04-session23``): 16 prompts of 40 tokens 0.955-0.960 and 0.876-0.896;
#: 5 of 128 0.966-1.011 and 0.952-0.996; 2 of 256 0.979-0.981 and 0.981-1.004 (within the noise from 128 on).
PREFILL_IN_PLACE_MAX_KEYS = 128


def _in_place(q: torch.Tensor, k_cache: torch.Tensor, logit_softcap: float | None) -> bool:
    """Whether a decode step attends through the C kernel: CPU, fp32 or bf16 throughout, no softcap."""
    return (
        q.device.type == "cpu"
        and not logit_softcap
        and q.dtype in cpu_kernels.ATTENTION_DTYPES
        and q.dtype == k_cache.dtype
        and k_cache.is_contiguous()
        and q.shape[1] % k_cache.shape[2] == 0
        and not (torch.is_grad_enabled() and q.requires_grad)
        and cpu_kernels.available()
    )


def _kernel_plan(meta: AttentionMetadata, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The in-place kernel's rows, one per query token: each row's block table and length (int32,
    contiguous; a decode step's are its requests', a prefill token's are its sequence's table and its
    position + 1), and the kernel's fp32 score scratch; made once per step and shared by every layer
    (``meta.derived``)."""
    key = f"cpu-kernel-{num_heads}"
    if key not in meta.derived:
        B = meta.num_seqs
        tables, seq_lens = meta.block_tables[:B].to(torch.int32), meta.seq_lens[:B].to(torch.int32)
        if not meta.is_decode:
            pairs = zip(meta.query_lens_host, meta.seq_lens_host)
            of_seq = [b for b, n in enumerate(meta.query_lens_host) for _ in range(n)]
            tables = tables.index_select(0, torch.tensor(of_seq, dtype=torch.long))
            seq_lens = torch.tensor([L - n + i + 1 for n, L in pairs for i in range(n)], dtype=torch.int32)
        meta.derived[key] = (
            tables.contiguous(),
            seq_lens.contiguous(),
            cpu_kernels.attention_scratch(num_heads, meta.max_seq_len),
        )
    return meta.derived[key]


def _decode_plan(
    meta: AttentionMetadata, block_size: int, sliding_window: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache rows and the mask of a decode step. On CPU they are made once per step and shared by
    every layer (``meta.derived``); on CUDA each call makes its own, as a captured graph must."""
    key = f"torch-decode-{block_size}-{sliding_window}"
    if key in meta.derived:
        return meta.derived[key]
    B = meta.num_seqs
    rows = _page_rows(meta.block_tables[:B], block_size, meta.max_seq_len)
    seq_lens = meta.seq_lens[:B].long()
    plan = rows, _allowed((seq_lens - 1).unsqueeze(1), seq_lens, meta.max_seq_len, sliding_window)
    if seq_lens.device.type == "cpu":
        meta.derived[key] = plan
    return plan


def _prefill_plan(
    meta: AttentionMetadata, b: int, block_size: int, sliding_window: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Request ``b``'s cache rows and mask in a step with prefill chunks; shared by every layer on CPU
    as :func:`_decode_plan`'s are."""
    key = f"torch-prefill-{b}-{block_size}-{sliding_window}"
    if key in meta.derived:
        return meta.derived[key]
    n, L = meta.query_lens_host[b], meta.seq_lens_host[b]
    device = meta.block_tables.device
    rows = _page_rows(meta.block_tables[b : b + 1], block_size, L)
    q_pos = torch.arange(L - n, L, device=device).unsqueeze(0)
    plan = rows, _allowed(q_pos, torch.tensor([L], device=device), L, sliding_window)
    if device.type == "cpu":
        meta.derived[key] = plan
    return plan

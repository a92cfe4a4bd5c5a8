"""The torch attention backend: the reference every kernel is tested against; runs on CPU.

Decode batches gather every request's pages into one padded [B, L, Hkv, D] tensor and attend in one
batched call; batches with prefill chunks loop over their requests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mmlora.forward.attention import AttentionMetadata
from mmlora.layers.attention.base import (
    AttentionBackend,
    AttentionOptions,
    KVPages,
    register_attention_backend,
    store_kv,
)


def _gather_pages(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """cache [N, bs, Hkv, D], block_tables [B, M] -> [B, max_len, Hkv, D] (positions past a request's length are junk)."""
    bs = cache.shape[1]
    pos = torch.arange(max_len, device=cache.device)
    blocks = block_tables[:, pos // bs].long()  # [B, L]
    flat = blocks * bs + (pos % bs)
    return cache.view(-1, *cache.shape[2:])[flat]


def _masked_attention(
    q: torch.Tensor,  # [B, Tq, Hq, D]
    k: torch.Tensor,  # [B, L, Hkv, D]
    v: torch.Tensor,
    q_pos: torch.Tensor,  # [B, Tq] absolute positions (-1 = padding)
    kv_len: torch.Tensor,  # [B]
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
) -> torch.Tensor:
    j = torch.arange(k.shape[1], device=q.device)
    allowed = (j[None, None, :] <= q_pos[:, :, None]) & (j[None, None, :] < kv_len[:, None, None])
    if sliding_window:
        allowed &= j[None, None, :] > q_pos[:, :, None] - sliding_window
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
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        B = meta.num_seqs
        if meta.is_decode:
            kk = _gather_pages(k_cache, meta.block_tables[:B], meta.max_seq_len)
            vv = _gather_pages(v_cache, meta.block_tables[:B], meta.max_seq_len)
            q_pos = (meta.seq_lens[:B] - 1).long().unsqueeze(1)
            out = _masked_attention(
                q[:B].unsqueeze(1),
                kk,
                vv,
                q_pos,
                meta.seq_lens[:B].long(),
                scale,
                sliding_window,
                logit_softcap,
            )
            return out.squeeze(1)
        out = torch.empty_like(q)
        start = 0
        for b in range(B):
            n, L = meta.query_lens_host[b], meta.seq_lens_host[b]
            if n == 0:
                continue
            kk = _gather_pages(k_cache, meta.block_tables[b : b + 1], L)
            vv = _gather_pages(v_cache, meta.block_tables[b : b + 1], L)
            q_pos = torch.arange(L - n, L, device=q.device).unsqueeze(0)
            kv_len = torch.tensor([L], device=q.device)
            o = _masked_attention(
                q[start : start + n].unsqueeze(0), kk, vv, q_pos, kv_len, scale, sliding_window, logit_softcap
            )
            out[start : start + n] = o[0]
            start += n
        return out

"""torch-gather: the reference backend in plain PyTorch, right for any mix of ranks and base-only rows.

Decode-like batches (one token per segment) gather each token's A/B by slot and use one batched
matmul; prefill-like batches loop over the (few) segments with one dense matmul each, which avoids
materialising a [tokens, R, in] gather. Runs on CPU and GPU.

On CPU, decode-like batches instead group tokens by slot (from the host mirrors, no sync to pay) and
run one dense matmul per distinct adapter: the per-token gather copies every token's A and B, which on
CPU costs more than the matmuls themselves. On GPU the gather path stays, as it reads only device
tensors and so is capturable in CUDA graphs.
"""

from __future__ import annotations

import torch

from mmlora.backends.base import LoRABackend
from mmlora.backends.registry import register_backend
from mmlora.lora.batch_info import LoRABatchInfo


@register_backend("torch-gather")
class TorchGatherBackend(LoRABackend):
    def shrink(self, x: torch.Tensor, A: torch.Tensor, info: LoRABatchInfo) -> torch.Tensor:
        T = info.num_tokens
        if self._per_token(info) and x.device.type == "cpu":
            h = x.new_zeros(T, A.shape[1])
            for slot, idx in _slot_groups(info):
                h.index_copy_(0, idx, x.index_select(0, idx) @ A[slot].T)
            return h
        if self._per_token(info):
            slots = info.token_slots[:T].long()
            mask = slots >= 0
            a = A[slots.clamp(min=0)]  # [T, nR, in]
            h = torch.bmm(a, x[:T].unsqueeze(-1)).squeeze(-1)
            return h * mask.unsqueeze(-1).to(h.dtype)
        h = x.new_zeros(T, A.shape[1])
        start = 0
        for n, slot in zip(info.seg_lens_host, info.seg_slots_host):
            if slot >= 0:
                h[start : start + n] = x[start : start + n] @ A[slot].T
            start += n
        return h

    def expand(
        self,
        h: torch.Tensor,
        B: torch.Tensor,
        scalings: torch.Tensor,
        info: LoRABatchInfo,
        out: torch.Tensor,
        slice_offsets: tuple[int, ...],
    ) -> None:
        T = info.num_tokens
        R = B.shape[2]
        n_slices = len(slice_offsets) - 1
        if self._per_token(info) and h.device.type == "cpu":
            for slot, idx in _slot_groups(info):
                hs = h.index_select(0, idx)
                parts = [
                    (hs[:, i * R : (i + 1) * R] @ B[slot, slice_offsets[i] : slice_offsets[i + 1]].T)
                    * scalings[slot, i].to(h.dtype)
                    for i in range(n_slices)
                ]
                delta = parts[0] if n_slices == 1 else torch.cat(parts, dim=1)
                out[:, slice_offsets[0] : slice_offsets[-1]].index_add_(0, idx, delta.to(out.dtype))
            return
        if self._per_token(info):
            slots = info.token_slots[:T].long()
            mask = (slots >= 0).unsqueeze(-1)
            idx = slots.clamp(min=0)
            b = B[idx]  # [T, out, R]
            scale = scalings[idx]  # [T, n]
            for i in range(n_slices):
                lo, hi = slice_offsets[i], slice_offsets[i + 1]
                hi_ = h[:, i * R : (i + 1) * R].unsqueeze(-1)
                delta = torch.bmm(b[:, lo:hi], hi_).squeeze(-1) * scale[:, i : i + 1].to(h.dtype)
                out[:T, lo:hi] += (delta * mask).to(out.dtype)
            return
        start = 0
        for n, slot in zip(info.seg_lens_host, info.seg_slots_host):
            if slot >= 0:
                rows = slice(start, start + n)
                for i in range(n_slices):
                    lo, hi = slice_offsets[i], slice_offsets[i + 1]
                    delta = h[rows, i * R : (i + 1) * R] @ B[slot, lo:hi].T
                    out[rows, lo:hi] += (delta * scalings[slot, i].to(h.dtype)).to(out.dtype)
            start += n

    @staticmethod
    def _per_token(info: LoRABatchInfo) -> bool:
        return info.num_segments == info.num_tokens


# (info.seg_slots_host list, groups): the host lists are new objects at every fill, and holding a
# reference keeps the identity check sound; every LoRA layer of one forward reuses the groups.
_groups_cache: tuple[list[int] | None, list[tuple[int, torch.Tensor]]] = (None, [])


def _slot_groups(info: LoRABatchInfo) -> list[tuple[int, torch.Tensor]]:
    """(slot, int64 row indices) for every adapter slot of a one-token-per-segment batch."""
    global _groups_cache
    if _groups_cache[0] is not info.seg_slots_host:
        rows: dict[int, list[int]] = {}
        for t, slot in enumerate(info.seg_slots_host):
            if slot >= 0:
                rows.setdefault(slot, []).append(t)
        groups = [(slot, torch.tensor(r, dtype=torch.long, device=info.device)) for slot, r in rows.items()]
        _groups_cache = (info.seg_slots_host, groups)
    return _groups_cache[1]

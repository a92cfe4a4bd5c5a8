"""torch-gather: the reference backend in plain PyTorch, right for any mix of ranks and base-only rows.

Decode-like batches (one token per segment) gather each token's A/B by slot and use one batched
matmul; prefill-like batches loop over the (few) segments with one dense matmul each, which avoids
materialising a [tokens, R, in] gather. Runs on CPU and GPU.
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

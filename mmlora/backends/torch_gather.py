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

    def add_lora(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        scalings: torch.Tensor,
        info: LoRABatchInfo,
        slice_offsets: tuple[int, ...],
    ) -> None:
        """As the base class, but CPU decode batches over few slots take a dense path: a handful of
        matmuls over all slots with the other slots' rows masked to exact zeros. At small batches the
        cost is per torch call, not per FLOP, and this makes the call count independent of the adapters."""
        cpu_decode = info.has_lora and self._per_token(info) and x.device.type == "cpu"
        if not cpu_decode or info.num_slots > _DENSE_MAX_SLOTS:
            super().add_lora(out, x, A, B, scalings, info, slice_offsets)
            return
        T, S, R = info.num_tokens, A.shape[0], B.shape[2]
        n = len(slice_offsets) - 1
        onehot = _onehot(info, x.dtype)  # [T, S]
        h = (x[:T] @ A.view(-1, A.shape[2]).T).view(T, S, n * R) * onehot[:, :, None]
        parts = [
            h[:, :, i * R : (i + 1) * R].reshape(T, S * R)
            @ B[:, slice_offsets[i] : slice_offsets[i + 1]].permute(1, 0, 2).reshape(-1, S * R).T
            for i in range(n)
        ]
        delta = parts[0] if n == 1 else torch.cat(parts, dim=1)
        token_scale = onehot @ scalings.to(x.dtype)  # [T, n]: the scaling of each row's own adapter
        delta = delta * (
            token_scale if n == 1 else token_scale.repeat_interleave(_widths(slice_offsets), dim=1)
        )
        out[:T, slice_offsets[0] : slice_offsets[-1]] += delta.to(out.dtype)

    @staticmethod
    def _per_token(info: LoRABatchInfo) -> bool:
        return info.num_segments == info.num_tokens


_widths_cache: dict[tuple[int, ...], torch.Tensor] = {}


def _widths(slice_offsets: tuple[int, ...]) -> torch.Tensor:
    """Output width of each slice, as a CPU int64 tensor (cached: a few distinct modules per model)."""
    w = _widths_cache.get(slice_offsets)
    if w is None:
        w = torch.tensor([b - a for a, b in zip(slice_offsets, slice_offsets[1:])], dtype=torch.long)
        _widths_cache[slice_offsets] = w
    return w


_DENSE_MAX_SLOTS = 8


def _slot_groups(info: LoRABatchInfo) -> list[tuple[int, torch.Tensor]]:
    """(slot, int64 row indices) for every adapter slot of a one-token-per-segment batch."""
    route = info.host_derived
    if "groups" not in route:
        rows: dict[int, list[int]] = {}
        for t, slot in enumerate(info.seg_slots_host):
            if slot >= 0:
                rows.setdefault(slot, []).append(t)
        route["groups"] = [
            (slot, torch.tensor(r, dtype=torch.long, device=info.device)) for slot, r in rows.items()
        ]
    return route["groups"]


def _onehot(info: LoRABatchInfo, dtype: torch.dtype) -> torch.Tensor:
    """[T, num_slots] with a 1 at each row's slot (all zeros for base-only rows)."""
    route = info.host_derived
    key = f"onehot-{dtype}"
    if key not in route:
        m = torch.zeros(info.num_tokens, info.num_slots, dtype=dtype, device=info.device)
        for t, slot in enumerate(info.seg_slots_host):
            if slot >= 0:
                m[t, slot] = 1
        route[key] = m
    return route[key]

"""Long segments through dense GEMMs (cuBLAS on a GPU): the prefill-chunk half of SGMV's hybrid path.

A segment of L tokens on one adapter (a prefill chunk) needs two dense products: the shrink
``x_seg [L, in] @ A.T`` and the expand ``out_seg [L, out] += h [L, r] @ B.T * scaling``. The expand is
memory-bound on ``out_seg`` (read and written once, K = r only), which is what cuBLAS does at close to
the device's bandwidth; the segment Triton kernels reach about 1.4 TB/s there. The short rest of the
batch (decode rows) stays with SGMV (:mod:`mmlora.backends.triton_sgmv` chooses which segments come
here: ``TUNING["dense_min_seg"]``).

Every launch shape comes from host ints of the batch info (segment bounds, slots, ranks), so nothing
waits on the device; the launch count depends on the batch, so eager forwards only (CUDA-graph steps
keep their captured kernels: ``LoRABatchInfo.graph_layout`` is set there and the caller skips this).

Launches per segment and module: 1 shrink, 1 scaling multiply, 1 expand (packed slices of equal width,
e.g. gate_up, share one batched GEMM; qkv's unequal slices take one GEMM each).
"""

from __future__ import annotations

import torch

from mmlora.forward.lora import LoRABatchInfo, LoRAWeights

#: (first token, length, slot) of one segment.
Segment = tuple[int, int, int]


def long_segments(info: LoRABatchInfo, min_len: int) -> tuple[Segment, ...]:
    """Segments of at least ``min_len`` tokens that have an adapter, from the host mirrors (cached for
    the forward in ``info.host_derived``). None when ``min_len`` is 0 (the path is off)."""
    if min_len <= 0:
        return ()
    key = ("dense_segments", min_len)
    found = info.host_derived.get(key)
    if found is None:
        segs, start = [], 0
        for n, slot in zip(info.seg_lens_host, info.seg_slots_host):
            if slot >= 0 and n >= min_len:
                segs.append((start, n, slot))
            start += n
        found = info.host_derived[key] = tuple(segs)
    return found


def dense_segments_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    weights: LoRAWeights,
    ranks_host: list[int],
    segments: tuple[Segment, ...],
) -> None:
    """For each segment ``(t0, L, s)`` with rank ``r = ranks_host[s]`` and each slice ``i`` of ``weights``:

    ``out[t0:t0+L, o[i]:o[i+1]] += (x[t0:t0+L] @ A[s, i*R : i*R+r].T) @ B[s, o[i]:o[i+1], :r].T * sc[s, i]``

    x [T, in] and out [T, out] of one dtype (fp32/fp16/bf16; rows contiguous), A [S, n*R, in] and
    B [S, out, R] of that dtype, scalings [S, n] fp32. ``h = x @ A.T`` is rounded to x.dtype (as PEFT keeps
    it) and then multiplied by the scaling (a second rounding in fp16/bf16: ~2^-9 relative, inside the
    kernels' tolerance); the GEMMs accumulate in fp32. Weights past ``r`` are never read. Inputs are
    the backend's validated ones; this adds no checks of its own.
    """
    A, B, scalings, offs = weights.A, weights.B, weights.scalings, weights.slice_offsets
    n = weights.n_slices
    R = B.shape[2]
    widths = [b - a for a, b in zip(offs, offs[1:])]
    equal = n > 1 and all(w == widths[0] for w in widths)
    for t0, length, slot in segments:
        r = ranks_host[slot]
        if r <= 0:
            continue
        xs, os_ = x[t0 : t0 + length], out[t0 : t0 + length]
        a, b = A[slot], B[slot]
        if r == R:
            # One GEMM over every slice's rows; h [L, n*R] seen as [n, L, R] (strides R, n*R, 1).
            h = (xs @ a.T).unflatten(1, (n, R)).transpose(0, 1)
        else:
            # Rows past the rank skipped: one batched GEMM over [n, r, in] views of A, x shared.
            h = torch.bmm(xs.expand(n, *xs.shape), a.unflatten(0, (n, R))[:, :r].transpose(1, 2))
        h.mul_(scalings[slot].view(n, 1, 1))
        if n == 1:
            os_.addmm_(h[0], b[:, :r].T)
        elif equal:
            w = widths[0]
            os_[:, offs[0] : offs[-1]].unflatten(1, (n, w)).transpose(0, 1).baddbmm_(
                h, b.unflatten(0, (n, w))[:, :, :r].transpose(1, 2)
            )
        else:
            for i in range(n):
                os_[:, offs[i] : offs[i + 1]].addmm_(h[i], b[offs[i] : offs[i + 1], :r].T)

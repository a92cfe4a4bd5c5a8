"""CPU decode steps against their roofline, and a torch.profiler per-op profile of one decode step (the C
kernels' calls shown as ``mmlora_c::`` ranges beside the torch ops).

Used by ``python -m mmlora.bench cpu``. A decode step must read every weight once and each request's
K/V so far; its floor is those bytes (:class:`mmlora.bench.serving_parts.StepRecorder`) over the copy
bandwidth measured in the same process, right beside the timed decode run: STREAM-like ``copy_`` of a
256 MB buffer (far larger than the caches), :data:`BANDWIDTH_COPIES` of them just before the run and as
many just after; the best is the bandwidth.

Why the best of many, beside the run: on issue 21's 2-core VM one copy reads 33-34, 45-47 or 70-79 GB/s
depending on when it runs (each level holds for seconds, then moves; session 12 saw all three, with and
without another process on the other core), while a fp32 decode step takes about the same time at each.
Session 11's bench took the better of two samples minutes apart, and its roofline share swung between
0.21 and 0.35 from run to run. The roofline is a bound, so it takes the fastest the memory was seen to
deliver around the run; every sample is kept in the result.

The compute ceiling is reported beside it (the done-when check stays the bytes roofline): a decode step
of B rows multiplies every weight by B rows, ``2 B`` FLOPs a parameter, at no more than the rate the
decode path's own GEMM reaches with its weight hot in cache (:func:`gemm_flop_rate`, the model's widest
layer GEMM at the run's mean batch). On issue 21's 2-core EPYC an fp32 step of 16 rows takes longer at
that rate than its bytes take at the copy bandwidth (session 20: 21.6 against 14.1 ms): the step is
compute-bound, and the bytes roofline share is capped well below 1.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from mmlora.backends import cpu_expand, cpu_gemm, cpu_kernels, cpu_plan
from mmlora.backends.onednn import pack_weight, packed_matmul, packed_matmul_available
from mmlora.bench.serving_parts import StepRecorder, weight_bytes
from mmlora.engine.cpu_decode import cpu_bf16_flags

#: The decode step (counted from the first) that is profiled; it is left out of the roofline figures.
PROFILED_DECODE_STEP = 8
#: Copies timed just before and just after the decode run (each its own sample).
BANDWIDTH_COPIES = 5
#: Bytes each copy reads (and writes): far past the last-level cache.
BANDWIDTH_BYTES = 256 << 20


def copy_bandwidth_samples(copies: int = BANDWIDTH_COPIES, nbytes: int = BANDWIDTH_BYTES) -> list[float]:
    """Bytes/s of ``copies`` timed ``dst.copy_(src)`` of ``nbytes`` (read + write counted, as STREAM's
    copy), after one untimed copy that faults the pages in; torch's threads, as the decode uses."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    samples = []
    for _ in range(copies):
        t0 = time.perf_counter()
        dst.copy_(src)
        samples.append(2 * nbytes / (time.perf_counter() - t0))
    return samples


#: Timed calls of :func:`gemm_flop_rate` (the best counts).
GEMM_RATE_CALLS = 50


def gemm_flop_rate(
    rows: int, in_features: int, out_features: int, dtype: torch.dtype, calls: int = GEMM_RATE_CALLS
) -> float:
    """FLOP/s of ``x [rows, in] @ W.T`` for W [out, in] in ``dtype``, as the CPU decode path runs it (a
    packed matmul: the C panel GEMM, else oneDNN's, else ``F.linear``), W hot in cache: the best of
    ``calls`` timed calls after a few untimed ones; torch's threads."""
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(out_features, in_features, generator=gen) * 0.02).to(dtype)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    if packed_matmul_available(dtype):
        packed = pack_weight(w, rows)

        def gemm() -> torch.Tensor:
            return packed_matmul(x, packed)
    else:

        def gemm() -> torch.Tensor:
            return torch.nn.functional.linear(x, w)

    with torch.no_grad():
        for _ in range(5):
            gemm()
        best = float("inf")
        for _ in range(calls):
            t0 = time.perf_counter()
            gemm()
            best = min(best, time.perf_counter() - t0)
    return 2 * rows * in_features * out_features / best


def _widest_gemm(model: torch.nn.Module) -> tuple[int, int]:
    """(in, out) of the model's largest 2-D layer weight (the lm_head and the embedding left out)."""
    head = {id(model.lm_head.weight), id(model.model.embed_tokens.weight)}
    shapes = [p.shape for p in model.parameters() if p.dim() == 2 and id(p) not in head]
    out_f, in_f = max(shapes, key=lambda s: s[0] * s[1])
    return in_f, out_f


def _is_decode(sched: Any) -> bool:
    return bool(len(sched)) and all(
        n == 1 and r.num_computed + 1 == r.num_tokens for r, n in zip(sched.requests, sched.num_new)
    )


def measure_decode_roofline(
    engine: Any, generate: Callable[[], Any], profile_step: bool = True
) -> dict[str, Any]:
    """Run ``generate`` once with each forward of ``engine`` timed; decode steps against their floor.
    ``profile_step`` False: no step is profiled (every decode step counts).

    The bandwidth is the best of :func:`copy_bandwidth_samples` taken just before and just after the
    run (see the module docstring). Returns the decode steps' summed
    wall seconds and floor seconds, their ratio (fraction of the roofline reached), the same for
    prefill-holding steps (time only), the bandwidth samples, and the per-op profile of one decode step
    (the ``PROFILED_DECODE_STEP``-th).
    """
    runner = engine.runner
    own_forward = runner.__dict__.get("forward")
    dtype = next(engine.model.parameters()).dtype
    recorder = StepRecorder(engine, weight_bytes(engine.model), dtype)
    recorded = runner.forward
    prefill_seconds: list[float] = []
    profiled: dict[str, Any] = {}
    seen = {"decode": 0}

    def forward(sched):  # noqa: ANN001, ANN202
        decode = _is_decode(sched)
        if decode:
            seen["decode"] += 1
        if profile_step and decode and seen["decode"] == PROFILED_DECODE_STEP and not profiled:
            with (
                c_kernels_traced(),
                cpu_plan.timed() as replayed,
                profile(activities=[ProfilerActivity.CPU]) as prof,
            ):
                out = recorded(sched)
            recorder.pending = None
            profiled.update(_profile_summary(prof, len(sched), replayed))
            return out
        t0 = time.perf_counter()
        out = recorded(sched)
        seconds = time.perf_counter() - t0
        if decode:
            recorder.after_step(seconds)
        else:
            prefill_seconds.append(seconds)
        return out

    before = copy_bandwidth_samples()
    runner.forward = forward
    try:
        generate()
    finally:
        if own_forward is None:
            del runner.forward
        else:
            runner.forward = own_forward
    after = copy_bandwidth_samples()
    bandwidth = max(before + after)
    steps = recorder.steps
    actual = sum(s[0] for s in steps)
    floor = sum(recorder.floor_seconds(ctx, ranks, bandwidth) for _, _, ctx, ranks in steps)
    # The compute ceiling: every parameter a step reads is multiplied by each of its rows.
    params = recorder.weights * 8 // torch.finfo(dtype).bits
    mean_rows = max(1, round(sum(s[1] for s in steps) / max(len(steps), 1)))
    rate = gemm_flop_rate(mean_rows, *_widest_gemm(engine.model), dtype)
    compute_floor = sum(2 * rows * params / rate for _, rows, _, _ in steps)
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "weight_bytes": recorder.weights,
        "kv_bytes_per_token": recorder.kv_per_token,
        "decode_steps": len(steps),
        "decode_seconds": actual,
        "decode_floor_seconds": floor,
        "mean_decode_step_ms": 1e3 * actual / max(len(steps), 1),
        "mean_decode_floor_ms": 1e3 * floor / max(len(steps), 1),
        "fraction_of_roofline": floor / actual if actual else 0.0,
        "gemm_gflop_s": rate / 1e9,
        "gemm_rows": mean_rows,
        "mean_decode_compute_floor_ms": 1e3 * compute_floor / max(len(steps), 1),
        "fraction_of_compute_floor": compute_floor / actual if actual else 0.0,
        "bandwidth_gb_s": bandwidth / 1e9,
        "bandwidth_samples_gb_s": {
            "just_before": [b / 1e9 for b in before],
            "just_after": [b / 1e9 for b in after],
        },
        "prefill_steps": len(prefill_seconds),
        "prefill_seconds": sum(prefill_seconds),
        "profile": profiled,
    }


#: The C kernels' Python entry points (module or class, attribute), which the profiled step wraps in
#: ``record_function`` ranges: torch.profiler sees torch ops only, and these are ctypes calls.
C_ENTRY_POINTS = (
    (cpu_gemm, "matmul_unchecked"),
    (cpu_kernels, "decode_attention_unchecked"),
    (cpu_kernels, "store_kv_unchecked"),
    (cpu_kernels, "rms_norm_unchecked"),
    (cpu_kernels, "rotary_unchecked"),
    (cpu_expand.ExpandCall, "__call__"),
)


@contextlib.contextmanager
def c_kernels_traced() -> Iterator[None]:
    """Each of :data:`C_ENTRY_POINTS` runs inside a ``record_function("mmlora_c::<name>")`` range while
    inside; restored after."""
    saved = [(owner, name, getattr(owner, name)) for owner, name in C_ENTRY_POINTS]

    def traced(fn: Callable, label: str) -> Callable:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            with record_function(label):
                return fn(*args, **kwargs)

        return call

    for owner, name, fn in saved:
        label = f"mmlora_c::{'lora_expand' if name == '__call__' else name.removesuffix('_unchecked')}"
        setattr(owner, name, traced(fn, label))
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def _profile_summary(
    prof: Any, batch: int, replayed: dict[str, list[float]] | None = None, rows: int = 15
) -> dict[str, Any]:
    """The top ops by self CPU time: torch's and the ``mmlora_c::`` ranges, and where the step replayed a
    CPU plan (:mod:`mmlora.engine.cpu_graph`) its kernels as timed in C (``mmlora_plan::<kernel>``)."""
    ops = [
        {"op": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3}
        for e in prof.key_averages()
    ]
    ops += [
        {"op": f"mmlora_plan::{k}", "calls": n, "self_cpu_ms": t * 1e3}
        for k, (n, t) in (replayed or {}).items()
    ]
    ops.sort(key=lambda op: op["self_cpu_ms"], reverse=True)
    return {
        "batch": batch,
        "self_cpu_ms_total": sum(op["self_cpu_ms"] for op in ops),
        "ops_called": sum(op["calls"] for op in ops),
        "top_ops": ops[:rows],
    }


def format_profile(summary: dict[str, Any]) -> list[str]:
    """Report lines: one decode step's top ops by self CPU time."""
    if not summary:
        return ["  (no decode step was profiled: fewer decode steps than PROFILED_DECODE_STEP)"]
    total = summary["self_cpu_ms_total"]
    lines = [
        f"  per-op profile of one decode step (batch {summary['batch']}): {total:.1f} ms self CPU, "
        f"{summary['ops_called']} op calls",
        f"    {'op':48s} {'calls':>6s} {'ms':>8s} {'share':>6s}",
    ]
    for op in summary["top_ops"]:
        share = op["self_cpu_ms"] / total if total else 0.0
        lines.append(f"    {op['op'][:48]:48s} {op['calls']:6d} {op['self_cpu_ms']:8.2f} {share:6.1%}")
    return lines


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls natively (AVX-512 BF16 or AMX-BF16, from /proc/cpuinfo)."""
    return bool(cpu_bf16_flags())

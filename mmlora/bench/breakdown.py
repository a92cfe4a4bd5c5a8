"""Where each second of a serving run goes: per step kind, per host phase, LoRA kernels, adapter uploads.

:class:`StepBreakdown` instruments one in-process :class:`~mmlora.engine.Engine` for a benchmark by
wrapping the instance attributes a step goes through (nothing in the engine knows about it):

- step kinds: ``prefill`` (no row is a decode token), ``mixed`` (decode rows and prefill chunks), both
  run eagerly, ``mixed_graph`` (either of them replayed by the mixed-step graph runner,
  :mod:`mmlora.engine.mixed_graph`), ``decode_graph`` (a decode-only step through the decode-graph runner: a CUDA graph, or on CPU a
  recorded plan of C kernel calls, :mod:`mmlora.engine.cpu_graph`) and ``decode_eager`` (decode-only, run
  eagerly: no graphs, or a batch past the largest bucket);
- per kind: count, wall seconds of ``engine.step``, GPU span of the forward (CUDA events around it: the
  stream's time from the forward's first to its last kernel, idle gaps included, so a host-bound
  forward shows a span close to its launch time), host seconds spent launching the forward, seconds the
  host then waited for the GPU, and LoRA kernel time (events around every ``add_lora`` of every
  ``lora_sample_every``-th eager step of the kind, scaled to the kind's count; a graph replay hides its
  kernels, so ``decode_graph`` and ``mixed_graph`` have none: compare its GPU span with the base-only run's);
- host phases: schedule, build inputs (eager ``ModelRunner.build``; a graph step's static-input
  refresh is in its kind's ``forward_launch_s`` with the replay launch), LoRA batch info
  (``LoRABatchInfo.fill`` / the graph runner's ``prepare_replay``), LoRA host time (Python and Triton
  launches inside ``add_lora``; and the calls of ``fused_linear`` that fused, which on CPU include the
  base GEMM they replace), sample, postprocess (append token, stop checks, detokenize);
- adapter uploads into device slots: count, host seconds, GPU seconds, bytes;
- Triton compiles (``knobs.runtime.jit_post_compile_hook``): a timed run should have none;
- Python's cyclic garbage collector: collections per generation and the seconds they took (``gc.callbacks``):
  a full collection walks every live object, so its cost grows with what the process holds;
- the CUDA caching allocator's calls to the driver (``torch.cuda.memory_stats``): a run that grows or
  frees device memory, or retries an allocation after freeing its cache (which synchronizes), shows it.

Serial steps: the forward wrapper waits for the forward's last event before returning: the engine
samples right after and would wait there anyway, so the wait moves from ``sample`` into ``gpu_wait_s``.
Overlapped steps (``engine.overlap``) are never made to wait: ``gpu_wait_s`` is then the time the host
waited to read a launched step's tokens back, charged to that step's kind.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

import mmlora.engine.fault_isolation as sampling_module
import mmlora.engine.overlap as overlap_module
from mmlora.bench.process_counters import AllocatorCounter, CompileCounter, GCTimer
from mmlora.lora.layer import LoRALinear

KINDS = ("prefill", "mixed", "mixed_graph", "decode_graph", "decode_eager")
GRAPH_KINDS = ("mixed_graph", "decode_graph")
PHASES = ("schedule", "build_inputs", "lora_batch_info", "lora_host", "sample", "postprocess")


def step_kind(sched: Any, graphs: Any, mixed_graphs: Any = None) -> str:
    """The kind of a scheduled batch (see the module doc)."""
    decode = [n == 1 and r.num_computed + 1 == r.num_tokens for r, n in zip(sched.requests, sched.num_new)]
    if all(decode) and graphs is not None and graphs.can_run(sched):
        return "decode_graph"
    if mixed_graphs is not None and mixed_graphs.can_run(sched):
        return "mixed_graph"
    if all(decode):
        return "decode_eager"
    return "mixed" if any(decode) else "prefill"


class _Timer:
    """Host seconds of calls to a wrapped callable, added to ``sink[key]``."""

    def __init__(self, sink: dict[str, float], key: str, fn: Callable[..., Any]) -> None:
        self.sink, self.key, self.fn = sink, key, fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.sink[self.key] += time.perf_counter() - t0


class StepBreakdown:
    """Instruments ``engine`` while installed (see the module doc); :meth:`summary` after a run."""

    def __init__(self, engine: Any, lora_sample_every: int = 4) -> None:
        self.engine = engine
        self.lora_sample_every = max(1, lora_sample_every)
        self.cuda = engine.device.type == "cuda"
        self.compiles = CompileCounter()
        self.gc = GCTimer()
        self.allocator = AllocatorCounter(engine.device)
        self._undo: list[Callable[[], None]] = []
        self._in_lora = False  # inside a timed LoRA call (add_lora_after_base may call add_lora)
        self.host = dict.fromkeys(PHASES, 0.0)  # updated in place: the installed timers hold it
        self.reset()

    # ---- state ----------------------------------------------------------------------------------

    def reset(self) -> None:
        self.host.update(dict.fromkeys(PHASES, 0.0))
        self.kinds = {
            k: {"count": 0, "wall_s": 0.0, "forward_launch_s": 0.0, "gpu_wait_s": 0.0, "lora_calls": 0}
            for k in KINDS
        }
        self._spans: dict[str, list[tuple[Any, Any]]] = {k: [] for k in KINDS}
        self._lora_events: dict[str, list[list[tuple[Any, Any]]]] = {k: [] for k in KINDS}
        self.uploads = {"count": 0, "host_s": 0.0, "bytes": 0}
        self._upload_events: list[tuple[Any, Any]] = []
        self._kind: str | None = None
        self._kind_of_batch: dict[int, str] = {}  # overlap: id(launched batch) -> its kind, until read back
        self._sampling_lora: list[tuple[Any, Any]] | None = None
        self._compiles_at_reset = self.compiles.count
        self.gc.reset()
        self.allocator.reset()

    def _event(self) -> Any:
        return torch.cuda.Event(enable_timing=True) if self.cuda else None

    def _record(self) -> Any:
        ev = self._event()
        if ev is not None:
            ev.record()
        return ev

    # ---- wrapping -------------------------------------------------------------------------------

    def _wrap(self, obj: Any, name: str, wrapper: Callable[..., Any]) -> None:
        had = name in vars(obj)
        old = vars(obj).get(name)
        setattr(obj, name, wrapper)

        def undo() -> None:
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)

        self._undo.append(undo)

    def install(self) -> StepBreakdown:
        eng = self.engine
        runner, graphs = eng.runner, eng.runner.decode_graphs
        self._wrap(eng.scheduler, "schedule", _Timer(self.host, "schedule", eng.scheduler.schedule))
        self._wrap(runner, "build", _Timer(self.host, "build_inputs", runner.build))
        info = eng.lora.info
        self._wrap(info, "fill", _Timer(self.host, "lora_batch_info", info.fill))
        self._wrap(eng, "_append_token", _Timer(self.host, "postprocess", eng._append_token))
        self._wrap(eng, "step", self._timed_step(eng.step))
        self._wrap(runner, "forward", self._timed_forward(runner.forward))
        backend = next(m for m in eng.model.modules() if isinstance(m, LoRALinear)).ctx.backend
        self._wrap(backend, "add_lora", self._timed_lora(backend.add_lora))
        self._wrap(backend, "add_lora_after_base", self._timed_lora(backend.add_lora_after_base))
        self._wrap(backend, "fused_linear", self._timed_lora(backend.fused_linear, counts=_fused))
        pool = eng.lora._pool  # a benchmark instrument: the pool's slot writes are the uploads
        self._wrap(pool, "write_slot", self._timed_upload(pool.write_slot))
        if graphs is not None:
            self._wrap(
                eng.lora, "prepare_replay", _Timer(self.host, "lora_batch_info", eng.lora.prepare_replay)
            )
        sample = sampling_module.sample
        sampling_module.sample = _Timer(self.host, "sample", sample)
        self._undo.append(lambda: setattr(sampling_module, "sample", sample))
        sample_on_device = overlap_module.sample_on_device
        overlap_module.sample_on_device = _Timer(self.host, "sample", sample_on_device)
        self._undo.append(lambda: setattr(overlap_module, "sample_on_device", sample_on_device))
        read = overlap_module.InFlightStep.read
        overlap_module.InFlightStep.read = self._timed_read(read)
        self._undo.append(lambda: setattr(overlap_module.InFlightStep, "read", read))
        self.compiles.install()
        self._undo.append(self.compiles.uninstall)
        self.gc.install()
        self._undo.append(self.gc.uninstall)
        return self

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _timed_step(self, inner: Callable[[], Any]) -> Callable[[], Any]:
        def step() -> Any:
            self._kind = None
            t0 = time.perf_counter()
            out = inner()
            if self._kind is not None:
                self.kinds[self._kind]["wall_s"] += time.perf_counter() - t0
            return out

        return step

    def _timed_forward(self, inner: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def forward(sched: Any) -> Any:
            runner = self.engine.runner
            kind = step_kind(sched, runner.decode_graphs, runner.mixed_graphs)
            stats = self.kinds[kind]
            stats["count"] += 1
            self._kind = kind
            sampled = kind not in GRAPH_KINDS and (stats["count"] - 1) % self.lora_sample_every == 0
            self._sampling_lora = [] if sampled and self.cuda else None
            host_before = self.host["build_inputs"] + self.host["lora_batch_info"] + self.host["lora_host"]
            start = self._record()
            t0 = time.perf_counter()
            out = inner(sched)
            t1 = time.perf_counter()
            end = self._record()
            inner_host = self.host["build_inputs"] + self.host["lora_batch_info"] + self.host["lora_host"]
            stats["forward_launch_s"] += (t1 - t0) - (inner_host - host_before)
            if end is not None:
                if self.engine.overlap:
                    self._kind_of_batch[id(sched)] = kind
                else:
                    end.synchronize()
                    stats["gpu_wait_s"] += time.perf_counter() - t1
                self._spans[kind].append((start, end))
            if self._sampling_lora is not None:
                self._lora_events[kind].append(self._sampling_lora)
            self._sampling_lora = None
            return out

        return forward

    def _timed_read(self, inner: Callable[[Any], list[int]]) -> Callable[[Any], list[int]]:
        def read(step: Any) -> list[int]:
            t0 = time.perf_counter()
            tokens = inner(step)
            kind = self._kind_of_batch.pop(id(step.batch), None)
            if kind is not None:
                self.kinds[kind]["gpu_wait_s"] += time.perf_counter() - t0
            return tokens

        return read

    def _timed_lora(
        self, inner: Callable[..., Any], counts: Callable[[Any, tuple], bool] = lambda *_: True
    ) -> Callable[..., Any]:
        """``inner`` timed as LoRA work where ``counts(its result, its arguments)`` (every call by default)."""

        def add_lora(*args: Any, **kwargs: Any) -> Any:
            if self._in_lora:
                return inner(*args, **kwargs)
            sink = self._sampling_lora
            start = self._record() if sink is not None else None
            t0 = time.perf_counter()
            self._in_lora = True
            try:
                out = inner(*args, **kwargs)
            finally:
                self._in_lora = False
            if not counts(out, args):
                return out
            self.host["lora_host"] += time.perf_counter() - t0
            if self._kind is not None:
                self.kinds[self._kind]["lora_calls"] += 1
            if sink is not None:
                sink.append((start, self._record()))
            return out

        return add_lora

    def _timed_upload(self, inner: Callable[[int, Any], None]) -> Callable[[int, Any], None]:
        def write_slot(slot: int, adapter: Any) -> None:
            start = self._record()
            t0 = time.perf_counter()
            inner(slot, adapter)
            self.uploads["host_s"] += time.perf_counter() - t0
            self.uploads["count"] += 1
            self.uploads["bytes"] += adapter_upload_bytes(adapter)
            if start is not None:
                self._upload_events.append((start, self._record()))

        return write_slot

    # ---- results --------------------------------------------------------------------------------

    @staticmethod
    def _elapsed(pairs: list[tuple[Any, Any]]) -> float:
        return sum(a.elapsed_time(b) for a, b in pairs) / 1e3

    def summary(self) -> dict[str, Any]:
        """Seconds per kind and phase since the last :meth:`reset` (syncs the device once)."""
        if self.cuda:
            torch.cuda.synchronize(self.engine.device)
        kinds: dict[str, Any] = {}
        for k in KINDS:
            row: dict[str, Any] = dict(self.kinds[k])
            row["gpu_span_s"] = self._elapsed(self._spans[k]) if self.cuda else None
            sampled = self._lora_events[k]
            if self.cuda and sampled and k not in GRAPH_KINDS:
                per_step = sum(self._elapsed(s) for s in sampled) / len(sampled)
                row["lora_gpu_s"] = per_step * row["count"]
                row["lora_gpu_sampled_steps"] = len(sampled)
            else:
                row["lora_gpu_s"] = None
            kinds[k] = row
        uploads = dict(self.uploads)
        uploads["gpu_s"] = self._elapsed(self._upload_events) if self.cuda else None
        return {
            "step_kinds": kinds,
            "host_phases_s": dict(self.host),
            "adapter_uploads": uploads,
            "triton_compiles": self.compiles.count - self._compiles_at_reset
            if self.compiles.available
            else None,
            "lora_sample_every": self.lora_sample_every,
            "python_gc": self.gc.summary(),
            "cuda_allocator": self.allocator.summary(),
        }


def adapter_upload_bytes(adapter: Any) -> int:
    """Bytes of an adapter's A and B tensors (what an upload into a device slot copies): its staged blocks'
    where it has them (they hold exactly those tensors, back to back: a few blocks, where summing a
    Mistral-7B adapter's ~450 tensors took 0.5 ms of each timed upload on the H200 host)."""
    staged = getattr(adapter, "staged", None)
    if staged is not None:
        return sum(b.numel() * b.element_size() for b in staged)
    total = 0
    for w in adapter.weights.values():
        for t in (*w.A, *w.B):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


def format_summary(summary: dict[str, Any]) -> str:
    """A few lines for the console: per kind, then host phases, uploads and compiles."""

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.1f}"

    lines = []
    for k, r in summary["step_kinds"].items():
        if r["count"]:
            lines.append(
                f"  {k:12s} n={r['count']:4d} wall {ms(r['wall_s'])} ms, gpu span {ms(r['gpu_span_s'])}, "
                f"launch {ms(r['forward_launch_s'])}, gpu wait {ms(r['gpu_wait_s'])}, "
                f"lora gpu {ms(r['lora_gpu_s'])} ms"
            )
    phases = ", ".join(f"{p} {ms(v)}" for p, v in summary["host_phases_s"].items())
    up = summary["adapter_uploads"]
    lines.append(f"  host ms: {phases}")
    lines.append(
        f"  uploads {up['count']} ({up['bytes'] / 1e6:.0f} MB) host {ms(up['host_s'])} ms gpu "
        f"{ms(up['gpu_s'])} ms; triton compiles {summary['triton_compiles']}"
    )
    pgc = summary.get("python_gc")
    if pgc is not None:
        lines.append(f"  python gc: collections {pgc['collections']} (gen 0/1/2), {ms(pgc['total_s'])} ms")
    alloc = summary.get("cuda_allocator")
    if alloc is not None:
        lines.append("  cuda allocator: " + ", ".join(f"{k} {v}" for k, v in alloc.items()))
    return "\n".join(lines)


def _fused(result: Any, args: tuple) -> bool:
    """Whether a ``fused_linear`` call fused LoRA work (else it returned None and the layer calls
    ``add_lora``, or the batch had no adapter rows and it ran the base GEMM alone)."""
    info = args[4] if len(args) > 4 else None
    return result is not None and info is not None and info.has_lora

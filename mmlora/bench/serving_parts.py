"""Pieces of the serving benchmark: workload, driver, step recorder and roofline, engine memory (the plot is
:mod:`mmlora.bench.serving_plot`, the HF + PEFT baseline :mod:`mmlora.bench.peft_subset`)."""

from __future__ import annotations

import argparse
import platform
import time
from typing import Any

import numpy as np
import torch

from mmlora.bench.adapters import adapter_nbytes
from mmlora.kvcache.allocator import KVCache


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads of the base weights: all parameters but an untied input embedding and
    a vision tower (text decode steps never run it)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    visual = getattr(model, "visual", None)
    if visual is not None:
        total -= sum(p.numel() * p.element_size() for p in visual.parameters())
    emb = model.model.embed_tokens.weight
    if emb is not model.lm_head.weight:
        total -= emb.numel() * emb.element_size()
    return total


def copy_bandwidth(device: torch.device, nbytes: int | None = None) -> float:
    """Measured device copy bandwidth in bytes/s (read + write of a large buffer, best of 10)."""
    if device.type == "cuda":
        nbytes = nbytes or 2 << 30
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        dst.copy_(src)
        best = float("inf")
        for _ in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        del src, dst
        torch.cuda.empty_cache()
        return 2 * nbytes / best
    nbytes = nbytes or 256 << 20
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


class StepRecorder:
    """Wraps ``engine.runner.forward`` to note each decode-only step's shape; the driver adds its time.

    Floor of a step = (weight bytes + sum(context) x KV bytes per token + bytes of the distinct adapters
    in the batch) / copy bandwidth.
    """

    def __init__(self, engine: Any, weights: int, dtype: torch.dtype) -> None:
        self.engine = engine
        self.weights = weights
        attn = engine.model.layers[0].self_attn
        self.kv_per_token = KVCache.bytes_per_token(
            len(engine.model.layers), attn.num_kv_heads, attn.head_dim, dtype
        )
        self._adapter_bytes: dict[int, int] = {}
        self.dtype = dtype
        self.pending: tuple[int, int, list[int]] | None = None
        self.steps: list[tuple[float, int, int, list[int]]] = []  # (seconds, batch, sum ctx, ranks)
        inner = engine.runner.forward

        def forward(sched):  # noqa: ANN001, ANN202
            decode = all(
                n == 1 and r.num_computed + 1 == r.num_tokens for r, n in zip(sched.requests, sched.num_new)
            )
            if decode and len(sched):
                ranks = {r.lora.uid: r.lora.rank for r in sched.requests if r.lora is not None}
                ctx = sum(r.num_computed + 1 for r in sched.requests)
                self.pending = (len(sched), ctx, list(ranks.values()))
            return inner(sched)

        engine.runner.forward = forward

    def adapter_bytes(self, rank: int) -> int:
        if rank not in self._adapter_bytes:
            self._adapter_bytes[rank] = adapter_nbytes(self.engine.hf_config, rank, self.dtype)
        return self._adapter_bytes[rank]

    def floor_seconds(self, sum_ctx: int, ranks: list[int], bw: float) -> float:
        return (self.weights + sum_ctx * self.kv_per_token + sum(self.adapter_bytes(r) for r in ranks)) / bw

    def after_step(self, seconds: float) -> None:
        if self.pending is not None:
            self.steps.append((seconds, *self.pending))
            self.pending = None


def lora_replays(engine: Any) -> dict[str, int]:
    """Decode graph replays with LoRA so far, per row layout, and the adapters the shrink stage copied in
    (``stage_copies``, :mod:`mmlora.lora.stage`); a run's figures are the difference of two calls."""
    graphs = getattr(engine.runner, "decode_graphs", None)
    counts = dict(graphs.replays_by_layout) if graphs is not None else {}
    stage = engine.runner.lora.stage
    counts["stage_copies"] = stage.copies if stage is not None else 0
    return counts


def engine_memory(engine: Any) -> dict[str, int]:
    """What the engine's memory went to, beside the weights: KV cache tokens, and the bytes of the adapter
    slots and of the shrink stage (:mod:`mmlora.lora.stage`, 0 when off), which come out of the KV cache."""
    lora = engine.runner.lora
    return {
        "kv_tokens": engine.stats()["kv_tokens_total"],
        "adapter_slot_bytes": lora.nbytes(),
        "stage_bytes": lora.stage_nbytes(),
    }


def describe_memory(memory: dict[str, int]) -> str:
    """One line of :func:`engine_memory`'s figures."""
    return (
        f"KV cache {memory['kv_tokens']} tokens, adapter slots {memory['adapter_slot_bytes'] / 2**30:.2f} GiB, "
        f"stage {memory['stage_bytes'] / 2**30:.2f} GiB"
    )


def time_graph_layouts(engine: Any, reps: int = 20) -> dict[str, float | None] | None:
    """Mean seconds of replaying the last step's graph in each LoRA row layout the backend captured
    (``rows`` / ``runs``: the same batch, its routing refilled in each layout; None for a layout whose
    graph cannot hold this batch's runs); None when that step ran eagerly or had no adapter rows."""
    graphs = engine.runner.decode_graphs
    if graphs is None or not graphs.capture or graphs.last_key is None or not graphs.last_key[1]:
        return None
    bs, bound, _ = graphs.last_key
    times: dict[str, float | None] = {}
    for layout in engine.lora.graph_layouts:
        try:
            engine.lora.prepare_replay(graphs.last_slots, layout)
        except ValueError:  # more runs than the graph's segment entries (triton-auto: half the rows)
            times[layout] = None
            continue
        times[layout] = _time_replays(graphs.graphs[(bs, bound, layout)].graph, reps)
    return times


def time_graph_replay(engine: Any, reps: int = 20) -> float | None:
    """Mean seconds of replaying the graph the last step replayed (its batch bucket and rank bound, on
    its inputs); None when that step ran eagerly."""
    graphs = engine.runner.decode_graphs
    if graphs is None or not graphs.capture or graphs.last_key is None:
        return None
    return _time_replays(graphs.graphs[graphs.last_key].graph, reps)


def _time_replays(graph: Any, reps: int) -> float:
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def record_forward_host(engine: Any) -> list[float]:
    """Wrap ``engine.runner.forward`` (on the instance) so that each call appends its host seconds to the
    returned list (the time to launch a forward, or to run it where it syncs)."""
    inner = engine.runner.forward
    seconds: list[float] = []

    def timed_forward(sched: Any) -> Any:
        t0 = time.perf_counter()
        out = inner(sched)
        seconds.append(time.perf_counter() - t0)
        return out

    engine.runner.forward = timed_forward
    return seconds


def mean_step_seconds(engine: Any, steps: int, warm: int = 3, drain: bool = True) -> float:
    """Mean wall seconds of ``steps`` back-to-back ``engine.step()`` calls after ``warm`` untimed ones.

    ``drain``: the device drained before and after (with the overlap scheduler the last step still runs
    when ``step`` returns), so the mean also carries one exposed launch (the host scheduling and launching
    the first step while the device waits) divided by ``steps``: on a slow host, most of its excess over
    the graph replay. Without: the clock runs from one step's return to the return ``steps`` steps later,
    the pipeline full; with the overlap scheduler a step returns once the device has finished the step
    before it, so this is a decode step's cost in steady serving."""
    for _ in range(warm):
        engine.step()
    sync = torch.cuda.synchronize if drain and engine.device.type == "cuda" else lambda: None
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    return (time.perf_counter() - t0) / steps


def timed_step(engine: Any) -> tuple[float, float]:
    """(wall seconds, GPU span seconds) of one ``engine.step()`` on CUDA, the device idle before it (the
    span: CUDA events around the step, idle gaps included)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    engine.step()
    end.record()
    wall = time.perf_counter() - t0
    end.synchronize()
    return wall, start.elapsed_time(end) / 1e3


def start_decode_batch(engine: Any, names: list[str | None], context: int, rng: np.random.Generator) -> list:
    """One request per name (adapter name or None) with ``context - 1`` random prompt ids, stepped until all
    of them decode (every prompt prefilled, one token sampled each); returns their ids."""
    vocab = engine.model.arch.vocab_size
    rids = [
        engine.add_request(
            input_ids=rng.integers(0, vocab, context - 1).tolist(),
            lora=name,
            sampling_params={"max_new_tokens": engine.max_model_len, "temperature": 0.0, "ignore_eos": True},
        )
        for name in names
    ]
    while engine.scheduler.waiting or any(
        r.num_computed < r.num_tokens - 1 or not r.output_ids for r in engine.scheduler.running
    ):
        engine.step()
    return rids


def abort_all(engine: Any, rids: list) -> None:
    """Abort the requests and step the engine until nothing is left."""
    for rid in rids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()


def make_workload(
    args: argparse.Namespace, n: int, vocab: int, rng: np.random.Generator
) -> list[dict[str, Any]]:
    """Requests sorted by arrival; lengths and arrivals depend only on the seed (the same at every n)."""
    fixed = np.random.default_rng(args.seed)
    count = args.num_requests
    in_lens = fixed.integers(args.input_len[0], args.input_len[1], count)
    out_lens = fixed.integers(args.output_len[0], args.output_len[1], count)
    if args.arrival == "poisson":
        arrivals = np.cumsum(fixed.exponential(1.0 / args.rate, count))
    else:
        arrivals = np.zeros(count)
    if n == 0:
        loras: list[int | None] = [None] * count
    elif args.popularity == "uniform":
        loras = rng.integers(0, n, count).tolist()
    elif args.popularity == "zipf":
        p = 1.0 / np.arange(1, n + 1) ** args.zipf_alpha
        loras = rng.choice(n, count, p=p / p.sum()).tolist()
    else:
        loras = [i % n for i in range(count)]
    return [
        {
            "arrival": float(arrivals[i]),
            "input_ids": fixed.integers(0, vocab, int(in_lens[i])).tolist(),
            "output_len": int(out_lens[i]),
            "lora": loras[i],
        }
        for i in range(count)
    ]


def result_header(
    benchmark: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype, lora_backend: str
) -> dict[str, Any]:
    """Where and how a benchmark ran: the first fields of its JSON."""
    return {
        "benchmark": benchmark,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "args": dict(vars(args)),
        "dtype": str(dtype),
        "lora_backend": lora_backend,
    }


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def run_workload(
    engine: Any, work: list[dict[str, Any]], recorder: StepRecorder, bw: float
) -> dict[str, Any]:
    """Drive the engine in-process with the workload's arrivals; per-request TTFT/TPOT and step records.

    Starts from an empty prefix cache: runs reuse prompts (a sweep's rounds repeat them, and request i
    keeps its prompt at every adapter count, on the same adapter where i < n), so pages an earlier run
    cached would otherwise skip this run's prefill (a second round's base-only TTFT p50 was 197 ms
    against 673, H200 2026-12-02)."""
    if not engine.flush_cache():
        raise RuntimeError("run_workload: the engine still has requests from an earlier run")
    recorder.steps.clear()
    finals: dict[str, Any] = {}
    idx = 0
    t0 = time.monotonic()
    while idx < len(work) or engine.has_unfinished():
        now = time.monotonic() - t0
        while idx < len(work) and work[idx]["arrival"] <= now:
            w = work[idx]
            sp = {"max_new_tokens": w["output_len"], "temperature": 0.0, "ignore_eos": True}
            engine.add_request(
                input_ids=w["input_ids"], lora=w["lora"], sampling_params=sp, request_id=f"w{idx}"
            )
            idx += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, work[idx]["arrival"] - now))
            continue
        s0 = time.perf_counter()
        outs = engine.step()
        recorder.after_step(time.perf_counter() - s0)
        for o in outs:
            if o.finish_reason is not None:
                finals[o.request_id] = o
    total = time.monotonic() - t0
    bad = [o for o in finals.values() if o.finish_reason != "length" or o.error]
    if bad or len(finals) != len(work):
        raise RuntimeError(
            f"{len(bad)} requests failed (first: {bad[0] if bad else None}); {len(finals)}/{len(work)} done"
        )
    ttft = [o.first_token_time - o.arrival_time for o in finals.values()]
    tpot = [
        (o.finish_time - o.first_token_time) / (len(o.output_ids) - 1)
        for o in finals.values()
        if len(o.output_ids) > 1
    ]
    out_tokens = sum(len(o.output_ids) for o in finals.values())
    steps = recorder.steps
    decode_s = sum(s[0] for s in steps)
    floor_s = sum(recorder.floor_seconds(s[2], s[3], bw) for s in steps)
    return {
        "num_requests": len(work),
        "seconds": total,
        "req_per_s": len(work) / total,
        "output_tokens": out_tokens,
        "output_tok_per_s": out_tokens / total,
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "tpot_p50_s": _pct(tpot, 50),
        "tpot_p99_s": _pct(tpot, 99),
        "decode_steps": len(steps),
        "decode_seconds": decode_s,
        "decode_floor_seconds": floor_s,
        "decode_over_floor": decode_s / floor_s if floor_s else float("nan"),
        "mean_decode_batch": float(np.mean([s[1] for s in steps])) if steps else 0.0,
        "mean_distinct_adapters_per_decode_step": float(np.mean([len(s[3]) for s in steps]))
        if steps
        else 0.0,
    }

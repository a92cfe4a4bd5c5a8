"""``python -m mmlora.bench serving``: the standard multi-LoRA workload (design.md section 5) in-process.

For each number of adapters n (``--num-adapters 1 8 32 128 1000``) one workload runs through one
``Engine`` (requests of random token ids, adapters drawn uniform / Zipf / distinct from the first n,
arrivals Poisson at ``--rate`` or all at once, input and output lengths uniform in their ranges, greedy,
ignore_eos); then the same workload without adapters (base only: the LoRA layers skip, and decode
replays the no-LoRA CUDA graphs). ``--workload shared-prefix`` runs the prefix cache on against off instead
(mmlora.bench.serving_prefix). Reported per run: requests/s, output tokens/s, TTFT and TPOT p50/p99,
and the roofline floor of the decode steps it ran: sum over steps of (weight bytes + KV bytes read +
bytes of the distinct adapters in the step) / copy bandwidth, with the bandwidth measured in this run.

Also in the same run: HF + PEFT mixed-adapter ``generate`` on a small subset (batch ``--hf-batch`` x
``--hf-tokens`` tokens over 8 adapters) with mmlora on the very same subset, and the decode-step
microbenchmark: B requests each on its own rank-16 adapter (or cycling over ``--micro-adapters`` of
them) at context ``--micro-context``, one decode step timed (CUDA-graph replay, and the whole engine
step) against its roofline floor, and its graph replayed in each LoRA row layout the backend captured.

Adapters are random PEFT folders written by :mod:`mmlora.bench.adapters` (at most 16 distinct weight
files; the rest are hard links under their own names, see there). Only the adapters a run uses are
registered, before its clock starts: the host cache holds them all, and those that fit into free device
slots are loaded there (as registering does in a server). Writes ``serving.json`` and
``serving.png`` (output tokens/s against number of adapters, one line per system) into ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmlora.bench import serving_tenants
from mmlora.bench.adapters import write_random_adapters
from mmlora.bench.breakdown import StepBreakdown, format_summary
from mmlora.bench.cli import progress
from mmlora.bench.peft_subset import hf_peft_subset, mmlora_subset
from mmlora.bench.serving_cli import mix_label, parse_args
from mmlora.bench.serving_parts import (
    StepRecorder,
    abort_all,
    copy_bandwidth,
    describe_memory,
    engine_memory,
    lora_replays,
    make_workload,
    mean_step_seconds,
    result_header,
    run_workload,
    start_decode_batch,
    time_graph_layouts,
    time_graph_replay,
    weight_bytes,
)
from mmlora.bench.serving_plot import plot
from mmlora.engine.setup import freeze_startup_objects
from mmlora.lora.pages import pages_for

logger = logging.getLogger(__name__)


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _partial(out: Path, data: dict[str, Any]) -> None:
    """What is measured so far, in case a time limit stops the run before the final JSON."""
    (out / "serving.partial.json").write_text(json.dumps(data, indent=1, default=str))


def _engine(args: argparse.Namespace, slots: int, rank: int) -> Any:
    import mmlora

    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    return mmlora.Engine(
        model=args.model,
        device=str(device),
        dtype=args.dtype,
        max_loras_per_batch=slots,
        max_lora_rank=rank,
        lora_page_rank=getattr(args, "lora_page_rank", None),
        lora_backend=args.lora_backend,
        max_running_requests=args.max_running_requests,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        disable_cuda_graph=args.disable_cuda_graph,
        weight_layout=getattr(args, "weight_layout", "row-major"),
        disable_mixed_cuda_graph=getattr(args, "disable_mixed_cuda_graph", False),
        disable_lora_overlap=getattr(args, "disable_lora_overlap", False),
        lora_stage_slots=getattr(args, "lora_stage_slots", None),
        **side_max_tokens(args),
        overlap_schedule=getattr(args, "overlap_schedule", "auto"),
        disable_async_uploads=getattr(args, "disable_async_uploads", False),
        tp_size=args.tp_size,
        seed=args.seed,
        schedule_policy=getattr(args, "schedule_policy", "fcfs"),
    )


def side_max_tokens(args: argparse.Namespace) -> dict[str, int]:
    """``lora_side_max_tokens`` where the command line sets it (else the engine's default)."""
    value = getattr(args, "lora_side_max_tokens", None)
    return {} if value is None else {"lora_side_max_tokens": value}  # EngineConfig checks the value


def _register(engine: Any, adapters: list[dict[str, Any]], names: set[str]) -> float:
    """Register the named adapters not registered yet (host cache, and free device slots: see
    ``LoRAManager.load``); seconds taken."""
    t0 = time.perf_counter()
    known = {e["name"] for e in engine.list_loras()}
    for a in adapters:
        if a["name"] in names and a["name"] not in known:
            engine.load_lora(a["name"], a["path"])
    return time.perf_counter() - t0


def _warmup(
    engine: Any,
    args: argparse.Namespace,
    adapters: list[dict],
    recorder: StepRecorder,
    bw: float,
    rng: np.random.Generator,
) -> None:
    """The timed workload, untimed, first: its requests, prompts and output lengths, all arriving at
    once, on two adapters with every third request on the base model (for the shared-prefix workload,
    which warms up here too: a standard workload of ``--num-requests`` requests).

    - Triton compiles a kernel variant per new shape class of a prefill batch, which must not land
      inside a timed run (it made the first LoRA point of a sweep look slowest).
    - Whatever else a process does the first time it serves a workload must not either. After a
      32-request warm-up, the first timed run's mixed steps launched as slowly as the GPU ran them
      (forward launch at least 0.95 of GPU span) in 34 of 37 H200 runs of sessions 12-22. No later
      run did, in 0 of about 200. That first run is always base-only round 0, so its slowness inflated
      round 0's LoRA ratios.
    """
    warm = {"arrival": "all"}
    work = make_workload(argparse.Namespace(**{**vars(args), **warm}), 2, engine.model.arch.vocab_size, rng)
    _register(engine, adapters, {a["name"] for a in adapters[:2]})
    for i, w in enumerate(work):
        w["lora"] = adapters[w["lora"]]["name"] if i % 3 else None
    run_workload(engine, work, recorder, bw)


def _micro(
    engine: Any, args: argparse.Namespace, adapters: list[dict], recorder: StepRecorder, bw: float
) -> list:
    """One decode step with bsz requests, each on its own adapter (or none), at context ~micro_context."""
    rng = np.random.default_rng(args.seed + 1)
    rows = []
    for bsz in args.micro_batch:
        for with_lora in (True, False):
            # The batch's rows must fit the running requests and its distinct adapters the slots.
            n_adapters = min(bsz, args.micro_adapters or bsz) if with_lora else 0
            if bsz > args.max_running_requests or n_adapters > min(args.max_loras_per_batch, len(adapters)):
                rows.append(
                    {"batch": bsz, "lora": with_lora, "skipped": "bsz exceeds slots/adapters/running"}
                )
                continue
            if with_lora:
                names = [adapters[i % n_adapters]["name"] for i in range(bsz)]
            else:
                names = [None] * bsz
            if with_lora:
                _register(engine, adapters, set(names))
            rids = start_decode_batch(engine, names, args.micro_context, rng)
            steps = 10
            step_s = mean_step_seconds(engine, steps)
            running = list(engine.scheduler.running)
            ctx = [r.num_computed + 1 - steps / 2 for r in running]  # the middle of the timed steps
            ranks = {r.lora.uid: r.lora.rank for r in running if r.lora is not None}
            floor_s = recorder.floor_seconds(sum(ctx), list(ranks.values()), bw)
            replay_s = time_graph_replay(engine)
            by_layout = time_graph_layouts(engine) if with_lora else None
            # Last: the replays above keep the context these steps would grow.
            steady_s = mean_step_seconds(engine, steps, drain=False)
            abort_all(engine, rids)
            rows.append(
                {
                    "batch": bsz,
                    "lora": with_lora,
                    "distinct_adapters": len(ranks),
                    "mean_context": float(np.mean(ctx)),
                    "engine_step_ms": step_s * 1e3,
                    "engine_step_steady_ms": steady_s * 1e3,
                    "graph_replay_ms": None if replay_s is None else replay_s * 1e3,
                    "floor_ms": floor_s * 1e3,
                    "step_over_floor": step_s / floor_s,
                    "replay_over_floor": None if replay_s is None else replay_s / floor_s,
                    "graph_replay_ms_by_layout": None
                    if by_layout is None
                    else {k: None if v is None else v * 1e3 for k, v in by_layout.items()},
                }
            )
            logger.info("micro %s", rows[-1])
            print(f"decode step B={bsz} lora={with_lora}: {rows[-1]}", flush=True)
    return rows


def _point(run: dict[str, Any], args: argparse.Namespace) -> str:
    """A run's key in the summary dicts: its adapter count, with its rank mix when there are several and
    its round when there are several."""
    n = str(run["num_adapters"])
    key = f"ranks {mix_label(run['ranks'])} n={n}" if len(args.mixes) > 1 and "ranks" in run else n
    return key + (f" round {run['round'] + 1}" if args.sweep_rounds > 1 else "")


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    all_ranks = sorted(
        {*(r for mix in args.mixes for r in mix), *([args.micro_rank] if args.micro_batch else [])}
    )
    pool_rank = args.pool_rank or all_ranks[-1]
    n_max = max([*args.num_adapters, *(args.micro_batch or [0])])
    engine = _engine(args, args.max_loras_per_batch, pool_rank)
    # Requests are random token ids: no text to produce. The engine's detokenizer re-decodes each request's
    # whole output every step (O(n^2)); SGLang/vLLM run it in another process, so it stays out of here.
    engine.tokenizer = None
    device, dtype = engine.device, engine.model.lm_head.weight.dtype
    lora_backend = engine.lora_backend
    overlap = engine.overlap
    graphs = engine.runner.mixed_graphs
    mixed_graphs = {"on": graphs is not None, "graph_bytes": graphs.pool_bytes if graphs else 0}
    bw, memory = copy_bandwidth(device), engine_memory(engine)
    print(
        f"engine up on {device} ({dtype}) in {time.perf_counter() - t_start:.1f} s; copy bandwidth {bw / 1e12:.3f} TB/s; "
        f"{describe_memory(memory)}"
    )
    tmp = tempfile.TemporaryDirectory() if args.adapter_dir is None else None
    adir = Path(args.adapter_dir or tmp.name)
    t0 = time.perf_counter()
    by_mix = {
        mix_label(mix): write_random_adapters(
            engine.hf_config, adir / f"sweep-{i}", n_max, mix, dtype=dtype, seed=args.seed,
            prefix=f"lora-r{mix_label(mix).replace(',', '-')}-",
        )
        for i, mix in enumerate(args.mixes)
    }  # fmt: skip
    adapters = next(iter(by_mix.values()))
    micro_adapters = adapters
    if args.micro_batch and args.mixes != [[args.micro_rank]]:
        micro_adapters = write_random_adapters(
            engine.hf_config, adir / "micro", max(args.micro_batch), [args.micro_rank], dtype=dtype,
            seed=args.seed + 99, prefix="micro-",
        )  # fmt: skip
    print(f"wrote adapters in {time.perf_counter() - t0:.1f} s")
    recorder = StepRecorder(engine, weight_bytes(engine.model), dtype)
    rng = np.random.default_rng(args.seed)
    breakdown = StepBreakdown(engine).install()
    t0 = time.perf_counter()
    _warmup(engine, args, adapters, recorder, bw, rng)
    warmup = {"seconds": time.perf_counter() - t0, "breakdown": breakdown.summary()}
    print(f"warm-up (the timed workload once, untimed) in {warmup['seconds']:.1f} s")
    print(format_summary(warmup["breakdown"]), flush=True)
    if not args.no_gc_freeze:
        freeze_startup_objects()  # as launch_server does once the engine is up
    runs = []
    skipped = []
    round_points = [(mix_label(args.mixes[0]), 0)] + [
        (mix_label(m), n) for m in args.mixes for n in args.num_adapters
    ]
    points = [(k, label, n) for k in range(args.sweep_rounds) for label, n in round_points]
    base_of_round: dict[int, dict[str, Any]] = {}
    for k, label, n in progress(points, "workloads"):  # base-only first in each round: its ratios need it
        if args.time_budget and n and time.perf_counter() - t_start > 0.6 * args.time_budget:
            skipped.append(n)  # leave time for the decode-step microbench and HF + PEFT
            print(f"skipping n={n}: past 60% of --time-budget {args.time_budget:.0f} s", flush=True)
            continue
        adapters = by_mix[label]
        # Which adapter each request takes depends on the round and the adapter count only, so runs with
        # other points (one rank mix against two, a knob's A/B) time the same requests at each point.
        work = make_workload(args, n, engine.model.arch.vocab_size, np.random.default_rng([args.seed, k, n]))
        used = {w["lora"] for w in work if w["lora"] is not None}
        load_s = _register(engine, adapters, {adapters[i]["name"] for i in used})
        for w in work:
            w["lora"] = adapters[w["lora"]]["name"] if w["lora"] is not None else None
        breakdown.reset()
        replays0 = lora_replays(engine)
        res = run_workload(engine, work, recorder, bw)
        res["breakdown"] = breakdown.summary()
        res["lora_replays"] = {k: v - replays0.get(k, 0) for k, v in lora_replays(engine).items()}
        res.update({"num_adapters": n, "system": "mmlora" if n else "base-only", "adapter_load_s": load_s})
        res["distinct_adapters_used"] = len(used)
        res["round"] = k
        if n:
            # The share of the used adapters' slot bytes that is padding: each holds a pool-rank slot, or
            # in a paged pool the pages its rank needs (a power of two of them).
            own = sum(recorder.adapter_bytes(adapters[i]["rank"]) for i in used)
            page = engine.lora_page_rank
            held = [
                pool_rank if page is None else page * pages_for(adapters[i]["rank"], page, pool_rank // page)
                for i in used
            ]
            res["ranks"] = [int(r) for r in label.split(",")]
            res["slot_padding_fraction"] = 1 - own / sum(recorder.adapter_bytes(r) for r in held)
            # The same share read off the pool: the slots its adapters hold at the end of the run.
            lora = engine.runner.lora
            entries = [lora.entry(adapters[i]["name"]) for i in used]
            res["slot_padding_fraction_pool"] = lora.slot_padding_fraction([e for e in entries if e])
            base_run = base_of_round[k]
            res["over_base"] = res["output_tok_per_s"] / base_run["output_tok_per_s"]
            res["ttft_p50_over_base"] = res["ttft_p50_s"] / base_run["ttft_p50_s"]
            # The ratio decode steps could reach at the copy bandwidth: base-only's decode floor over this
            # run's, whose steps also read each distinct adapter's bytes once.
            res["decode_bytes_bound"] = base_run["decode_floor_seconds"] / res["decode_floor_seconds"]
        else:
            base_of_round[k] = res
        runs.append(res)
        _partial(out, {"runs": runs})
        print(
            f"{res['system']:9s} ranks {label if n else '-':6s} n={n:5d}: {res['output_tok_per_s']:9.1f} out tok/s"
            + (
                f" ({res['over_base']:.2f}x base-only; bytes bound {res['decode_bytes_bound']:.2f}x)"
                if n
                else ""
            )
            + f", {res['req_per_s']:6.2f} req/s, "
            f"TTFT p50 {res['ttft_p50_s'] * 1e3:.0f} ms, TPOT p50 {res['tpot_p50_s'] * 1e3:.1f} ms, "
            f"decode {res['decode_over_floor']:.2f}x floor, adapters loaded in {load_s:.1f} s "
            f"({time.perf_counter() - t_start:.0f} s)",
            flush=True,
        )
        print(format_summary(res["breakdown"]), flush=True)
    breakdown.uninstall()
    micro = _micro(engine, args, micro_adapters, recorder, bw) if args.micro_batch else []
    _partial(out, {"runs": runs, "decode_step": micro})
    subset = hf = None
    hf_config = engine.hf_config
    adapter_bytes = {str(r): recorder.adapter_bytes(r) for r in all_ranks}
    weights = recorder.weights
    if args.hf_batch:
        _register(engine, adapters, {a["name"] for a in adapters[: args.hf_adapters]})
        subset = mmlora_subset(engine, args, adapters)
        print(f"mmlora on the HF + PEFT subset: {subset}", flush=True)
        _partial(out, {"runs": runs, "decode_step": micro, "mmlora_subset": subset})
    engine.runner.decode_graphs = engine.runner.mixed_graphs = None
    engine.shutdown()
    del engine, recorder
    gc.unfreeze()  # the engine's objects may now be garbage in cycles: let the collector see them
    _free()
    if args.hf_batch:
        hf = hf_peft_subset(hf_config, args, adapters, device, dtype, free=_free)
        print(f"HF + PEFT subset: {hf}", flush=True)
    result = {
        **result_header("serving", args, device, dtype, lora_backend),
        "overlap_schedule": overlap,  # what "auto" resolved to
        "mixed_cuda_graphs": mixed_graphs,  # prefill and mixed steps replayed (mmlora.engine.mixed_graph)
        "copy_bandwidth_bytes_per_s": bw,
        "memory": memory,  # KV cache tokens, adapter slot and stage bytes (the stage's come out of the KV cache)
        "weight_bytes": weights,
        "adapter_bytes_by_rank": adapter_bytes,
        "pool_rank": pool_rank,
        "warmup": warmup,  # what the first run pays that timed runs must not (see _warmup)
        "runs": runs,
        "skipped_num_adapters": skipped,
        "mixed_over_base": {_point(r, args): r.get("over_base", 1.0) for r in runs},
        "decode_step": micro,
        "mmlora_subset": subset,
        "hf_peft": hf,
        "notes": [
            "base-only: the same engine and workload with no adapter on any request",
            "requests are random token ids; detokenization is off (engine.tokenizer = None)",
            "adapters beyond 16 per rank are hard links of 16 distinct weight files (own names, slots and reads)",
            "floor = (weights + KV read + distinct adapters' bytes) / measured copy bandwidth, per decode step",
        ],
    }
    if subset and hf and "output_tok_per_s" in hf:
        result["mmlora_over_hf_peft_same_subset"] = subset["output_tok_per_s"] / hf["output_tok_per_s"]
    if tmp is not None:
        tmp.cleanup()
    compiled = {_point(r, args): r["breakdown"]["triton_compiles"] for r in runs}
    result["triton_compiles_in_timed_runs"] = compiled
    result["wall_s"] = time.perf_counter() - t_start
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv, __doc__.split("\n\n")[0])
    if args.workload == "shared-prefix":
        from mmlora.bench import serving_prefix

        return serving_prefix.main(args)
    if args.workload == "two-tenants":
        return serving_tenants.main(args)
    result = run(args)
    out = Path(args.out)
    (out / "serving.json").write_text(json.dumps(result, indent=2, default=str))
    try:
        plot(result, out / "serving.png")
    except ImportError as e:  # the JSON is what matters; say clearly why there is no picture
        print(f"no plot: {e} (pip install matplotlib)")
    print(f"wrote {out / 'serving.json'} and {out / 'serving.png'} ({result['wall_s']:.0f} s)")
    compiled = result["triton_compiles_in_timed_runs"]
    if any(compiled.values()) and not args.allow_compiles:  # after the JSON: the figures stay
        raise RuntimeError(f"Triton compiled kernels inside timed runs (warm-up missed variants): {compiled}")
    return result

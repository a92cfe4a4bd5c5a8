"""``python -m mmlora.bench serving --workload shared-prefix``: the prefix cache, on against off, in one run.

For each number of adapters n: every adapter has its own long system prompt (``--shared-prefix`` SYSTEM
tokens of random ids), and ``--num-requests`` short user turns (USER tokens in, OUTPUT tokens out,
greedy, ignore_eos) go round-robin over the adapters. Then the standard no-sharing workload (random
prompts, ``--input-len`` / ``--output-len``) does the same, to show what the cache costs when nothing can
be shared (``--prefix-workloads`` picks which of the two run).

Each workload runs through one engine: first an untimed warm-up on its first quarter (cache on, then
off: the prefill shapes of both compile outside the clock), then ``--repeats`` timed on/off pairs, the
order alternating (on first, then off first, ...) so that neither side always has the engine state the
other left. The cache is emptied before every run, so a cache-on run starts cold. Reported per run:
output tokens/s, requests/s, TTFT p50/p99, TPOT p50, the prefill tokens computed (prompt tokens the
forwards actually ran, recomputation after preemption included) and the step-time breakdown
(mmlora.bench.breakdown: per step kind, per host phase, uploads, Triton compiles); per pair the on/off
ratios, and per workload the worse of the pairs against the issue's targets. Writes
``serving_prefix.json`` into ``--out``.

With every request arriving at once and ``--max-running-requests`` below ``--num-requests``, requests
run in waves of that many (every turn has the same output length, so a wave ends together): at 256
requests and 128 running, TTFT p50 is the midpoint between the last of wave one and the first of wave
two, for the cache on and off alike. The cap bounds the decode batch (and the CUDA graphs captured), which
the cache does not make cheaper, so it stays a setting applied to both sides rather than something the
scheduler lifts when prefixes hit; benchmarks/h200_prefix.sh runs both 128 and 256.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mmlora.bench.breakdown import StepBreakdown
from mmlora.bench.cli import target_mark
from mmlora.bench.serving_parts import (
    StepRecorder,
    copy_bandwidth,
    make_workload,
    result_header,
    run_workload,
    weight_bytes,
)


def shared_prefix_workload(args: argparse.Namespace, n: int, vocab: int) -> list[dict[str, Any]]:
    """Requests in arrival order: adapter i % n, its system prompt, then a fresh user turn."""
    system_len, user_len, output_len = args.shared_prefix
    rng = np.random.default_rng(args.seed)
    systems = [rng.integers(0, vocab, system_len).tolist() for _ in range(n)]
    if args.arrival == "poisson":
        arrivals = np.cumsum(rng.exponential(1.0 / args.rate, args.num_requests))
    else:
        arrivals = np.zeros(args.num_requests)
    return [
        {
            "arrival": float(arrivals[i]),
            "input_ids": systems[i % n] + rng.integers(0, vocab, user_len).tolist(),
            "output_len": output_len,
            "lora": i % n,
        }
        for i in range(args.num_requests)
    ]


# Issue 14's targets, per workload: ratio name -> (target, higher is better).
TARGETS: dict[str, dict[str, tuple[float, bool]]] = {
    "shared-prefix": {
        "prefill_tokens_on_over_off": (0.20, False),
        "throughput_on_over_off": (2.0, True),
        "ttft_p50_on_over_off": (0.5, False),
    },
    "no-sharing": {"throughput_on_over_off": (0.97, True)},
}


def _run(
    engine: Any,
    work: list[dict],
    cache_on: bool,
    recorder: StepRecorder,
    bw: float,
    breakdown: StepBreakdown | None = None,
) -> dict[str, Any]:
    """One workload with the cache on or off, starting from an empty cache."""
    cache = engine.scheduler.prefix_cache
    assert engine.flush_cache(), "the engine must be idle between runs"
    cache.enabled = cache_on
    before = engine.stats()
    if breakdown is not None:
        breakdown.reset()
    res = run_workload(engine, [dict(w) for w in work], recorder, bw)
    after = engine.stats()
    delta = {k: after[k] - before[k] for k in ("prefill_tokens_computed_total", "prefix_cache_hits_total")}
    queried = after["prefix_cache_queries_total"] - before["prefix_cache_queries_total"]
    prompt_tokens = sum(len(w["input_ids"]) for w in work)
    return {
        "prefix_cache": cache_on,
        **{k: res[k] for k in ("seconds", "req_per_s", "output_tok_per_s", "ttft_p50_s", "ttft_p99_s")},
        "tpot_p50_s": res["tpot_p50_s"],
        "prompt_tokens": prompt_tokens,
        "prefill_tokens_computed": delta["prefill_tokens_computed_total"],
        "cached_prompt_tokens": delta["prefix_cache_hits_total"],
        "hit_rate": delta["prefix_cache_hits_total"] / queried if queried else 0.0,
        "preemptions": after["num_preemptions_total"] - before["num_preemptions_total"],
        "breakdown": breakdown.summary() if breakdown is not None else None,
    }


def _compare(on: dict[str, Any], off: dict[str, Any]) -> dict[str, float]:
    return {
        "prefill_tokens_on_over_off": on["prefill_tokens_computed"] / off["prefill_tokens_computed"],
        "throughput_on_over_off": on["output_tok_per_s"] / off["output_tok_per_s"],
        "ttft_p50_on_over_off": on["ttft_p50_s"] / off["ttft_p50_s"],
    }


def _worse(pairs: list[dict[str, Any]]) -> dict[str, float]:
    """Each ratio at its worse pair: the largest of a lower-is-better ratio, the smallest of the others."""
    return {
        k: (min if k == "throughput_on_over_off" else max)(p["ratios"][k] for p in pairs)
        for k in pairs[0]["ratios"]
    }


def _print(workload: str, n: int, r: dict[str, Any]) -> None:
    compiles = (r["breakdown"] or {}).get("triton_compiles")
    print(
        f"{workload:13s} n={n:4d} cache {'on ' if r['prefix_cache'] else 'off'}: "
        f"{r['output_tok_per_s']:9.1f} out tok/s, TTFT p50 {r['ttft_p50_s'] * 1e3:8.1f} ms "
        f"p99 {r['ttft_p99_s'] * 1e3:8.1f} ms, prefill computed {r['prefill_tokens_computed']:8d} "
        f"of {r['prompt_tokens']} prompt tokens, hit rate {100 * r['hit_rate']:.0f}%"
        + (f", {compiles} Triton compiles inside the run" if compiles else ""),
        flush=True,
    )


def _pairs(
    name: str, n: int, work: list[dict], repeats: int, run: Callable[[list[dict], bool, bool], dict[str, Any]]
) -> list[dict[str, Any]]:
    """An untimed warm-up on the first quarter of the workload (on, then off), then ``repeats`` timed
    on/off pairs, on first in even pairs and off first in odd ones."""
    warm = [dict(w, output_len=min(w["output_len"], 16)) for w in work[: max(4, len(work) // 4)]]
    for cache_on in (True, False):
        run(warm, cache_on, False)
    pairs = []
    for i in range(repeats):
        order = (True, False) if i % 2 == 0 else (False, True)
        runs = {}
        for cache_on in order:
            runs[cache_on] = run(work, cache_on, True)
            _print(name, n, runs[cache_on])
        on, off = runs[True], runs[False]
        ratios = _compare(on, off)
        pairs.append(
            {"order": "on first" if order[0] else "off first", "on": on, "off": off, "ratios": ratios}
        )
        print(f"  on / off ({pairs[-1]['order']}): {json.dumps(ratios)}", flush=True)
    return pairs


def _report(name: str, worse: dict[str, float]) -> None:
    for k, (target, at_least) in TARGETS[name].items():
        sign = ">=" if at_least else "<="
        mark = target_mark(worse[k], target, at_least=at_least)
        print(f"  {name}: {k} (worse pair) {worse[k]:.3f}, target {sign} {target}: {mark}", flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from mmlora.bench.adapters import write_random_adapters
    from mmlora.bench.serving import _engine, _register, _warmup

    t_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    engine = _engine(args, args.max_loras_per_batch, max(args.ranks))
    engine.tokenizer = None  # random token ids: nothing to detokenize (see serving.run)
    device, dtype = engine.device, engine.model.lm_head.weight.dtype
    vocab = engine.model.arch.vocab_size
    bw = copy_bandwidth(device)
    tmp = tempfile.TemporaryDirectory() if args.adapter_dir is None else None
    adir = Path(args.adapter_dir or tmp.name)
    adapters = write_random_adapters(
        engine.hf_config, adir / "prefix", max(args.num_adapters), args.ranks, dtype=dtype, seed=args.seed
    )
    recorder = StepRecorder(engine, weight_bytes(engine.model), dtype)
    _warmup(engine, args, adapters, recorder, bw, np.random.default_rng(args.seed))
    print(f"engine up and warm on {device} ({dtype}) in {time.perf_counter() - t_start:.1f} s", flush=True)
    breakdown = StepBreakdown(engine).install()

    def one(work: list[dict], cache_on: bool, timed: bool) -> dict[str, Any]:
        return _run(engine, work, cache_on, recorder, bw, breakdown if timed else None)

    rows = []
    for n in args.num_adapters:
        _register(engine, adapters, {a["name"] for a in adapters[:n]})
        for name in args.prefix_workloads:
            if name == "shared-prefix":
                work = shared_prefix_workload(args, n, vocab)
            else:
                work = make_workload(args, n, vocab, np.random.default_rng(args.seed))
            for w in work:
                w["lora"] = adapters[w["lora"]]["name"]
            pairs = _pairs(name, n, work, args.repeats, one)
            worse = _worse(pairs)
            _report(name, worse)
            rows.append({"workload": name, "num_adapters": n, "pairs": pairs, "worse": worse})
    breakdown.uninstall()
    if tmp is not None:
        tmp.cleanup()
    return {
        **result_header("serving --workload shared-prefix", args, device, dtype, engine.lora_backend),
        "block_size": engine.kv_cache.allocator.block_size,
        "kv_tokens": engine.kv_cache.allocator.num_blocks * engine.kv_cache.allocator.block_size,
        "max_running_requests": engine.scheduler.config.max_running_requests,
        "results": rows,
        "targets": {k: {r: list(t) for r, t in v.items()} for k, v in TARGETS.items()},
        "notes": [
            "one engine; the prefix cache is emptied before each run and switched on or off",
            "per workload: an untimed warm-up (its first quarter, on then off), then on/off pairs in "
            "alternating order; 'worse' holds each ratio at its worse pair",
            "shared-prefix: adapter i % n per request, each adapter with its own system prompt",
            "no-sharing: the standard workload (random prompts), where the cache can only cost",
            "prefill_tokens_computed counts every token a forward ran that was not a decode step",
        ],
        "wall_s": time.perf_counter() - t_start,
    }


def write_result(result: dict[str, Any], path: Path) -> dict[str, Any]:
    """Write a workload's result JSON (also used by the two-tenants workload)."""
    path.write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {path} ({result['wall_s']:.0f} s)")
    return result


def main(args: argparse.Namespace) -> dict[str, Any]:
    return write_result(run(args), Path(args.out) / "serving_prefix.json")

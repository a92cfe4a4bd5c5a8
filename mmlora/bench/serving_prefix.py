"""``python -m mmlora.bench serving --workload shared-prefix``: the prefix cache, on against off, in one run.

For each number of adapters n: every adapter has its own long system prompt (``--shared-prefix`` SYSTEM
tokens of random ids), and ``--num-requests`` short user turns (USER tokens in, OUTPUT tokens out,
greedy, ignore_eos) go round-robin over the adapters. The workload runs through one engine with the
prefix cache on, then off (emptied before each run, so the cache-on run starts cold); then the standard
no-sharing workload (random prompts, ``--input-len`` / ``--output-len``) does the same, to show what the
cache costs when nothing can be shared. Reported per run: output tokens/s, requests/s, TTFT p50/p99,
TPOT p50 and the prefill tokens computed (prompt tokens the forwards actually ran, recomputation after
preemption included). Writes ``serving_prefix.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

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


def _run(engine: Any, work: list[dict], cache_on: bool, recorder: StepRecorder, bw: float) -> dict[str, Any]:
    """One workload with the cache on or off, starting from an empty cache."""
    cache = engine.scheduler.prefix_cache
    assert engine.flush_cache(), "the engine must be idle between runs"
    cache.enabled = cache_on
    before = engine.stats()
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
    }


def _compare(on: dict[str, Any], off: dict[str, Any]) -> dict[str, float]:
    return {
        "prefill_tokens_on_over_off": on["prefill_tokens_computed"] / off["prefill_tokens_computed"],
        "throughput_on_over_off": on["output_tok_per_s"] / off["output_tok_per_s"],
        "ttft_p50_on_over_off": on["ttft_p50_s"] / off["ttft_p50_s"],
    }


def _print(workload: str, n: int, r: dict[str, Any]) -> None:
    print(
        f"{workload:13s} n={n:4d} cache {'on ' if r['prefix_cache'] else 'off'}: "
        f"{r['output_tok_per_s']:9.1f} out tok/s, TTFT p50 {r['ttft_p50_s'] * 1e3:8.1f} ms "
        f"p99 {r['ttft_p99_s'] * 1e3:8.1f} ms, prefill computed {r['prefill_tokens_computed']:8d} "
        f"of {r['prompt_tokens']} prompt tokens, hit rate {100 * r['hit_rate']:.0f}%",
        flush=True,
    )


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
    rows = []
    for n in args.num_adapters:
        _register(engine, adapters, {a["name"] for a in adapters[:n]})
        workloads = {
            "shared-prefix": shared_prefix_workload(args, n, vocab),
            "no-sharing": make_workload(args, n, vocab, np.random.default_rng(args.seed)),
        }
        for name, work in workloads.items():
            for w in work:
                w["lora"] = adapters[w["lora"]]["name"]
            on = _run(engine, work, True, recorder, bw)
            _print(name, n, on)
            off = _run(engine, work, False, recorder, bw)
            _print(name, n, off)
            rows.append({"workload": name, "num_adapters": n, "on": on, "off": off, **_compare(on, off)})
            print(f"  on / off: {json.dumps(_compare(on, off))}", flush=True)
    if tmp is not None:
        tmp.cleanup()
    return {
        **result_header("serving --workload shared-prefix", args, device, dtype, engine.lora_backend),
        "block_size": engine.kv_cache.allocator.block_size,
        "kv_tokens": engine.kv_cache.allocator.num_blocks * engine.kv_cache.allocator.block_size,
        "results": rows,
        "notes": [
            "one engine; the prefix cache is emptied before each run and switched on or off",
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

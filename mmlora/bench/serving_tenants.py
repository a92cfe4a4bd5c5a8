"""``python -m mmlora.bench serving --workload two-tenants``: fair scheduling, fcfs against vtc, in one run.

Eight adapters, one per tenant: a heavy one sends 10x the requests of each of the 7 light ones (Poisson
arrivals at ``--rate`` in all, so the heavy tenant alone can fill the queue). The same workload runs on an
engine with ``schedule_policy="fcfs"``, then on one with ``"vtc"``, and the pair runs twice (fcfs, vtc, fcfs,
vtc), so that a drift of the machine shows. Reported per policy and round: total output
tokens/s and TTFT p50/p99 of each class; then light-class TTFT p99 under vtc over fcfs (target <= 0.3) and
the throughput ratio (target within 5%), each the worse of the two rounds. Writes ``serving_tenants.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from mmlora.bench.cli import target_mark
from mmlora.bench.serving_parts import result_header

HEAVY_SHARE = 10.0
LIGHT_TENANTS = 7
TARGETS = {"light_ttft_p99_vtc_over_fcfs": 0.3, "throughput_vtc_over_fcfs": 0.95}


def two_tenant_workload(args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    """Requests in arrival order; ``tenant`` 0 is the heavy one."""
    rng = np.random.default_rng(args.seed)
    p = np.array([HEAVY_SHARE] + [1.0] * LIGHT_TENANTS)
    tenants = rng.choice(len(p), args.num_requests, p=p / p.sum())
    arrivals = np.cumsum(rng.exponential(1.0 / args.rate, args.num_requests))
    return [
        {
            "arrival": float(arrivals[i]),
            "tenant": int(tenants[i]),
            "input_ids": rng.integers(0, vocab, int(rng.integers(*args.input_len))).tolist(),
            "output_len": int(rng.integers(*args.output_len)),
        }
        for i in range(args.num_requests)
    ]


def _drive(engine: Any, work: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """Run the workload with its arrivals; per-class TTFT and total output tokens/s."""
    ttft: dict[str, list[float]] = {"heavy": [], "light": []}
    tokens, idx, t0 = 0, 0, time.monotonic()
    classes: dict[str, str] = {}
    while idx < len(work) or engine.has_unfinished():
        now = time.monotonic() - t0
        while idx < len(work) and work[idx]["arrival"] <= now:
            w = work[idx]
            rid = f"t{idx}"
            classes[rid] = "heavy" if w["tenant"] == 0 else "light"
            sp = {"max_new_tokens": w["output_len"], "temperature": 0.0, "ignore_eos": True}
            engine.add_request(
                input_ids=w["input_ids"], lora=names[w["tenant"]], sampling_params=sp, request_id=rid
            )
            idx += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, work[idx]["arrival"] - now))
            continue
        for out in engine.step():
            if out.finish_reason is not None:
                if out.error or out.finish_reason != "length":
                    raise RuntimeError(f"request {out.request_id} failed: {out.error or out.finish_reason}")
                ttft[classes[out.request_id]].append(out.first_token_time - out.arrival_time)
                tokens += len(out.output_ids)
    seconds = time.monotonic() - t0
    return {
        "seconds": seconds,
        "output_tok_per_s": tokens / seconds,
        **{f"{c}_ttft_p{q}_s": float(np.percentile(v, q)) for c, v in ttft.items() for q in (50, 99)},
        "requests": {c: len(v) for c, v in ttft.items()},
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from mmlora.bench.adapters import write_random_adapters
    from mmlora.bench.serving import _engine

    t0 = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {"fcfs": [], "vtc": []}
    with tempfile.TemporaryDirectory() as adir:
        for policy in ("fcfs", "vtc", "fcfs", "vtc"):
            args.schedule_policy = policy
            engine = _engine(args, max(args.max_loras_per_batch, 1 + LIGHT_TENANTS), max(args.ranks))
            engine.tokenizer = None  # random token ids: nothing to detokenize
            dtype = engine.model.lm_head.weight.dtype
            adapters = write_random_adapters(
                engine.hf_config, adir, 1 + LIGHT_TENANTS, args.ranks, dtype=dtype, seed=args.seed
            )
            for a in adapters:
                engine.load_lora(a["name"], a["path"])
            work = two_tenant_workload(args, engine.model.arch.vocab_size)
            _drive(engine, work[: max(4, len(work) // 16)], [a["name"] for a in adapters])  # warm-up
            r = _drive(engine, work, [a["name"] for a in adapters])
            results[policy].append(r)
            print(
                f"{policy}: {r['output_tok_per_s']:8.1f} out tok/s; TTFT heavy p50 {r['heavy_ttft_p50_s'] * 1e3:7.0f} "
                f"p99 {r['heavy_ttft_p99_s'] * 1e3:7.0f} ms; light p50 {r['light_ttft_p50_s'] * 1e3:7.0f} "
                f"p99 {r['light_ttft_p99_s'] * 1e3:7.0f} ms",
                flush=True,
            )
            header = result_header(
                "serving --workload two-tenants", args, engine.device, dtype, engine.lora_backend
            )
            del engine
            gc.collect()
    pairs = list(zip(results["fcfs"], results["vtc"]))
    ratios = {
        "light_ttft_p99_vtc_over_fcfs": max(v["light_ttft_p99_s"] / f["light_ttft_p99_s"] for f, v in pairs),
        "throughput_vtc_over_fcfs": min(v["output_tok_per_s"] / f["output_tok_per_s"] for f, v in pairs),
    }
    light, speed = ratios["light_ttft_p99_vtc_over_fcfs"], ratios["throughput_vtc_over_fcfs"]
    print(
        f"light-class TTFT p99, vtc / fcfs: {light:.2f} (target <= 0.3: {target_mark(light, 0.3, at_least=False)})"
    )
    print(f"throughput, vtc / fcfs (worse round): {speed:.3f} (target >= 0.95: {target_mark(speed, 0.95)})")
    return {
        **header,
        "policies": results,
        "ratios": ratios,
        "targets": TARGETS,
        "wall_s": time.monotonic() - t0,
    }


def main(args: argparse.Namespace) -> dict[str, Any]:
    from mmlora.bench.serving_prefix import write_result

    return write_result(run(args), Path(args.out) / "serving_tenants.json")

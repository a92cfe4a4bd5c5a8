"""``python -m mmlora.bench serving --workload two-tenants``: fair scheduling, fcfs against vtc, in one run.

Offered load is set against what the engine can do, so the heavy tenant really overloads it on any
machine: first the capacity C (output tokens/s with the batch kept full: twice ``--max-running-requests``
requests at once, counted while some still wait), then eight tenants, one adapter each, as independent
Poisson streams for ``--duration`` seconds: the heavy one at ``--heavy-load`` x C, each of the 7 light ones
at C/10 (tokens/s become requests/s through the mean output length). Light tenants ask 0.7 C in all,
less than their fair share, so under vtc they should be served as if alone, while fcfs queues them
behind the heavy tenant's backlog.

A run stops taking arrivals at ``--duration`` and keeps stepping until every light request has finished
(at most another ``--duration``; one still unserved then, or refused by a full queue, counts its time
so far, a lower bound, and is reported as unserved); the heavy backlog left is aborted. Throughput is output tokens generated inside
the arrival window over its length (both policies are saturated there). ``--rounds`` pairs run, each
fcfs then vtc on a fresh engine, so a drift of the machine shows. Reported per run: light-class TTFT
and latency p50/p99, heavy TTFT, output tokens/s, adapter loads into slots (``slot_loads``: churn, which
shows when ``--max-loras-per-batch`` is below 8); per round the vtc/fcfs ratios, and the worse round.
Writes ``serving_tenants.json`` into ``--out``.
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

LIGHT_TENANTS = 7
LIGHT_LOAD = 0.1  # each light tenant's offered load, as a fraction of capacity
TARGETS = {"light_ttft_p99_vtc_over_fcfs": 0.3, "throughput_vtc_over_fcfs": 0.95}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--heavy-load", type=float, default=1.1, help="two-tenants: heavy tenant's load, x measured capacity"
    )
    p.add_argument("--duration", type=float, default=30.0, help="two-tenants: seconds of arrivals per run")
    p.add_argument("--rounds", type=int, default=2, help="two-tenants: fcfs/vtc pairs, each on fresh engines")


def tenant_rates(capacity_tok_s: float, heavy_load: float, output_len: tuple[int, int]) -> list[float]:
    """Requests/s per tenant (0 is the heavy one) for loads given in output tokens/s."""
    lo, hi = output_len
    mean_out = (lo + hi - 1) / 2  # output lengths are uniform integers in [lo, hi)
    return [heavy_load * capacity_tok_s / mean_out] + [LIGHT_LOAD * capacity_tok_s / mean_out] * LIGHT_TENANTS


def _request(rng: np.random.Generator, arrival: float, tenant: int, args: Any, vocab: int) -> dict[str, Any]:
    return {
        "arrival": float(arrival),
        "tenant": tenant,
        "input_ids": rng.integers(0, vocab, int(rng.integers(*args.input_len))).tolist(),
        "output_len": int(rng.integers(*args.output_len)),
    }


def two_tenant_workload(
    rates: list[float], duration: float, args: Any, vocab: int, seed: int
) -> list[dict[str, Any]]:
    """Requests in arrival order, each tenant a Poisson stream at ``rates[tenant]`` over [0, duration).

    Each tenant draws from its own seeded stream, so one tenant's rate does not move another's requests.
    ``args`` gives ``input_len`` and ``output_len`` ([lo, hi) each)."""
    work = []
    for tenant, (rate, child) in enumerate(zip(rates, np.random.SeedSequence(seed).spawn(len(rates)))):
        rng = np.random.default_rng(child)
        # A Poisson count, then uniform times: the same process as exponential gaps, bounded by duration.
        arrivals = np.sort(rng.uniform(0.0, duration, rng.poisson(rate * duration)))
        work += [_request(rng, a, tenant, args, vocab) for a in arrivals]
    work.sort(key=lambda w: (w["arrival"], w["tenant"]))
    return work


def saturating_workload(count: int, args: Any, vocab: int, seed: int) -> list[dict[str, Any]]:
    """``count`` requests all at time 0, tenants in turn: the capacity measurement's load."""
    rng = np.random.default_rng(seed)
    return [_request(rng, 0.0, i % (1 + LIGHT_TENANTS), args, vocab) for i in range(count)]


def _submit(engine: Any, work: list[dict[str, Any]], i: int, names: list[str]) -> None:
    w = work[i]
    sp = {"max_new_tokens": w["output_len"], "temperature": 0.0, "ignore_eos": True}
    engine.add_request(
        input_ids=w["input_ids"], lora=names[w["tenant"]], sampling_params=sp, request_id=f"t{i}"
    )


def _abort_all(engine: Any, rids: set[str]) -> None:
    for rid in rids:
        engine.abort(rid)
    while engine.has_unfinished():  # aborts take effect at the next step
        engine.step()


def measure_capacity(engine: Any, work: list[dict[str, Any]], names: list[str]) -> dict[str, float]:
    """Output tokens/s while requests still wait (the batch stays full); all of ``work`` at once."""
    for i in range(len(work)):
        _submit(engine, work, i, names)
    gen0, t0 = engine.counters["generation_tokens_total"], time.monotonic()
    live = {f"t{i}" for i in range(len(work))}
    while engine.stats()["num_waiting"] > 0:
        live -= {o.request_id for o in engine.step() if o.finish_reason is not None}
    seconds, tokens = time.monotonic() - t0, engine.counters["generation_tokens_total"] - gen0
    _abort_all(engine, live)
    return {"output_tok_per_s": tokens / seconds, "seconds": seconds, "tokens": tokens, "requests": len(work)}


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def drive(engine: Any, work: list[dict[str, Any]], names: list[str], duration: float) -> dict[str, Any]:
    """Run the workload with its arrivals (see the module docstring for when it stops); per-class times."""
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    light_left = sum(1 for w in work if w["tenant"] != 0)
    gen0, loads0 = engine.counters["generation_tokens_total"], engine.lora.slot_loads
    window: tuple[int, float] | None = None  # (tokens, seconds) of the arrival window
    idx, refused, t0 = 0, 0, time.monotonic()
    while True:
        now = time.monotonic() - t0
        if window is None and now >= duration:
            window = (engine.counters["generation_tokens_total"] - gen0, now)
        if idx == len(work) and (light_left == 0 or now >= 2 * duration):
            break
        while idx < len(work) and work[idx]["arrival"] <= now:
            try:
                _submit(engine, work, idx, names)
            except OverflowError:  # the engine's queue is full: a refusal, as a server's 429
                refused += 1
                light_left -= int(work[idx]["tenant"] != 0)
            idx += 1
        if not engine.has_unfinished():
            nxt = work[idx]["arrival"] if idx < len(work) else 2 * duration
            time.sleep(max(0.0, min(nxt, duration if window is None else nxt) - now))
            continue
        for out in engine.step():
            i = int(out.request_id[1:])
            if out.first_token_time is not None:
                first.setdefault(i, out.first_token_time - t0)
            if out.finish_reason is not None:
                if out.error or out.finish_reason != "length":
                    raise RuntimeError(f"request {out.request_id} failed: {out.error or out.finish_reason}")
                done[i] = out.finish_time - t0
                light_left -= int(work[i]["tenant"] != 0)
    end = time.monotonic() - t0
    if window is None:
        window = (engine.counters["generation_tokens_total"] - gen0, end)
    _abort_all(engine, {f"t{i}" for i in range(idx) if i not in done})
    light = [i for i in range(idx) if work[i]["tenant"] != 0]
    heavy = [i for i in range(idx) if work[i]["tenant"] == 0]

    def since_arrival(times: dict[int, float], ids: list[int]) -> list[float]:
        return [times.get(i, end) - work[i]["arrival"] for i in ids]  # unserved: a lower bound

    light_ttft, light_lat = since_arrival(first, light), since_arrival(done, light)
    heavy_ttft = [first[i] - work[i]["arrival"] for i in heavy if i in first]
    return {
        "seconds": end,
        "output_tok_per_s": window[0] / window[1],
        "light_ttft_p50_s": _pct(light_ttft, 50),
        "light_ttft_p99_s": _pct(light_ttft, 99),
        "light_latency_p50_s": _pct(light_lat, 50),
        "light_latency_p99_s": _pct(light_lat, 99),
        "heavy_ttft_p50_s": _pct(heavy_ttft, 50),
        "requests": {"light": len(light), "heavy": len(heavy), "refused": refused},
        "light_unserved": sum(1 for i in light if i not in done),
        "heavy_served": len(heavy_ttft),  # heavy_ttft_p50_s is over these
        "slot_loads": engine.lora.slot_loads - loads0,
    }


def compare_rounds(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """vtc over fcfs per round; ``worse_round`` is the one where vtc's light TTFT p99 ratio is highest,
    and ``ratios`` the worst value of each ratio over the rounds."""
    per_round = [
        {
            "light_ttft_p99_vtc_over_fcfs": v["light_ttft_p99_s"] / f["light_ttft_p99_s"],
            "light_latency_p99_vtc_over_fcfs": v["light_latency_p99_s"] / f["light_latency_p99_s"],
            "throughput_vtc_over_fcfs": v["output_tok_per_s"] / f["output_tok_per_s"],
        }
        for f, v in zip(results["fcfs"], results["vtc"])
    ]
    worse = max(range(len(per_round)), key=lambda r: per_round[r]["light_ttft_p99_vtc_over_fcfs"])
    ratios = {k: max(r[k] for r in per_round) for k in per_round[0] if k != "throughput_vtc_over_fcfs"}
    ratios["throughput_vtc_over_fcfs"] = min(r["throughput_vtc_over_fcfs"] for r in per_round)
    return {"per_round": per_round, "worse_round": worse, "ratios": ratios}


def _build(args: argparse.Namespace, policy: str, adir: str, adapters: list[dict[str, Any]]) -> Any:
    """A fresh engine under ``policy`` with the eight tenants' adapters registered (written on first use)."""
    from mmlora.bench.adapters import write_random_adapters
    from mmlora.bench.serving import _engine

    args.schedule_policy = policy
    engine = _engine(args, args.max_loras_per_batch, max(args.ranks))
    engine.tokenizer = None  # random token ids: nothing to detokenize
    if not adapters:
        dtype = engine.model.lm_head.weight.dtype
        adapters += write_random_adapters(
            engine.hf_config, adir, 1 + LIGHT_TENANTS, args.ranks, dtype=dtype, seed=args.seed
        )
    for a in adapters:
        engine.load_lora(a["name"], a["path"])
    return engine


def _warm_up(engine: Any, args: argparse.Namespace, names: list[str]) -> None:
    """Two requests per tenant at once, run to the end outside any clock: every adapter through a slot,
    prefill, mixed and decode steps at several batch sizes."""
    work = saturating_workload(2 * (1 + LIGHT_TENANTS), args, engine.model.arch.vocab_size, args.seed + 1)
    for i in range(len(work)):
        _submit(engine, work, i, names)
    while engine.has_unfinished():
        engine.step()


def _line(policy: str, r: dict[str, Any]) -> str:
    ms = {k: r[k] * 1e3 for k in r if k.endswith("_s") and k != "seconds"}
    return (
        f"{policy}: {r['output_tok_per_s']:8.1f} out tok/s; light TTFT p50 {ms['light_ttft_p50_s']:6.0f} p99 "
        f"{ms['light_ttft_p99_s']:6.0f} ms, latency p99 {ms['light_latency_p99_s']:6.0f} ms "
        f"({r['light_unserved']} unserved); heavy TTFT p50 {ms['heavy_ttft_p50_s']:6.0f} ms; "
        f"slot loads {r['slot_loads']}"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.monotonic()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {"fcfs": [], "vtc": []}
    adapters: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as adir:
        engine = _build(args, "fcfs", adir, adapters)
        names, vocab = [a["name"] for a in adapters], engine.model.arch.vocab_size
        header = result_header(
            "serving --workload two-tenants", args, engine.device, engine.model.lm_head.weight.dtype,
            engine.lora_backend,
        )  # fmt: skip
        _warm_up(engine, args, names)
        capacity = measure_capacity(
            engine, saturating_workload(2 * args.max_running_requests, args, vocab, args.seed), names
        )
        rates = tenant_rates(capacity["output_tok_per_s"], args.heavy_load, args.output_len)
        print(f"capacity: {capacity['output_tok_per_s']:.1f} out tok/s; requests/s heavy {rates[0]:.2f}, "
              f"each light {rates[1]:.2f}", flush=True)  # fmt: skip
        work = two_tenant_workload(rates, args.duration, args, vocab, args.seed)
        for rnd in range(args.rounds):
            for policy in ("fcfs", "vtc"):
                if engine is None:
                    engine = _build(args, policy, adir, adapters)
                _warm_up(engine, args, names)
                r = drive(engine, work, names, args.duration)
                results[policy].append(r)
                print(f"round {rnd} {_line(policy, r)}", flush=True)
                engine = None  # freed before the next one is built: one engine's memory at a time
                gc.collect()
    summary = compare_rounds(results)
    for i, ratio in enumerate(summary["per_round"]):
        print(
            f"round {i}: vtc / fcfs " + ", ".join(f"{k.split('_vtc')[0]} {v:.3f}" for k, v in ratio.items())
        )
    worse, worst = summary["per_round"][summary["worse_round"]], summary["ratios"]
    light, speed = worse["light_ttft_p99_vtc_over_fcfs"], worst["throughput_vtc_over_fcfs"]
    print(f"worse round ({summary['worse_round']}): light TTFT p99 vtc / fcfs {light:.3f} (target <= 0.3: "
          f"{target_mark(light, 0.3, at_least=False)}), light latency p99 "
          f"{worse['light_latency_p99_vtc_over_fcfs']:.3f}, throughput {worse['throughput_vtc_over_fcfs']:.3f}; "
          f"throughput, worst round: {speed:.3f} (target >= 0.95: {target_mark(speed, 0.95)})")  # fmt: skip
    return {
        **header,
        "capacity": capacity,
        "rates_req_per_s": {"heavy": rates[0], "each_light": rates[1]},
        "policies": results,
        **summary,
        "targets": TARGETS,
        "wall_s": time.monotonic() - t0,
    }


def main(args: argparse.Namespace) -> dict[str, Any]:
    from mmlora.bench.serving_prefix import write_result

    return write_result(run(args), Path(args.out) / "serving_tenants.json")

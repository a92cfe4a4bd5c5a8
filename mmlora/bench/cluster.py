"""``python -m mmlora.bench cluster``: Ray Serve replicas, routing by adapter against Ray's default router.

N replicas of one model (each with a host cache of ``--host-cache`` adapters, which is also Ray's
multiplexed-model cache), ``--num-adapters`` random adapters under one root, Zipf popularity, Poisson
arrivals. Each routing mode runs the same workload on a fresh Ray Serve application, through the HTTP
ingress, with streaming clients (TTFT is the first streamed token). Reported per mode: adapter loads
(disk reads into a replica), output tokens/s, TTFT p50/p99; then the ratios. CPU here; GPUs where lent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from mmlora.bench.cli import make_parser, progress, quiet_third_party, target_mark

TARGETS = {"fewer_loads": 5.0, "throughput": 1.3}


def build_parser() -> argparse.ArgumentParser:
    p = make_parser("python -m mmlora.bench cluster", __doc__.split("\n\n")[0])
    p.add_argument("--model", default="dummy:smollm2-135m", help="Model of every replica.")
    p.add_argument("--num-replicas", type=int, default=4)
    p.add_argument("--num-adapters", type=int, default=64)
    p.add_argument("--rank", type=int, default=8, help="Rank of every adapter (all seven projections).")
    p.add_argument("--host-cache", type=int, default=8, help="Adapters held per replica (max_loaded_loras).")
    p.add_argument("--max-loras-per-batch", type=int, default=4)
    p.add_argument("--num-requests", type=int, default=192)
    p.add_argument("--rate", type=float, default=8.0, help="Poisson arrival rate, requests/s.")
    p.add_argument("--zipf-alpha", type=float, default=1.0)
    p.add_argument("--input-len", type=int, nargs=2, default=[16, 64], metavar=("LO", "HI"))
    p.add_argument("--output-len", type=int, nargs=2, default=[8, 32], metavar=("LO", "HI"))
    p.add_argument("--routing", nargs="+", default=["adapter", "default"], choices=["adapter", "default"])
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="Write the results here as JSON.")
    return p


def make_requests(args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(args.seed)
    p = 1.0 / np.arange(1, args.num_adapters + 1) ** args.zipf_alpha
    adapters = rng.choice(args.num_adapters, args.num_requests, p=p / p.sum())
    arrivals = np.cumsum(rng.exponential(1.0 / args.rate, args.num_requests))
    return [
        {
            "arrival": float(arrivals[i]),
            "lora": f"lora-{int(adapters[i]):04d}",
            "input_ids": rng.integers(0, vocab, int(rng.integers(*args.input_len))).tolist(),
            "output_len": int(rng.integers(*args.output_len)),
        }
        for i in range(args.num_requests)
    ]


async def _one(client: Any, url: str, req: dict[str, Any], t0: float) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, req["arrival"] - (time.monotonic() - t0)))
    body = {
        "input_ids": req["input_ids"],
        "lora_path": req["lora"],
        "stream": True,
        "sampling_params": {"max_new_tokens": req["output_len"], "temperature": 0.0, "ignore_eos": True},
    }
    start = time.monotonic()
    first = None
    tokens = 0
    async with client.stream("POST", url + "/generate", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(str(data["error"]))
            n = data["meta_info"]["completion_tokens"]
            if n and first is None:
                first = time.monotonic()
            tokens = n
    end = time.monotonic()
    return {"ttft": (first or end) - start, "e2e": end - start, "tokens": tokens}


async def drive(url: str, work: list[dict[str, Any]]) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(max_connections=len(work))
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.monotonic()
        results = await asyncio.gather(*(_one(client, url, w, t0) for w in work))
        seconds = time.monotonic() - t0
    ttft = [r["ttft"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {
        "seconds": seconds,
        "output_tokens": tokens,
        "output_tok_per_s": tokens / seconds,
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
    }


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica_stats(num_replicas: int) -> list[dict[str, Any]]:
    """Each replica's stats, asked through the deployment handle until every replica has answered."""
    from ray import serve

    handle = serve.get_deployment_handle("mmlora-replica", app_name="mmlora")
    seen: dict[str, dict[str, Any]] = {}
    for _ in range(50 * num_replicas):
        stats = handle.stats.remote().result()
        seen[stats["replica"]] = stats
        if len(seen) == num_replicas:
            break
    return list(seen.values())


def run_mode(
    args: argparse.Namespace, routing: str, lora_root: str, work: list[dict[str, Any]]
) -> dict[str, Any]:
    import requests
    from ray import serve

    from mmlora.config import EngineConfig
    from mmlora.serve.app import ClusterConfig, build_application
    from mmlora.server.config import ServerConfig

    engine = EngineConfig.from_kwargs(
        model=args.model,
        device=args.device,
        max_loaded_loras=args.host_cache,
        max_loras_per_batch=args.max_loras_per_batch,
        max_lora_rank=args.rank,
        max_kv_tokens=16384,
    )
    cluster = ClusterConfig(num_replicas=args.num_replicas, routing=routing, replica_num_cpus=0.0)
    serve.run(
        build_application(engine, ServerConfig(lora_root=lora_root), cluster), name="mmlora", route_prefix="/"
    )
    url = f"http://127.0.0.1:{args.port}"
    deadline = time.time() + 300
    while requests.get(url + "/v1/models", timeout=60).status_code != 200:
        if time.time() > deadline:
            raise RuntimeError("the Ray Serve application did not come up")
        time.sleep(1.0)
    result = asyncio.run(drive(url, work))
    stats = replica_stats(args.num_replicas)
    result["adapter_loads"] = sum(s["adapter_loads"] for s in stats)
    result["adapter_loads_per_replica"] = sorted(s["adapter_loads"] for s in stats)
    serve.delete("mmlora")
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    quiet_third_party()
    import ray
    from ray import serve

    from mmlora.bench.adapters import _config_of, write_random_adapters

    vocab = _config_of(args.model).vocab_size
    work = make_requests(args, vocab)
    results: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "out"}, "modes": {}}
    with tempfile.TemporaryDirectory() as root:
        write_random_adapters(
            args.model, root, args.num_adapters, [args.rank], dtype="float32", distinct=args.num_adapters
        )
        ray.init(include_dashboard=False, log_to_driver=False)
        args.port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        try:
            for routing in progress(args.routing, "routing modes"):
                results["modes"][routing] = r = run_mode(args, routing, root, work)
                print(
                    f"{routing:>8}: {r['adapter_loads']:5d} adapter loads, {r['output_tok_per_s']:8.1f} out tok/s, "
                    f"TTFT p50 {r['ttft_p50_s'] * 1e3:7.0f} ms, p99 {r['ttft_p99_s'] * 1e3:7.0f} ms"
                )
        finally:
            serve.shutdown()
            ray.shutdown()
    modes = results["modes"]
    if {"adapter", "default"} <= set(modes):
        a, d = modes["adapter"], modes["default"]
        fewer = d["adapter_loads"] / max(1, a["adapter_loads"])
        speed = a["output_tok_per_s"] / d["output_tok_per_s"]
        results["ratios"] = {
            "fewer_loads": fewer,
            "throughput": speed,
            "ttft_p99": a["ttft_p99_s"] / d["ttft_p99_s"],
        }
        for name, value, unit in (
            ("fewer_loads", fewer, "x fewer adapter loads"),
            ("throughput", speed, "x throughput"),
        ):
            mark = target_mark(value, TARGETS[name])
            print(f"routing by adapter: {value:.2f}{unit} (target >= {TARGETS[name]}: {mark})")
        print(f"routing by adapter: TTFT p99 {results['ratios']['ttft_p99']:.2f}x of Ray's default router's")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()

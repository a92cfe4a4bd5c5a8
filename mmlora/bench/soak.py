"""``python -m mmlora.bench soak``: streaming clients and an adapter load/unload loop against a live server.

For minutes to hours: ``--clients`` threads each stream ``/generate`` requests (a random adapter, the
one being loaded and unloaded included, or the base model) while another thread loads and unloads an
adapter in a loop. Every ``--sample-every`` seconds it prints the process RSS; at the end it checks the
invariants of a healthy server:

* no request lost: every request got a final answer (a completion, or a clean 404/429 refusal);
* no 500 and no other error;
* back to idle: nothing running or waiting, no KV page in use, every adapter refcount 0;
* RSS growth after the warm-up round, against ``--max-rss-growth-mb``.

The server runs in this process (uvicorn on a thread) so that its RSS is the one measured.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from mmlora.bench.cli import check_engine_options, make_parser, quiet_third_party, target_mark

CHURN = "soak-churn"


def rss_mb() -> float:
    """This process's resident set size in MiB (Linux /proc)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


@dataclass
class SoakReport:
    outcomes: Counter = field(default_factory=Counter)  # ok / refused_404 / refused_429 / lost / status_N
    admin: Counter = field(default_factory=Counter)
    rss: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, MiB)
    errors: list[str] = field(default_factory=list)
    idle: dict[str, Any] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, kind: str, *, admin: bool = False) -> None:
        with self._lock:
            (self.admin if admin else self.outcomes)[kind] += 1

    @property
    def requests(self) -> int:
        return sum(self.outcomes.values())

    @property
    def rss_growth_mb(self) -> float:
        """RSS at the end minus RSS after the warm-up round."""
        return self.rss[-1][1] - self.rss[0][1] if self.rss else 0.0

    def problems(self, max_rss_growth_mb: float) -> list[str]:
        out = [f"{n} request(s) {kind}" for kind, n in self.outcomes.items() if kind not in _CLEAN]
        out += self.errors[:5]
        out += [f"not idle: {k}={v}" for k, v in self.idle.items() if v]
        if self.rss_growth_mb > max_rss_growth_mb:
            out.append(f"RSS grew {self.rss_growth_mb:.1f} MiB, more than {max_rss_growth_mb} MiB")
        return out


_CLEAN = ("ok", "refused_404", "refused_429")


def _stream_one(session: Any, url: str, lora: str | None, rng: random.Random, report: SoakReport) -> None:
    body = {
        "text": rng.choice(["Hello", "The capital of France is", "Once upon a time", "1, 2, 3,"]),
        "sampling_params": {"max_new_tokens": rng.randint(2, 12), "ignore_eos": True, "temperature": 0},
        "lora_path": lora,
        "stream": True,
    }
    try:
        with session.post(url + "/generate", json=body, stream=True, timeout=120) as r:
            if r.status_code != 200:
                kind = {404: "refused_404", 429: "refused_429"}.get(r.status_code, f"status_{r.status_code}")
                if kind.startswith("status"):
                    report.errors.append(f"{r.status_code}: {r.text[:200]}")
                report.count(kind)
                return
            final = None
            for line in r.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    report.errors.append(f"stream error: {event['error']}")
                    report.count("stream_error")
                    return
                if event["meta_info"]["finish_reason"] is not None:
                    final = event
            if final is not None and final["meta_info"]["finish_reason"]["type"] == "length":
                report.count("ok")
            else:
                report.count("lost")
    except Exception as e:  # noqa: BLE001 - a client that got no answer is a lost request
        report.errors.append(f"{type(e).__name__}: {e}")
        report.count("lost")


def _admin_loop(url: str, churn_path: str, stop: threading.Event, report: SoakReport) -> None:
    import requests

    while not stop.is_set():
        r = requests.post(
            url + "/load_lora_adapter", json={"lora_name": CHURN, "lora_path": churn_path}, timeout=60
        )
        report.count(f"load_{r.status_code}", admin=True)
        stop.wait(0.3)
        r = requests.post(url + "/unload_lora_adapter", json={"lora_name": CHURN}, timeout=60)
        report.count(f"unload_{r.status_code}", admin=True)
        stop.wait(0.2)


def _round(
    url: str, seconds: float, clients: int, names: list[str | None], report: SoakReport, seed: int
) -> None:
    import requests

    deadline = time.monotonic() + seconds

    def client(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        with requests.Session() as session:
            while time.monotonic() < deadline:
                _stream_one(session, url, rng.choice(names), rng, report)

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 180)
    report.errors += [f"client {k} hung" for k, t in enumerate(threads) if t.is_alive()]


def idle_state(bg: Any) -> dict[str, Any]:
    """What must be zero once no request is in flight: running, waiting, pages, refcounts."""

    def inspect(eng: Any) -> dict[str, Any]:
        alloc = eng.kv_cache.allocator
        stats = eng.stats()
        return {
            "running": stats["num_running"],
            "waiting": stats["num_waiting"],
            "pages_in_use": alloc.num_blocks - alloc.num_free,
            "adapter_refcounts": sum(a["active_requests"] for a in eng.list_loras()),
            "unfinished": int(eng.has_unfinished()),
        }

    return bg.run(inspect, timeout=60)


def run_soak(
    url: str,
    bg: Any,
    *,
    adapters: list[str],
    churn_path: str,
    duration: float,
    clients: int = 32,
    warmup: float = 5.0,
    sample_every: float = 1.0,
    on_sample: Any = None,
    seed: int = 0,
) -> SoakReport:
    """Warm up, then ``duration`` seconds of ``clients`` streaming clients with the load/unload loop."""
    names: list[str | None] = [None, *adapters, CHURN]
    report = SoakReport()
    _round(url, warmup, clients, names, report, seed)
    stop = threading.Event()
    admin = threading.Thread(target=_admin_loop, args=(url, churn_path, stop, report), daemon=True)
    start = time.monotonic()

    def sampler() -> None:
        while True:
            sample = (time.monotonic() - start, rss_mb())
            report.rss.append(sample)
            if on_sample is not None:
                on_sample(*sample)
            if stop.wait(sample_every):
                return

    sampling = threading.Thread(target=sampler, daemon=True)
    sampling.start()
    admin.start()
    _round(url, duration, clients, names, report, seed + 1)
    stop.set()
    admin.join(120)
    sampling.join(10)
    bg.wait_idle(60)
    report.rss.append((time.monotonic() - start, rss_mb()))
    report.idle = idle_state(bg)
    return report


def main(argv: list[str] | None = None) -> SoakReport:
    p = make_parser("python -m mmlora.bench soak", __doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--lora-root", default="mmlora/assets/adapters", help="folder of PEFT adapters to serve")
    p.add_argument("--duration", type=float, default=300.0, help="seconds after the warm-up round")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds of the warm-up round")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--max-rss-growth-mb", type=float, default=50.0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    return _cli(args)


def _cli(args: argparse.Namespace) -> SoakReport:
    import logging
    import os
    import sys

    import uvicorn
    from tqdm.auto import tqdm

    from mmlora import Engine
    from mmlora.engine.background import BackgroundEngine
    from mmlora.server.app import build_app
    from mmlora.server.config import ServerConfig

    logging.basicConfig(level=logging.WARNING)
    quiet_third_party()
    root = os.path.realpath(args.lora_root)
    if not os.path.isdir(root):
        sys.stderr.write(f"error: --lora-root {root}: no such folder\n")
        raise SystemExit(2)
    folders = sorted(
        d for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, "adapter_config.json"))
    )
    if len(folders) < 2:
        sys.stderr.write(f"error: --lora-root {root}: needs at least two adapter folders\n")
        raise SystemExit(2)
    served, churn = folders[:-1], folders[-1]
    engine_kwargs = dict(
        model=args.model,
        device=args.device,
        lora_paths={n: os.path.join(root, n) for n in served},
        max_loras_per_batch=4,
    )
    check_engine_options(**engine_kwargs)
    engine = Engine(**engine_kwargs)
    bg = BackgroundEngine(engine)
    config = ServerConfig(
        port=_free_port(), enable_lora_runtime_update=True, lora_root=root, log_level="warning"
    )
    server = uvicorn.Server(
        uvicorn.Config(build_app(bg, config), port=config.port, log_level="warning", lifespan="off")
    )
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{config.port}"
    out = sys.stdout
    out.write(f"soak: {args.clients} streaming clients for {args.duration:.0f} s, churning {churn!r}\n")
    out.write(f"{'t (s)':>8} {'RSS (MiB)':>10}\n")
    # A bar over the run's seconds on stderr, advanced at each RSS sample; the table stays on stdout.
    bar = tqdm(total=round(args.warmup + args.duration), desc="soak", unit="s", leave=False)

    def on_sample(t: float, mb: float) -> None:
        bar.update(max(0, min(round(t), bar.total) - bar.n))
        out.write(f"{t:8.1f} {mb:10.1f}\n")
        out.flush()

    report = run_soak(
        url,
        bg,
        adapters=served,
        churn_path=churn,
        duration=args.duration,
        clients=args.clients,
        warmup=args.warmup,
        sample_every=args.sample_every,
        on_sample=on_sample,
        seed=args.seed,
    )
    bar.close()
    server.should_exit = True
    bg.shutdown(drain=False, timeout=10)
    out.write(f"requests: {report.requests} {dict(report.outcomes)}\nadmin: {dict(report.admin)}\n")
    growth = report.rss_growth_mb
    mark = target_mark(growth, args.max_rss_growth_mb, at_least=False)
    out.write(f"idle: {report.idle}\nRSS growth after warm-up: {growth:+.1f} MiB ")
    out.write(f"(target <= {args.max_rss_growth_mb:g} MiB: {mark})\n")
    problems = report.problems(args.max_rss_growth_mb)
    out.write(
        "invariants: " + ("all hold\n" if not problems else "FAILED\n  " + "\n  ".join(problems) + "\n")
    )
    return report


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

"""Live engine statistics for the app: a shared, rate-limited history of ``Engine.stats()`` samples.

Every open browser tab polls ``StatsMonitor.poll`` on a timer; samples closer together than
``min_interval_s`` reuse the last one, so many tabs cost the engine no more than one.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from dataclasses import dataclass
from typing import Any

from mmlora.engine.background import BackgroundEngine


@dataclass(frozen=True)
class StatsSample:
    t: float  # time.monotonic() when taken
    stats: dict[str, Any]
    tokens_per_s: float  # generated tokens per second since the previous sample


class StatsMonitor:
    def __init__(
        self,
        bg: BackgroundEngine,
        *,
        window_s: float = 120.0,
        min_interval_s: float = 0.5,
        timeout_s: float = 2.0,
    ) -> None:
        self.bg = bg
        self.window_s = window_s
        self.min_interval_s = min_interval_s
        self.timeout_s = timeout_s
        self._samples: collections.deque[StatsSample] = collections.deque()
        self._lock = threading.Lock()

    def poll(self, now: float | None = None) -> StatsSample | None:
        """Take a sample if the last one is older than ``min_interval_s``; return the latest (or None).

        A busy engine that does not answer within ``timeout_s`` leaves the history as it was.
        """
        now = time.monotonic() if now is None else now
        with self._lock:
            last = self._samples[-1] if self._samples else None
            if last is not None and now - last.t < self.min_interval_s:
                return last
        try:
            stats = self.bg.run(lambda eng: eng.stats(), timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            return last
        t = time.monotonic()
        with self._lock:
            prev = self._samples[-1] if self._samples else None
            if prev is not None and t <= prev.t:
                return prev
            tps = 0.0
            if prev is not None:
                made = stats["generation_tokens_total"] - prev.stats["generation_tokens_total"]
                tps = max(0.0, made / (t - prev.t))
            sample = StatsSample(t, stats, tps)
            self._samples.append(sample)
            while self._samples and t - self._samples[0].t > self.window_s:
                self._samples.popleft()
            return sample

    def history(self) -> list[StatsSample]:
        with self._lock:
            return list(self._samples)

    def frames(self, now: float | None = None) -> tuple[Any, Any]:
        """Two pandas frames for the plots: tokens/s over time, and running/waiting over time.

        Columns ``seconds`` (negative: seconds ago), ``value`` and ``series``.
        """
        import pandas as pd

        now = time.monotonic() if now is None else now
        samples = self.history()
        tps = pd.DataFrame(
            {
                "seconds": [round(s.t - now, 2) for s in samples],
                "value": [round(s.tokens_per_s, 2) for s in samples],
                "series": ["tokens/s"] * len(samples),
            }
        )
        rows = [(round(s.t - now, 2), s.stats[k], label) for s in samples for k, label in _QUEUE_SERIES]
        reqs = pd.DataFrame(rows, columns=["seconds", "value", "series"])
        return tps, reqs


_QUEUE_SERIES = (("num_running", "running"), ("num_waiting", "waiting"))


def summary_markdown(sample: StatsSample | None) -> str:
    """One line of the latest numbers, for the stats panel."""
    if sample is None:
        return "engine stats: waiting for the engine…"
    s = sample.stats
    running = ", ".join(s.get("running_loras") or []) or "none"
    return (
        f"**running** {s['num_running']} · **waiting** {s['num_waiting']} · "
        f"**tokens/s** {sample.tokens_per_s:.1f} · "
        f"**adapter slots** {s['slots_used']}/{s['max_loras']} (running adapters: {running}) · "
        f"**KV cache** {100 * s['kv_cache_usage']:.0f}% · "
        f"**generated** {s['generation_tokens_total']} tokens · **preemptions** {s['num_preemptions_total']}"
        f"  \n{prefix_cache_line(s)}"
    )


def prefix_cache_line(s: dict) -> str:
    """The prefix cache: on or off, its hit rate over prompt tokens, and the pages it holds."""
    if not s.get("prefix_cache_enabled"):
        return "**prefix cache** off"
    queries, hits = s.get("prefix_cache_queries_total", 0), s.get("prefix_cache_hits_total", 0)
    rate = f"{100 * hits / queries:.0f}%" if queries else "n/a"
    return (
        f"**prefix cache** hit rate {rate} ({hits}/{queries} prompt tokens) · "
        f"{s.get('prefix_cache_pages', 0)} pages cached"
    )

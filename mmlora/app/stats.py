"""Live engine statistics for the app: a shared, rate-limited history of ``Engine.stats()`` samples.

Every open browser tab polls ``StatsMonitor.poll`` on a timer; samples closer together than
``min_interval_s`` reuse the last one, so many tabs cost the engine no more than one.
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

from mmlora.engine.background import BackgroundEngine
from mmlora.server.client_metrics import describe_top


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
        # Accepted and not finished, wherever they are (queued for the engine thread, waiting, running):
        # a sample taken between two steps can miss a short request in the running batch, this cannot.
        stats["num_in_flight"] = self.bg.num_in_flight
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

    def series(self, now: float | None = None) -> dict[str, tuple[list[float], list[float]]]:
        """Per chart line: x (seconds before ``now``, negative) and y values.

        Where sampling paused (no tab was polling, or the engine was too busy to answer) for longer than
        ``GAP_INTERVALS`` sampling intervals, a NaN point breaks the line instead of drawing a straight
        line across a time nobody measured.
        """
        now = time.monotonic() if now is None else now
        samples = self.history()
        out: dict[str, tuple[list[float], list[float]]] = {label: ([], []) for _, label in CHART_SERIES}
        gap = GAP_INTERVALS * max(self.min_interval_s, 1.0)
        prev_t = None
        for sample in samples:
            if prev_t is not None and sample.t - prev_t > gap:
                for xs, ys in out.values():
                    xs.append(round((prev_t + sample.t) / 2 - now, 2))
                    ys.append(math.nan)
            values = {
                "tokens/s": sample.tokens_per_s,
                **{label: sample.stats.get(k, 0) for k, label in _QUEUE_SERIES},
            }
            for name, (xs, ys) in out.items():
                xs.append(round(sample.t - now, 2))
                ys.append(float(values[name]))
            prev_t = sample.t
        return out

    def frames(self, now: float | None = None) -> tuple[Any, Any]:
        """Two pandas frames for the plots (tokens/s; requests in flight, running and waiting), or two
        Nones before the first sample, so that an empty chart shows no axes at all.

        Columns ``seconds`` (negative: seconds ago), ``value`` and ``series``; a NaN value marks a gap.
        """
        import pandas as pd

        series = self.series(now)
        if not series["tokens/s"][0]:
            return None, None

        def frame(names: list[str]) -> Any:
            rows = [(x, y, name) for name in names for x, y in zip(*series[name])]
            return pd.DataFrame(rows, columns=["seconds", "value", "series"])

        return frame(["tokens/s"]), frame([label for _, label in _QUEUE_SERIES])


# A pause in sampling longer than this many sampling intervals (of at least 1 s) breaks the chart lines.
GAP_INTERVALS = 3.0
_QUEUE_SERIES = (("num_in_flight", "in flight"), ("num_running", "running"), ("num_waiting", "waiting"))
CHART_SERIES = (("tokens/s", "tokens/s"), *_QUEUE_SERIES)


def summary_markdown(sample: StatsSample | None) -> str:
    """One line of the latest numbers, for the stats panel."""
    if sample is None:
        return "engine stats: waiting for the engine…"
    s = sample.stats
    running = ", ".join(s.get("running_loras") or []) or "none"
    return (
        f"**in flight** {s.get('num_in_flight', 0)} · **running** {s['num_running']} · "
        f"**waiting** {s['num_waiting']} · "
        f"**tokens/s** {sample.tokens_per_s:.1f} · "
        f"**adapter slots** {s['slots_used']}/{s['max_loras']} (running adapters: {running}) · "
        f"**KV cache** {100 * s['kv_cache_usage']:.0f}% · "
        f"**generated** {s['generation_tokens_total']} tokens · **preemptions** {s['num_preemptions_total']}"
        f"  \n{prefix_cache_line(s)}"
        + (f"  \n**top clients** {top}" if (top := describe_top(s.get("clients"))) else "")
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

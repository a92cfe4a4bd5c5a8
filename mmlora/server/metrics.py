"""Prometheus metrics under vLLM's names, so that dashboards and LoRA-aware routers work unchanged.

Gauges and token counters are read from ``engine.stats()`` at scrape time; latency histograms are
observed on the engine thread from each request's outputs (a ``BackgroundEngine`` listener).
``vllm:lora_requests_info`` carries the running and waiting adapters as comma-separated labels, as vLLM
does; its value is the scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mmlora.engine.background import BackgroundEngine
from mmlora.engine.sampling_params import RequestOutput
from mmlora.server.client_metrics import client_metrics
from mmlora.server.residency import ResidencyCollector, residency_snapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Request ids of /health's one-token probes: they are not requests of any client, so they are left out
# of every metric (vLLM does not count its health checks either).
HEALTH_REQUEST_PREFIX = "mmlora-health-"

# Latency buckets (seconds), SGLang's; TTFT and inter-token latency share their tail from 0.5 s to 80 s.
_LATENCY_TAIL = (0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, *_LATENCY_TAIL, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, *_LATENCY_TAIL)
_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class _EngineStatsCollector:
    """Exposes the last ``engine.stats()`` snapshot (set just before each scrape)."""

    def __init__(self, model_name: str, max_client_labels: int) -> None:
        self.model_name = model_name
        self.max_client_labels = max_client_labels
        self.stats: dict[str, Any] = {}

    def describe(self) -> list[Metric]:
        return []  # values appear only after the first scrape; no fixed description needed

    def collect(self) -> Iterator[Metric]:
        s, m = self.stats, [self.model_name]
        if not s:
            return

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(m, float(value))
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(m, float(value))
            return c

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s.get("num_running", 0))
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.get("num_waiting", 0))
        usage = float(s.get("kv_cache_usage", 0.0))
        yield gauge("vllm:gpu_cache_usage_perc", "KV-cache usage, 1 means 100 percent.", usage)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent.", usage)
        yield counter("vllm:prompt_tokens", "Prefill tokens processed.", s.get("prompt_tokens_total", 0))
        yield counter("vllm:generation_tokens", "Tokens generated.", s.get("generation_tokens_total", 0))
        yield counter("vllm:num_preemptions", "Requests preempted.", s.get("num_preemptions_total", 0))
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in queried tokens.",
            s.get("prefix_cache_queries_total", 0),
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in cached tokens.",
            s.get("prefix_cache_hits_total", 0),
        )
        yield gauge("mmlora:lora_slots_used", "Adapter slots holding an adapter.", s.get("slots_used", 0))
        yield counter(
            "mmlora:lora_slot_loads", "Adapter loads into device slots.", s.get("lora_slot_loads_total", 0)
        )
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running and waiting LoRA adapters (comma-separated labels); the value is the scrape time.",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        info.add_metric(
            [
                ",".join(sorted(set(s.get("running_loras") or []))),
                ",".join(sorted(set(s.get("waiting_loras") or []))),
                str(s.get("max_loras", "")),
            ],
            time.time(),
        )
        yield info
        yield from client_metrics(s.get("clients") or {}, self.model_name, self.max_client_labels)


class ServerMetrics:
    """One registry per app (several apps may live in one process, e.g. in tests)."""

    def __init__(self, bg: BackgroundEngine, model_name: str, max_adapter_labels: int = 16) -> None:
        self.bg = bg
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        labels = ["model_name"]
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between output tokens.",
            labels,
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Time per output token (same as ITL).",
            labels,
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            labels,
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        )
        self.success = Counter(
            "vllm:request_success",
            "Finished requests by reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self._engine = _EngineStatsCollector(model_name, max_adapter_labels)
        self.registry.register(self._engine)  # type: ignore[arg-type]
        self._residency = ResidencyCollector(model_name, max_adapter_labels)
        self.registry.register(self._residency)  # type: ignore[arg-type]
        self._last: dict[str, float] = {}  # request id -> time of its previous token (engine thread only)
        # Tokens of health probes, taken off the engine's counters (engine thread only).
        self._probe_tokens = {"prompt_tokens_total": 0, "generation_tokens_total": 0}
        self._probes_prefilled: set[str] = set()
        bg.add_listener(self.observe)

    def observe(self, out: RequestOutput, now: float) -> None:
        """Engine-thread listener: latency histograms from the stream of outputs."""
        rid, m = out.request_id, self.model_name
        if rid.startswith(HEALTH_REQUEST_PREFIX):
            self._leave_out_probe(out)
            return
        new_tokens = len(out.delta_ids)
        if new_tokens:
            last = self._last.get(rid)
            if last is None:
                start = out.arrival_time or now
                first = out.first_token_time or now
                self.ttft.labels(m).observe(max(0.0, first - start))
                new_tokens -= 1
                last = first
            if new_tokens > 0:
                gap = max(0.0, now - last) / new_tokens
                for _ in range(new_tokens):
                    self.itl.labels(m).observe(gap)
                    self.tpot.labels(m).observe(gap)
            self._last[rid] = now
        if out.finished:
            self._last.pop(rid, None)
            if out.arrival_time:
                self.e2e.labels(m).observe(max(0.0, (out.finish_time or now) - out.arrival_time))
            self.success.labels(m, out.finish_reason).inc()

    def _leave_out_probe(self, out: RequestOutput) -> None:
        """A probe's first token means its prompt was prefilled (and so counted by the engine)."""
        if out.delta_ids:
            if out.request_id not in self._probes_prefilled:
                self._probes_prefilled.add(out.request_id)
                self._probe_tokens["prompt_tokens_total"] += out.prompt_tokens
            self._probe_tokens["generation_tokens_total"] += len(out.delta_ids)
        if out.finished:
            self._probes_prefilled.discard(out.request_id)

    def _client_stats(self, engine: Any) -> dict[str, Any]:
        stats = dict(engine.stats())
        for key, probe_tokens in self._probe_tokens.items():
            stats[key] = stats.get(key, 0) - probe_tokens
        return stats

    async def render(self) -> bytes:
        self._engine.stats, self._residency.snapshot = await self.bg.run_async(
            lambda eng: (self._client_stats(eng), residency_snapshot(eng))
        )
        return generate_latest(self.registry)

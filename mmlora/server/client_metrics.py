"""Per-client service for fair scheduling (``--schedule-policy``), as Prometheus series of bounded cardinality.

A client is a request's ``client_id`` (OpenAI's ``user``), else its adapter, else ``base``. The ``max_labels``
clients served most (prompt plus generated tokens) get their own label; the rest are summed under
``client="other"``, so a server with thousands of tenants still exports a few dozen series.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

OTHER = "other"


def top_clients(clients: dict[str, dict[str, float]], max_labels: int) -> list[tuple[str, dict[str, float]]]:
    """(label, stats) rows: the busiest ``max_labels`` clients by name, then the sum of the rest as ``other``."""
    ranked = sorted(
        clients.items(), key=lambda kv: (-(kv[1]["prefill_tokens"] + kv[1]["decode_tokens"]), kv[0])
    )
    rows = ranked[:max_labels]
    rest = [s for _, s in ranked[max_labels:]]
    if rest:
        keys = ("counter", "waiting", "running", "prefill_tokens", "decode_tokens")
        rows.append((OTHER, {k: sum(s[k] for s in rest) for k in keys} | {"max_running": 0, "max_queued": 0}))
    return rows


def client_metrics(
    clients: dict[str, dict[str, float]], model_name: str, max_labels: int
) -> Iterator[Metric]:
    labels = ["model_name", "client"]
    served = CounterMetricFamily(
        "mmlora:client_served_tokens", "Tokens served per client.", labels=[*labels, "kind"]
    )
    queue = GaugeMetricFamily(
        "mmlora:client_requests", "Requests per client and state.", labels=[*labels, "state"]
    )
    limit = GaugeMetricFamily(
        "mmlora:client_limit", "Per-client caps in force (0: none).", labels=[*labels, "limit"]
    )
    for client, s in top_clients(clients, max_labels):
        served.add_metric([model_name, client, "prefill"], s["prefill_tokens"])
        served.add_metric([model_name, client, "decode"], s["decode_tokens"])
        queue.add_metric([model_name, client, "waiting"], s["waiting"])
        queue.add_metric([model_name, client, "running"], s["running"])
        if client != OTHER:
            limit.add_metric([model_name, client, "max_running"], s["max_running"])
            limit.add_metric([model_name, client, "max_queued"], s["max_queued"])
    yield served
    yield queue
    yield limit


def describe_top(clients: dict[str, Any] | None, n: int = 3) -> str:
    """``acme 1234 tok (2 waiting) · ...`` for the app's live stats."""
    if not clients:
        return ""
    rows = top_clients(clients, n)
    return " · ".join(
        f"{name} {int(s['prefill_tokens'] + s['decode_tokens'])} tok ({int(s['waiting'])} waiting)"
        for name, s in rows
        if name != OTHER
    )

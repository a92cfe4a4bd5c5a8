"""Adapter residency for routers and dashboards: which adapters sit in device slots and in the host cache.

``GET /v1/adapters`` lists every registered adapter with its state. The Prometheus gauges have bounded
cardinality: the ``max_labels`` busiest adapters (most active requests, then name) get their own label,
and the rest are counted under ``adapter="other"``, so a server with thousands of adapters still exports
a few dozen series. vLLM's ``vllm:lora_requests_info`` (what the Gateway API Inference Extension reads) is
exported by ``metrics.py`` next to these.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request
from prometheus_client.core import GaugeMetricFamily, Metric

router = APIRouter()

OTHER = "other"


def adapter_state(adapter: dict[str, Any]) -> str:
    """``device`` (in a GPU slot), ``host`` (host cache only), ``registered`` (on disk) or ``unloading``."""
    if adapter.get("unloading"):
        return "unloading"
    if adapter.get("in_gpu_slot"):
        return "device"
    return "host" if adapter.get("in_host_cache") else "registered"


def residency_snapshot(engine: Any) -> dict[str, Any]:
    """Read on the engine thread: adapters with their state, and the slot figures."""
    stats = engine.stats()
    adapters = [{**a, "state": adapter_state(a)} for a in engine.list_loras()]
    return {
        "max_loras": int(stats.get("max_loras", 0)),
        "slots_used": int(stats.get("slots_used", 0)),
        "adapters": adapters,
    }


@router.get("/v1/adapters")
async def list_adapters(request: Request) -> dict[str, Any]:
    snap = await request.app.state.mmlora.bg.run_async(residency_snapshot)
    return {
        "object": "list",
        "max_loras": snap["max_loras"],
        "free_slots": snap["max_loras"] - snap["slots_used"],
        "data": [
            {
                "id": a["name"],
                "path": a["path"],
                "rank": a["rank"],
                "state": a["state"],
                "pinned": a["pinned"],
                "active_requests": a["active_requests"],
            }
            for a in snap["adapters"]
        ],
    }


class ResidencyCollector:
    """Gauges from the last residency snapshot (set just before each scrape)."""

    def __init__(self, model_name: str, max_labels: int) -> None:
        self.model_name = model_name
        self.max_labels = max_labels
        self.snapshot: dict[str, Any] = {}

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot
        if not snap:
            return
        m = self.model_name
        free = GaugeMetricFamily(
            "mmlora:lora_free_slots", "Device adapter slots holding no adapter.", labels=["model_name"]
        )
        free.add_metric([m], snap["max_loras"] - snap["slots_used"])
        yield free
        resident = GaugeMetricFamily(
            "mmlora:lora_adapter_resident",
            f"Adapters resident per tier (device slot or host cache); the {self.max_labels} busiest have their "
            f"own label, the rest are counted under adapter={OTHER!r}.",
            labels=["model_name", "adapter", "tier"],
        )
        for tier in ("device", "host"):
            held = [a for a in snap["adapters"] if a["in_gpu_slot" if tier == "device" else "in_host_cache"]]
            held.sort(key=lambda a: (-a["active_requests"], a["name"]))
            for a in held[: self.max_labels]:
                resident.add_metric([m, a["name"], tier], 1.0)
            rest = len(held) - min(len(held), self.max_labels)
            if rest:
                resident.add_metric([m, OTHER, tier], float(rest))
        yield resident

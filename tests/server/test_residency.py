"""Adapter residency: /v1/adapters and the bounded-cardinality gauges agree with the engine's own state."""

from __future__ import annotations

import requests
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import serve, tiny_engine

GREEDY = {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True}


def _gauges(url: str) -> dict[str, list]:
    text = requests.get(url + "/metrics", timeout=30).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_residency_matches_the_engine(tiny):
    # 2 slots for 5 adapters and a host cache of 3: requests move adapters between the tiers.
    engine = tiny_engine(tiny, max_loras_per_batch=2, max_loaded_loras=3)
    for served in serve(engine, max_adapter_metric_labels=2):
        for name in ("a0", "a1", "a2", "a3"):
            r = requests.post(
                served.url + "/generate",
                json={"text": "Hello", "lora_path": name, "sampling_params": GREEDY},
                timeout=60,
            )
            assert r.status_code == 200, r.text
        truth = served.bg.run(lambda e: e.list_loras())
        listed = requests.get(served.url + "/v1/adapters", timeout=30).json()
        by_name = {a["id"]: a for a in listed["data"]}
        assert set(by_name) == {a["name"] for a in truth}
        for a in truth:
            expected = "device" if a["in_gpu_slot"] else "host" if a["in_host_cache"] else "registered"
            assert by_name[a["name"]]["state"] == expected
        in_slots = sum(a["in_gpu_slot"] for a in truth)
        assert listed["free_slots"] == listed["max_loras"] - in_slots == 2 - in_slots
        assert in_slots >= 1 and sum(a["in_host_cache"] for a in truth) <= 3

        metrics = _gauges(served.url)
        (free,) = metrics["mmlora:lora_free_slots"]
        assert free.value == 2 - in_slots
        resident = metrics["mmlora:lora_adapter_resident"]
        for tier, key in (("device", "in_gpu_slot"), ("host", "in_host_cache")):
            held = [a["name"] for a in truth if a[key]]
            samples = [s for s in resident if s.labels["tier"] == tier]
            named = [s.labels["adapter"] for s in samples if s.labels["adapter"] != "other"]
            assert len(named) == min(2, len(held)) and set(named) <= set(held)  # at most 2 labels
            assert sum(s.value for s in samples) == len(held)  # named + "other" count every adapter
        (info,) = metrics["vllm:lora_requests_info"]
        assert info.labels["max_lora"] == "2"

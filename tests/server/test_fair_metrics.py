"""Per-client service over HTTP: client_id / OpenAI user bill requests, /metrics shows bounded per-client
series that match the engine's own counters, and the app's stats line names the top clients."""

from __future__ import annotations

import requests
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import serve, tiny_engine

from mmlora.app.stats import StatsSample, summary_markdown

GREEDY = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}


def test_clients_are_billed_and_exported(tiny):
    engine = tiny_engine(tiny, schedule_policy="vtc")
    for served in serve(engine, max_adapter_metric_labels=2):
        for client in ("acme", "acme", "globex", "initech"):
            r = requests.post(
                served.url + "/generate",
                json={"text": "Hello", "lora_path": "a0", "sampling_params": GREEDY, "client_id": client},
                timeout=60,
            )
            assert r.status_code == 200, r.text
        r = requests.post(
            served.url + "/v1/completions",
            json={"model": "a1", "prompt": "Hello", "max_tokens": 3, "temperature": 0, "user": "umbrella"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        r = requests.post(
            served.url + "/generate",
            json={"text": "Hello", "sampling_params": GREEDY, "client_id": 7},
            timeout=60,
        )
        assert r.status_code == 422 and "client_id" in r.text

        truth = served.bg.run(lambda e: e.stats()["clients"])
        assert set(truth) == {"acme", "globex", "initech", "umbrella"}
        assert truth["acme"]["decode_tokens"] == 2 * GREEDY["max_new_tokens"]
        text = requests.get(served.url + "/metrics", timeout=30).text
        families = {f.name: f.samples for f in text_string_to_metric_families(text)}
        decode = {
            s.labels["client"]: s.value
            for s in families["mmlora:client_served_tokens"]
            if s.labels["kind"] == "decode" and s.name.endswith("_total")
        }
        # Two labels (acme served most, then the next by tokens served), the rest summed as "other".
        assert len(decode) == 3 and "acme" in decode and "other" in decode
        assert sum(decode.values()) == sum(c["decode_tokens"] for c in truth.values())
        assert all(s.value == 0 for s in families["mmlora:client_requests"])  # idle: nothing waits or runs

        sample = StatsSample(
            t=0.0, stats={**served.bg.run(lambda e: e.stats()), "num_in_flight": 0}, tokens_per_s=0.0
        )
        assert "**top clients** acme 1" in summary_markdown(sample)

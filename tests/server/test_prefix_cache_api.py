"""The prefix cache through the server: ``meta_info.cached_tokens`` (/generate), OpenAI
``usage.prompt_tokens_details.cached_tokens``, the ``vllm:prefix_cache_*`` counters and ``/flush_cache``."""

from __future__ import annotations

import requests
from prometheus_client.parser import text_string_to_metric_families

SYSTEM = "Multi-LoRA serving batches many adapters on one base model. " * 4
GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
BLOCK = 16  # the engine's default page size


def _generate(url: str, text: str, lora: str | None) -> dict:
    r = requests.post(
        url + "/generate", json={"text": text, "sampling_params": GREEDY, "lora_path": lora}, timeout=60
    )
    assert r.status_code == 200, r.text
    return r.json()


def _counter(url: str, name: str) -> float:
    text = requests.get(url + "/metrics", timeout=30).text
    family = next(f for f in text_string_to_metric_families(text) if f.name == name)
    return next(s.value for s in family.samples if s.name.endswith("_total"))


def test_generate_reports_cached_tokens_per_adapter(server):
    first = _generate(server.url, SYSTEM + "Hello", "a0")
    prompt_tokens = first["meta_info"]["prompt_tokens"]
    assert prompt_tokens > 2 * BLOCK and first["meta_info"]["cached_tokens"] == 0
    queries, hits = (
        _counter(server.url, "vllm:prefix_cache_queries"),
        _counter(server.url, "vllm:prefix_cache_hits"),
    )
    again = _generate(server.url, SYSTEM + "Hello", "a0")
    assert again["meta_info"]["cached_tokens"] == (prompt_tokens - 1) // BLOCK * BLOCK
    assert again["output_ids"] == first["output_ids"]
    assert _generate(server.url, SYSTEM + "Hello", "a1")["meta_info"]["cached_tokens"] == 0  # other adapter
    assert _counter(server.url, "vllm:prefix_cache_queries") == queries + 2 * prompt_tokens
    assert _counter(server.url, "vllm:prefix_cache_hits") == hits + again["meta_info"]["cached_tokens"]


def test_openai_usage_has_cached_tokens_and_flush_cache_empties(server):
    body = {"model": "tiny", "prompt": SYSTEM + "Paris", "max_tokens": 3, "temperature": 0.0}
    usages = [
        requests.post(server.url + "/v1/completions", json=body, timeout=60).json()["usage"] for _ in range(2)
    ]
    assert usages[0]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] >= 2 * BLOCK
    r = requests.post(server.url + "/flush_cache", timeout=30)
    assert r.status_code == 200 and r.json()["success"] is True
    after = requests.post(server.url + "/v1/completions", json=body, timeout=60).json()["usage"]
    assert after["prompt_tokens_details"] == {"cached_tokens": 0}

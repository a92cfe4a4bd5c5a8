"""Operations: /health, /get_model_info, /metrics (vLLM names), client disconnects, queue limit, draining."""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import serve, tiny_engine, wait_until

LONG = {"max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True}


def metrics(url: str) -> dict[str, list]:
    r = requests.get(url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {f.name: f.samples for f in text_string_to_metric_families(r.text)}


def idle(served) -> bool:
    return served.bg.num_in_flight == 0 and not served.bg.run(lambda e: e.has_unfinished(), timeout=30)


def test_health_and_model_info(server):
    for path in ("/health", "/health_generate"):
        assert requests.get(server.url + path, timeout=30).status_code == 200
    info = requests.get(server.url + "/get_model_info", timeout=30).json()
    assert info["served_model_name"] == "tiny" and info["is_generation"] is True
    assert info["max_loras_per_batch"] == 4 and len(info["loras"]) >= 5
    assert info["max_lora_rank"] == 8 and info["lora_page_rank"] is None


def test_metrics_use_vllm_names_and_show_running_adapters(server):
    requests.post(
        server.url + "/generate",
        json={"text": ["a", "b"], "sampling_params": {"max_new_tokens": 3}},
        timeout=60,
    )
    body = {"text": "Hello", "sampling_params": LONG, "lora_path": "a3", "stream": True}
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)  # the request is running now
        m = metrics(server.url)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens", "vllm:generation_tokens",
                 "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:lora_requests_info", "vllm:request_success"):  # fmt: skip
        assert name in m, name
    running = next(s for s in m["vllm:num_requests_running"])
    assert running.value >= 1 and running.labels["model_name"] == "tiny"
    info = m["vllm:lora_requests_info"][0]
    assert "a3" in info.labels["running_lora_adapters"].split(",")
    assert info.labels["max_lora"] == "4" and "waiting_lora_adapters" in info.labels
    gen = next(s for s in m["vllm:generation_tokens"] if s.name.endswith("_total"))
    assert gen.value >= 6
    ttft_count = next(s for s in m["vllm:time_to_first_token_seconds"] if s.name.endswith("_count"))
    assert ttft_count.value >= 2
    assert 0 < next(iter(m["vllm:kv_cache_usage_perc"])).value <= 1
    wait_until(lambda: idle(server))  # the stream was closed: its request was aborted


def _raw_post(url: str, path: str, body: dict) -> socket.socket:
    """Send a request on a raw socket (so that the test decides when the connection closes)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    sock.sendall(head.encode() + data)
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_request(server, stream):
    wait_until(lambda: idle(server))
    sock = _raw_post(server.url, "/generate", {"text": "Hello", "sampling_params": LONG, "stream": stream})
    wait_until(lambda: server.bg.run(lambda e: e.stats()["num_running"], timeout=30) == 1)
    if stream:
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    sock.close()
    wait_until(lambda: idle(server), timeout=20)
    before = server.bg.run(lambda e: e.stats()["generation_tokens_total"], timeout=30)
    time.sleep(0.3)
    assert (
        server.bg.run(lambda e: e.stats()["generation_tokens_total"], timeout=30) == before
    )  # nothing runs on


@pytest.fixture(scope="module")
def small_queue(tiny):
    yield from serve(tiny_engine(tiny, lora_paths=None), max_in_flight_requests=2)


def test_past_the_queue_limit_the_answer_is_429_then_503_while_draining(small_queue):
    url = small_queue.url
    socks = [
        _raw_post(url, "/generate", {"text": "a", "sampling_params": LONG, "stream": True}) for _ in range(2)
    ]
    wait_until(lambda: small_queue.bg.num_in_flight == 2)
    r = requests.post(url + "/generate", json={"text": "b"}, timeout=30)
    assert r.status_code == 429 and "retry" in r.json()["error"]["message"]
    # draining: new requests get 503 at once, the ones in flight go on
    small_queue.bg.stop_intake()
    r = requests.post(url + "/v1/completions", json={"prompt": "x"}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
    assert requests.get(url + "/metrics", timeout=30).status_code == 200
    assert small_queue.bg.num_in_flight == 2
    for s in socks:
        s.close()
    wait_until(lambda: small_queue.bg.num_in_flight == 0)


def test_http_client_sees_sse_framing(server):
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "Hi", "max_tokens": 2, "stream": True}),
                 headers={"Content-Type": "application/json"})  # fmt: skip
    raw = conn.getresponse().read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def _client_counts(url: str) -> dict[str, float]:
    m = metrics(url)
    success = sum(s.value for s in m.get("vllm:request_success", []) if s.name.endswith("_total"))
    tokens = {
        name: next(s.value for s in m[name] if s.name.endswith("_total"))
        for name in ("vllm:prompt_tokens", "vllm:generation_tokens")
    }
    return {"vllm:request_success": success, **tokens}


def test_health_is_not_counted_as_a_request(server):
    requests.post(server.url + "/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 2}})
    wait_until(lambda: idle(server))
    before = _client_counts(server.url)
    for _ in range(3):
        assert requests.get(server.url + "/health", timeout=30).status_code == 200
    wait_until(lambda: idle(server))
    assert _client_counts(server.url) == before
    requests.post(server.url + "/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 2}})
    after = _client_counts(server.url)  # a client's request still counts
    assert after["vllm:request_success"] == before["vllm:request_success"] + 1
    assert after["vllm:generation_tokens"] == before["vllm:generation_tokens"] + 2


def test_a_bare_path_adapter_answers_to_its_folder_name(server, tiny):
    import shutil

    folder = tiny.root / "bare" / "solo_adapter"
    shutil.copytree(tiny.adapters["a1"], folder)
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    by_path = requests.post(server.url + "/generate", json={**body, "lora_path": str(folder)}, timeout=60)
    assert by_path.status_code == 200, by_path.text
    by_name = requests.post(server.url + "/generate", json={**body, "lora_path": "solo_adapter"}, timeout=60)
    assert by_name.status_code == 200 and by_name.json()["text"] == by_path.json()["text"]
    chat = {"model": "solo_adapter", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    assert requests.post(server.url + "/v1/completions", json=chat, timeout=60).status_code == 200
    missing = requests.post(server.url + "/v1/completions", json={**chat, "model": "nope"}, timeout=60)
    assert missing.status_code == 404 and "solo_adapter" in missing.json()["error"]["message"]

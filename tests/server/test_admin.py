"""Run-time adapter load/unload: the lifecycle, and load/unload under concurrent streaming traffic."""

from __future__ import annotations

import json
import random
import threading
import time

import requests
from hf_oracle import hf_greedy, tokenize

GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def load(url: str, name: str, path: str, pinned: bool = False) -> requests.Response:
    return requests.post(url + "/load_lora_adapter", json={"lora_name": name, "lora_path": path, "pinned": pinned},
                         timeout=60)  # fmt: skip


def unload(url: str, name: str) -> requests.Response:
    return requests.post(url + "/unload_lora_adapter", json={"lora_name": name}, timeout=60)


def assert_no_leak(served, expected_names: set[str]) -> None:
    """Nothing in flight; the registry holds exactly ``expected_names``; no slot or host copy of anything
    else survives."""
    assert served.bg.wait_idle(30)

    def inspect(eng):  # white-box: the manager's private pool and registry
        pool = eng.lora._pool
        uids = {e.uid for e in eng.lora._registry.entries()}
        return (
            eng.list_loras(),
            eng.stats(),
            set(pool.host),
            {u for u in pool.slot_uid if u is not None},
            uids,
        )

    loras, stats, host, slots, uids = served.bg.run(inspect, timeout=30)
    assert {info["name"] for info in loras} == expected_names
    assert all(info["active_requests"] == 0 and not info["unloading"] for info in loras)
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["slots_used"] <= stats["max_loras"]
    assert host <= uids and slots <= uids, "a slot or host copy outlived its adapter"
    assert not served.engine.has_unfinished()


def test_load_use_unload_reload(server, tiny):
    url = server.url
    r = load(url, "dyn", "a2")  # relative to --lora-root
    assert r.status_code == 200 and r.json()["success"], r.text
    models = {m["id"]: m for m in requests.get(url + "/v1/models", timeout=30).json()["data"]}
    assert models["dyn"]["parent"] == "tiny"
    ids = tokenize(tiny.folder, "Hello world")
    body = {"input_ids": ids, "sampling_params": GREEDY, "lora_path": "dyn"}
    r = requests.post(url + "/generate", json=body, timeout=60)
    assert r.json()["output_ids"] == hf_greedy(tiny.folder, tiny.adapters["a2"], ids, 6)
    assert unload(url, "dyn").status_code == 200
    assert requests.post(url + "/generate", json=body, timeout=60).status_code == 404
    assert "dyn" not in {m["id"] for m in requests.get(url + "/v1/models", timeout=30).json()["data"]}
    # the name may be reused, for another adapter, without aliasing the old weights
    assert load(url, "dyn", str(tiny.adapters["a4"]), pinned=True).status_code == 200
    r = requests.post(url + "/generate", json=body, timeout=60)
    assert r.json()["output_ids"] == hf_greedy(tiny.folder, tiny.adapters["a4"], ids, 6)
    assert unload(url, "dyn").status_code == 200
    assert_no_leak(server, set(tiny.adapters))


def test_unload_waits_for_in_flight_requests_which_complete(server, tiny):
    url = server.url
    assert load(url, "busy", "a3").status_code == 200
    body = {"text": "Hello", "lora_path": "busy", "stream": True,
            "sampling_params": {**GREEDY, "max_new_tokens": 60}}  # fmt: skip
    with requests.post(url + "/generate", json=body, stream=True, timeout=60) as stream:
        lines = stream.iter_lines(decode_unicode=True)
        next(lines)  # running now
        r = unload(url, "busy")  # returns once the request above has finished and the adapter is freed
        assert r.status_code == 200 and r.json()["freed"] is True, r.text
        assert requests.post(url + "/generate", json={**body, "stream": False}, timeout=30).status_code == 404
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    final = json.loads(rest[-2][len("data: ") :])
    assert final["meta_info"]["finish_reason"]["type"] == "length" and len(final["output_ids"]) == 60
    assert_no_leak(server, set(tiny.adapters))


def _stream_one(url: str, name: str | None, seed: int) -> tuple[str, str]:
    """One streaming request -> ("ok", "") | ("refused", message); anything else fails the test."""
    body = {"text": "The quick brown fox", "sampling_params": {**GREEDY, "max_new_tokens": 3 + seed % 4},
            "lora_path": name, "stream": True}  # fmt: skip
    with requests.post(url + "/generate", json=body, stream=True, timeout=120) as r:
        if r.status_code != 200:
            assert r.status_code in (400, 404, 429), (r.status_code, r.text)
            message = r.json()["error"]["message"]
            assert message, r.text
            return "refused", message
        lines = [line for line in r.iter_lines(decode_unicode=True) if line]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    last = json.loads(lines[-2][len("data: ") :])
    if "error" in last:  # an accepted request may only end this way with a clear message
        assert last["error"]["message"]
        return "refused", last["error"]["message"]
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert len(last["output_ids"]) == body["sampling_params"]["max_new_tokens"]
    return "ok", ""


def test_load_unload_under_concurrent_streaming_traffic(server, tiny):
    url = server.url
    dynamic = [f"dyn{i}" for i in range(4)]
    sources = ["a0", "a1", "a2", "a3"]
    names = [None, *tiny.adapters, *dynamic]
    stop = threading.Event()
    results: list[tuple[str, str]] = []
    failures: list[BaseException] = []
    lock = threading.Lock()
    admin_ops = {"load": 0, "unload": 0}

    def admin() -> None:
        rng = random.Random(0)
        loaded: set[str] = set()
        try:
            while not stop.is_set():
                name = rng.choice(dynamic)
                if name in loaded:
                    r = unload(url, name)
                    assert r.status_code == 200, r.text
                    loaded.discard(name)
                    admin_ops["unload"] += 1
                else:
                    r = load(url, name, rng.choice(sources))
                    assert r.status_code == 200, r.text
                    loaded.add(name)
                    admin_ops["load"] += 1
                time.sleep(0.02)
            for name in loaded:
                assert unload(url, name).status_code == 200
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            failures.append(e)

    def client(k: int) -> None:
        rng = random.Random(k)
        try:
            for j in range(4):
                res = _stream_one(url, rng.choice(names), k * 7 + j)
                with lock:
                    results.append(res)
        except BaseException as e:  # noqa: BLE001
            failures.append(e)

    admin_thread = threading.Thread(target=admin, daemon=True)
    admin_thread.start()
    clients = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(50)]
    t0 = time.time()
    for t in clients:
        t.start()
    deadline = time.monotonic() + 150
    for t in clients:
        t.join(max(0.0, deadline - time.monotonic()))
    stop.set()
    admin_thread.join(60)
    assert not any(t.is_alive() for t in clients), "a client hung"
    assert not admin_thread.is_alive(), "the admin thread hung"
    assert not failures, failures[:3]
    assert len(results) == 200
    ok = sum(1 for kind, _ in results if kind == "ok")
    refused = [msg for kind, msg in results if kind == "refused"]
    assert ok >= 100, (ok, refused[:5])
    assert all(("unknown adapter" in m) or ("being unloaded" in m) or ("retry" in m) for m in refused), (
        refused[:5]
    )
    assert admin_ops["load"] >= 3 and admin_ops["unload"] >= 2, admin_ops
    assert time.time() - t0 < 150
    assert_no_leak(server, set(tiny.adapters))

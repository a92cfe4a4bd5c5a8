"""Adapters by Hugging Face Hub id at run time: refused unless --allow-hub-adapters; with it, downloaded
on a worker thread (never the engine's), named as asked, listed with their root (id@commit), and serving
the same tokens as the same adapter loaded from its folder. Offline, from a hand-built hub cache."""

from __future__ import annotations

import threading

import pytest
import requests
from hub_cache import add_snapshot, go_offline, refuse_network
from server_fixtures import serve, tiny_engine

import mmlora.server.admin as admin

GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def hub(tiny, tmp_path_factory):
    cache = tmp_path_factory.mktemp("hub-server") / "hub"
    commits = {name: add_snapshot(cache, f"tiny-org/{name}", tiny.adapters[name]) for name in ("a0", "a2")}
    commits["base"] = add_snapshot(cache, "tiny-org/base", tiny.folder)
    return cache, commits


@pytest.fixture(autouse=True)
def offline(hub, monkeypatch):
    go_offline(monkeypatch, hub[0])
    attempts = refuse_network(monkeypatch)
    yield
    assert attempts == [], f"network access attempted: {attempts}"


def load(url: str, name: str, path: str) -> requests.Response:
    return requests.post(url + "/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=60)


def generate(url: str, lora: str | None) -> list[int]:
    body = {"text": "The quick brown fox", "sampling_params": GREEDY, "lora_path": lora}
    res = requests.post(url + "/generate", json=body, timeout=60)
    assert res.status_code == 200, res.text
    return res.json()["output_ids"]


def test_runtime_hub_loads_are_refused_without_the_flag(tiny, monkeypatch):
    monkeypatch.setattr(admin, "resolve_adapter", lambda *a, **k: pytest.fail("must not download"))
    for served in serve(tiny_engine(tiny), enable_lora_runtime_update=True, lora_root=str(tiny.root)):
        res = load(served.url, "hub0", "tiny-org/a0")
        assert res.status_code == 403, res.text
        error = res.json()["error"]
        assert error["code"] == "hub_adapters_disabled" and "--allow-hub-adapters" in error["message"]
        assert "hub0" not in [
            m["id"] for m in requests.get(served.url + "/v1/models", timeout=30).json()["data"]
        ]


def test_with_the_flag_a_hub_adapter_is_fetched_off_the_engine_thread(tiny, hub, monkeypatch):
    cache, commits = hub
    threads: list[str] = []
    real = admin.resolve_adapter

    def recording(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(admin, "resolve_adapter", recording)
    engine = tiny_engine(tiny, model="tiny-org/base", allow_hub_adapters=True)
    for served in serve(engine, enable_lora_runtime_update=True, lora_root=str(tiny.root)):
        res = load(served.url, "hub0", "tiny-org/a0")
        assert res.status_code == 200, res.text
        assert (
            threads and served.bg._thread.name not in threads and threading.main_thread().name not in threads
        )
        models = {m["id"]: m for m in requests.get(served.url + "/v1/models", timeout=30).json()["data"]}
        assert models["hub0"]["root"] == f"tiny-org/a0@{commits['a0']}" and models["hub0"]["parent"] == "tiny"
        assert models["tiny"]["root"] == f"tiny-org/base@{commits['base']}"
        assert generate(served.url, "hub0") == generate(served.url, "a0") != generate(served.url, None)
        res = load(served.url, "nope", "tiny-org/missing")
        assert res.status_code == 400 and res.json()["error"]["param"] == "lora_path"
        message = res.json()["error"]["message"]
        assert (
            "tiny-org/missing (revision main) is no local path and not in the hub cache" in message
            and "\n" not in message
        )

"""The error matrix: every bad input is a 4xx in OpenAI's envelope, and the server keeps serving."""

from __future__ import annotations

import os
import shutil

import pytest
import requests
from server_fixtures import serve, tiny_engine
from tiny_models import make_adapter, make_checkpoint

OK_BODY = {"text": "Hello", "sampling_params": {"max_new_tokens": 2}}


def assert_error(r: requests.Response, status: int, phrase: str = "") -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert phrase.lower() in err["message"].lower(), err["message"]
    return err


def still_serving(url: str) -> None:
    r = requests.post(url + "/generate", json=OK_BODY, timeout=30)
    assert r.status_code == 200, r.text


GENERATE_CASES = [
    ({"text": ["a", "b", "c"], "lora_path": ["a0", "a1"]}, 400, "3 prompts"),
    ({"text": ["a", "b"], "sampling_params": [{}, {}, {}]}, 400, "2 prompts"),
    ({"text": "a", "lora_path": "no-such-adapter"}, 404, "unknown adapter"),
    ({"text": "a", "lora_path": "/etc"}, 400, "outside"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, 400, "temperature"),
    ({"text": "a", "sampling_params": {"top_p": 0}}, 400, "top_p"),
    ({"text": "a", "sampling_params": {"max_new_tokens": -3}}, 400, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"bogus": 1}}, 400, "bogus"),
    ({"text": "a", "input_ids": [1, 2]}, 400, "either"),
    ({}, 400, "required"),
    ({"text": []}, 400, "empty"),
    ({"input_ids": [10**9]}, 400, "input_ids"),
    ({"text": 5}, 422, "text"),
    ({"text": "a", "unknown_field": 1}, 422, "unknown_field"),
    ({"text": "a", "image_data": "data:image/png;base64,AAAA"}, 400, "takes no images"),
    ({"text": "a", "return_logprob": True, "top_logprobs_num": 50}, 400, "top_logprobs_num"),
    ({"text": "a" * 3000}, 400, "max_model_len"),
    ({"text": "a", "sampling_params": {"min_new_tokens": 5, "max_new_tokens": 2}}, 400, "min_new_tokens"),
    ({"text": "a", "sampling_params": {"stop_token_ids": [10**6]}}, 400, "stop_token_ids"),
]


@pytest.mark.parametrize("body,status,phrase", GENERATE_CASES)
def test_generate_bad_input(server, body, status, phrase):
    assert_error(requests.post(server.url + "/generate", json=body, timeout=30), status, phrase)


def test_malformed_json_and_wrong_routes(server):
    url = server.url
    r = requests.post(
        url + "/generate", data="{not json", headers={"content-type": "application/json"}, timeout=30
    )
    assert_error(r, 400, "malformed json")
    assert_error(requests.post(url + "/v1/completions", data="[1, 2]", timeout=30), 400, "json object")
    assert_error(
        requests.post(url + "/v1/chat/completions", json={"model": "tiny"}, timeout=30), 422, "messages"
    )
    assert_error(requests.get(url + "/nope", timeout=30), 404, "no such endpoint")
    assert_error(requests.get(url + "/generate", timeout=30), 405)
    still_serving(url)


OPENAI_CASES = [
    ("/v1/completions", {"model": "tiny", "prompt": "x", "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logit_bias": {"1": 5}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logprobs": 99}, 400, "logprobs"),
    ("/v1/completions", {"model": "tiny:nope", "prompt": "x"}, 404, "not found"),
    ("/v1/completions", {"model": "tiny", "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": "many"}, 422, "n"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 422, "messages"),
    ("/v1/chat/completions", {"model": "x", "messages": [{"role": "user", "content": "h"}]}, 404, "not found"),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "takes no images",
    ),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "wizard", "content": "h"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "h"}], "top_logprobs": 3}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "h"}], "tools": [{"type": "function"}]}, 400,
     "tools"),
]  # fmt: skip


@pytest.mark.parametrize("path,body,status,phrase", OPENAI_CASES)
def test_openai_bad_input(server, path, body, status, phrase):
    assert_error(requests.post(server.url + path, json=body, timeout=30), status, phrase)


def test_adapter_admin_refusals(server, tiny, tmp_path):
    url = server.url + "/load_lora_adapter"
    root = tiny.root

    def load(name: str, path: str) -> requests.Response:
        return requests.post(url, json={"lora_name": name, "lora_path": path}, timeout=60)

    assert_error(load("x1", "../base"), 400, "outside")
    assert_error(load("x2", str(tmp_path)), 400, "outside")
    assert_error(load("x3", "/etc"), 400, "outside")
    # a symbolic link inside the root that points out of it
    outside = tmp_path / "outside_adapter"
    shutil.copytree(tiny.adapters["a0"], outside)
    link = root / "sneaky"
    os.symlink(outside, link)
    try:
        assert_error(load("x4", "sneaky"), 400, "outside")
    finally:
        link.unlink()
    # a file inside the adapter folder that links out
    inner = root / "inner_link"
    shutil.copytree(tiny.adapters["a1"], inner)
    (inner / "adapter_model.safetensors").unlink()
    os.symlink(outside / "adapter_model.safetensors", inner / "adapter_model.safetensors")
    try:
        assert_error(load("x5", "inner_link"), 400, "outside")
    finally:
        shutil.rmtree(inner)
    # pickled adapters are refused
    pickled = root / "pickled"
    make_adapter(tiny.folder, pickled, 9, r=4, lora_alpha=8, target_modules=["q_proj"], safe=False)
    try:
        assert_error(load("x6", "pickled"), 400, "pickled")
    finally:
        shutil.rmtree(pickled)
    # an adapter made for another model shape
    wrong = root / "wrong_shape"
    other = make_checkpoint(tmp_path / "other_base", hidden_size=32, intermediate_size=64)
    make_adapter(other, wrong, 10, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    try:
        assert_error(load("x7", "wrong_shape"), 400, "shape")
    finally:
        shutil.rmtree(wrong)
    assert_error(load("a0", "a1"), 400, "already")
    assert_error(load("tiny", "a1"), 400, "served model")
    assert_error(load("x8", "does_not_exist"), 404, "no such folder")
    assert_error(requests.post(url, json={"lora_name": "", "lora_path": "a1"}, timeout=30), 422, "lora_name")
    r = requests.post(server.url + "/unload_lora_adapter", json={"lora_name": "nope"}, timeout=30)
    assert_error(r, 404, "no adapter")
    names = {info["name"] for info in server.bg.run(lambda e: e.list_loras(), timeout=30)}
    assert names == set(tiny.adapters)  # nothing half-registered
    still_serving(server.url)


@pytest.fixture(scope="module")
def guarded(tiny):
    yield from serve(tiny_engine(tiny, lora_paths={"a0": str(tiny.adapters["a0"])}), api_key="sekret")


@pytest.mark.parametrize(
    "method,path", [("get", "/health"), ("get", "/metrics"), ("get", "/v1/models"), ("post", "/generate"),
                    ("post", "/load_lora_adapter"), ("post", "/v1/chat/completions"), ("get", "/get_model_info")],
)  # fmt: skip
def test_api_key_guards_every_endpoint(guarded, method, path):
    r = getattr(requests, method)(guarded.url + path, json=OK_BODY, timeout=30)
    assert_error(r, 401, "api key")
    r = getattr(requests, method)(guarded.url + path, json=OK_BODY, headers={"Authorization": "Bearer wrong"})
    assert_error(r, 401, "api key")


def test_api_key_accepted_and_runtime_update_off(guarded):
    auth = {"Authorization": "Bearer sekret"}
    r = requests.post(guarded.url + "/generate", json=OK_BODY, headers=auth, timeout=30)
    assert r.status_code == 200, r.text
    r = requests.post(
        guarded.url + "/load_lora_adapter",
        json={"lora_name": "z", "lora_path": "a1"},
        headers=auth,
        timeout=30,
    )
    assert_error(r, 403, "disabled")
    # without run-time updates, an unregistered path in a request is unknown, never read from disk
    body = {**OK_BODY, "lora_path": "/tmp"}
    assert_error(
        requests.post(guarded.url + "/generate", json=body, headers=auth, timeout=30), 404, "unknown"
    )

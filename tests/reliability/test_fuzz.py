"""Schema-driven fuzzing of every endpoint (hypothesis, fixed seed, 525 cases a run).

Each body mixes, field by field: a valid value, an edge of its range, a value of another JSON type,
or a nested structure; plus unknown fields and raw bytes that are not JSON at all. After every case a
normal request must still succeed, and no answer may be a 500 (no fault is injected here). Every error
must be OpenAI's envelope with a string or null ``code``.
"""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import requests
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

SEED = 20261201
# 403: a Hub-shaped adapter id that names nothing under --lora-root is refused while hub downloads at run
# time are off (--allow-hub-adapters), a deliberate answer naming lora_path.
ALLOWED = {200, 400, 403, 404, 409, 413, 422, 429}
STATS: Counter = Counter()

leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(
        ["", "\ud800", "yes", "5", "a0", "../base", "/etc/passwd", "data:image/png;base64,AAAA"]
    )
)
any_json = st.recursive(
    leaf,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=12,
)


def F(good: list, bad: list) -> tuple[st.SearchStrategy, st.SearchStrategy]:
    """A field's domain: values that must be accepted, and range edges that must be refused."""
    return st.sampled_from(good), st.sampled_from(bad)


BAD_FLOATS = [1e300, math.nan, math.inf, -math.inf, 2**64, -1]
TOKENS = F([0, 1, 2, 3], [-1, 2**63, 2**64, 10**30, 513, 100000])
TOKEN_IDS = (st.lists(st.integers(min_value=0, max_value=383), max_size=6), st.just([1, True, -2, 384]))
TEXT = (st.text(max_size=24), st.just("\ud800"))
SAMPLING = {
    "max_new_tokens": TOKENS,
    "min_new_tokens": F([0, 1], [-1, 2**63]),
    "temperature": F([0, 1e-50, 1e-6, 1e-5, 0.7, 2.0], BAD_FLOATS),
    "top_p": F([0.5, 1, 1.0], [0, 1.5, *BAD_FLOATS]),
    "top_k": F([-1, 1, 5], [0, -2, 2**63, True]),
    "min_p": F([0, 0.1, 1], [1.5, *BAD_FLOATS]),
    "repetition_penalty": F([1e-50, 0.5, 1, 10], [0, 10.0001, *BAD_FLOATS]),
    "frequency_penalty": F([-2, 0, 2], [2.5, *BAD_FLOATS]),
    "presence_penalty": F([-2, 0, 2], [-3, *BAD_FLOATS]),
    "stop": (
        st.one_of(st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=4), max_size=3)),
        st.just([""]),
    ),
    "stop_token_ids": TOKEN_IDS,
    "ignore_eos": F([True, False], ["yes", 1]),
    "skip_special_tokens": F([True, False], ["no", 0]),
    "seed": F([0, 1, 2**63 - 1], [2**63, 2**70, -1]),
    "n": F([1, 2], [0, -1, 129]),
}


def body_of(fields: dict[str, tuple], required: dict[str, tuple] | None = None) -> st.SearchStrategy:
    """A third of the time a body of acceptable values only; a third with one field at a refused edge of
    its range; a third with one field (or an unknown one) replaced by any JSON (types, nesting)."""
    required = required or {}
    both = {**fields, **required}
    good = st.builds(
        lambda a, b: {**b, **a},
        st.fixed_dictionaries({}, optional={k: v[0] for k, v in fields.items()}),
        st.fixed_dictionaries({k: v[0] for k, v in required.items()}),
    )
    edge = st.sampled_from(sorted(both)).flatmap(lambda k: st.tuples(st.just(k), both[k][1]))
    at_edge = st.builds(lambda body, kv: {**body, kv[0]: kv[1]}, good, edge)
    names = sorted({*both, "bogus"})
    mutated = st.builds(lambda body, key, value: {**body, key: value}, good, st.sampled_from(names), any_json)
    return st.one_of(good, at_edge, mutated)


def nested(body: st.SearchStrategy) -> tuple[st.SearchStrategy, st.SearchStrategy]:
    return body, st.just({"temperature": [[[]]]})


GENERATE = body_of(
    {
        "text": (st.one_of(TEXT[0], st.lists(TEXT[0], min_size=1, max_size=3)), TEXT[1]),
        "input_ids": (
            st.lists(st.integers(min_value=0, max_value=383), min_size=1, max_size=6),
            TOKEN_IDS[1],
        ),
        "sampling_params": nested(body_of(SAMPLING)),
        "lora_path": F([None, "a0", "a1"], ["nope", "/etc", "a0/../../base"]),
        "stream": F([True, False], ["yes"]),
        "return_logprob": F([True, False], ["yes"]),
        "top_logprobs_num": F([0, 1, 5, 20], [21, -1, "5"]),
        "return_text_in_logprobs": F([True, False], [1]),
        "image_data": F([None], ["data:image/png;base64,AAAA", "x"]),
    }
)
OPENAI = {
    "model": F(["tiny", "a0", "tiny:a1"], ["nope", "tiny:nope"]),
    "n": F([1, 2], [0, 129, True]),
    "stop": SAMPLING["stop"],
    "seed": F([0, 7], [2**63, -1]),
    "temperature": F([0, 1e-40, 0.7], BAD_FLOATS),
    "top_p": F([0.9, 1], [0, *BAD_FLOATS]),
    "presence_penalty": F([0, 1.0], [3, *BAD_FLOATS]),
    "frequency_penalty": F([0, 1.0], [3, *BAD_FLOATS]),
    "stream": F([True, False], ["yes"]),
    "stream_options": F([{"include_usage": True}, {"include_usage": False}], [{"include_usage": "yes"}]),
    "logit_bias": F([None], [{"1": 5}]),
    "top_k": F([-1, 1], [0]),
    "repetition_penalty": F([1.1, 1e-50], [0, 11]),
    "ignore_eos": F([True, False], ["yes"]),
    "min_tokens": F([0, 1], [-1]),
    "stop_token_ids": TOKEN_IDS,
    "lora_path": F(["a0"], ["nope"]),
}
COMPLETIONS = body_of(
    {**OPENAI, "max_tokens": TOKENS, "logprobs": F([0, 2], [21, -1]), "echo": F([True, False], ["no"])},
    required={
        "prompt": (st.one_of(TEXT[0], st.lists(TEXT[0], min_size=1, max_size=2), TOKEN_IDS[0]), st.just([])),
    },
)
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system"]),
        "content": st.one_of(
            TEXT[0], st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT[0]}), max_size=2)
        ),
    }
)
BAD_MESSAGES = st.sampled_from(
    [
        [],
        [{"role": "wizard", "content": "h"}],
        [{"role": "user", "content": [{"type": "audio"}]}],
        [{"content": "h"}],
    ]
)
CHAT = body_of(
    {
        **OPENAI,
        "max_completion_tokens": TOKENS,
        "logprobs": F([True, False], ["yes"]),
        "top_logprobs": F([0, 3], [21]),
        "response_format": F([{"type": "text"}], [{"type": "json_object"}]),
        "tools": F([None], [[{"type": "function"}]]),
    },
    required={"messages": (st.lists(MESSAGE, min_size=1, max_size=3), BAD_MESSAGES), "max_tokens": TOKENS},
)
ADMIN = st.one_of(
    st.tuples(
        st.just("/load_lora_adapter"),
        body_of(
            {"pinned": F([False], ["yes"])},
            required={
                "lora_name": F(["fz1", "fz2"], ["", "tiny", "a0"]),
                "lora_path": F(["a2", "a3"], ["../base", "/etc", "missing", "a0/adapter_config.json"]),
            },
        ),
    ),
    st.tuples(
        st.just("/unload_lora_adapter"), body_of({}, required={"lora_name": F(["fz1", "fz2"], ["nope", ""])})
    ),
)
RAW = st.tuples(
    st.sampled_from(["/generate", "/v1/completions", "/v1/chat/completions", "/load_lora_adapter"]),
    st.one_of(
        st.binary(max_size=64),
        st.sampled_from([b"", b"{", b"[]", b'"x"', b"null", b'{"text": "a"', b"\xff{}"]),
    ),
)


def post(url: str, path: str, data: bytes) -> requests.Response:
    return requests.post(url + path, data=data, headers={"Content-Type": "application/json"}, timeout=120)


def check(url: str, path: str, data: bytes) -> None:
    r = post(url, path, data)
    STATS["cases"] += 1
    STATS[r.status_code] += 1
    assert r.status_code in ALLOWED, (path, data[:300], r.status_code, r.text[:300])
    if r.status_code != 200:
        err = r.json()["error"]
        assert err["code"] is None or isinstance(err["code"], str), err
        assert err["type"] in ("invalid_request_error", "requests"), err
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        for line in r.text.splitlines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event or event["error"]["type"] != "server_error", event
    normal = post(url, "/generate", b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}')
    assert normal.status_code == 200, ("after", path, data[:300], normal.text[:300])


def fuzz(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )


@pytest.fixture(scope="module")
def url(server):
    return server.url


def as_json(path: str, body: st.SearchStrategy) -> st.SearchStrategy:
    return body.map(lambda b: (path, json.dumps(b).encode()))


ENDPOINTS = {  # name -> strategy of (path, request body bytes)
    "generate": as_json("/generate", GENERATE),
    "completions": as_json("/v1/completions", COMPLETIONS),
    "chat": as_json("/v1/chat/completions", CHAT),
    "adapter_admin": ADMIN.map(lambda case: (case[0], json.dumps(case[1]).encode())),
    "raw_bytes": RAW,
}


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
@seed(SEED)
@fuzz(105)
@given(data=st.data())
def test_fuzz(url, endpoint, data):
    check(url, *data.draw(ENDPOINTS[endpoint], label=endpoint))


def test_fuzz_summary(url):
    for path in ("/v1/models", "/get_model_info", "/health", "/metrics"):
        assert requests.get(url + path, timeout=60).status_code == 200
    summary = {str(k): v for k, v in sorted(STATS.items(), key=str)}
    print(f"\nfuzz: {summary}")  # the closing note of issue 12 quotes these
    assert STATS["cases"] >= 500 and STATS[500] == 0, summary

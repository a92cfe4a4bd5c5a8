"""One bad request fails alone: its neighbours' greedy outputs equal a run without it.

Faults are made on purpose: sampling parameters that overflow to NaN probabilities, and the test hook
``FaultInjector`` (mmlora.engine.fault_isolation) that makes one request's sampling, or every forward
holding one adapter, raise.
"""

from __future__ import annotations

import pytest
from server_fixtures import tiny_engine

from mmlora.engine.fault_isolation import FaultInjector

GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
NEIGHBOURS = [("Hello world", "a0"), ("The cat sat", None), ("One two three", "a1"), ("A dog ran", "a2")]


@pytest.fixture(scope="module")
def engine(tiny):
    return tiny_engine(tiny)


def run(engine, extra: list[tuple[str, str | None, dict]] = ()) -> dict[str, object]:
    """Neighbours (and the extra requests) in one batch; every request's final output by id."""
    rids = [
        engine.add_request(text, sampling_params=GREEDY, lora=lora, request_id=f"n{i}")
        for i, (text, lora) in enumerate(NEIGHBOURS)
    ]
    rids += [
        engine.add_request(text, sampling_params=sp, lora=lora, request_id=f"x{i}")
        for i, (text, lora, sp) in enumerate(extra)
    ]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert set(done) == set(rids)
    return done


def assert_neighbours_unchanged(engine, done):
    alone = run(engine)
    for i in range(len(NEIGHBOURS)):
        assert done[f"n{i}"].finish_reason == "length" and done[f"n{i}"].error is None
        assert done[f"n{i}"].output_ids == alone[f"n{i}"].output_ids, f"neighbour n{i} changed"
    assert engine.lora.slots_used <= engine.lora.num_slots
    assert all(a["active_requests"] == 0 for a in engine.list_loras())
    assert engine.kv_cache.allocator.num_free == engine.kv_cache.allocator.num_blocks


@pytest.mark.parametrize(
    "bad",
    [
        {"max_new_tokens": 4, "temperature": 0.7, "repetition_penalty": 1e-50},
        {"max_new_tokens": 4, "temperature": 1e-5, "repetition_penalty": 1e-35},
    ],
)
def test_nan_probabilities_fail_only_their_request(engine, bad):
    done = run(engine, [("Hello world", "a0", bad)])
    assert done["x0"].finish_reason == "abort"
    assert "repetition_penalty" in done["x0"].error and "NaN" in done["x0"].error
    assert not done["x0"].error.startswith("internal error")  # the request's own fault: a 400
    assert_neighbours_unchanged(engine, done)


def test_tiny_temperature_is_greedy(engine):
    done = run(engine, [("Hello world", "a0", {**GREEDY, "temperature": 1e-50})])
    assert done["x0"].output_ids == done["n0"].output_ids  # same prompt and adapter as n0, greedy
    assert_neighbours_unchanged(engine, done)


def test_injected_sampling_fault_fails_only_that_request(engine):
    engine.step_guard.faults = FaultInjector(sampling_rids={"x1"})
    try:
        done = run(engine, [("Hi", "a3", GREEDY), ("Bye", "a0", GREEDY)])
    finally:
        engine.step_guard.faults = None
    assert done["x1"].finish_reason == "abort" and done["x1"].error.startswith(
        "internal error: InjectedFault"
    )
    assert done["x0"].finish_reason == "length" and done["x0"].error is None
    assert_neighbours_unchanged(engine, done)


def test_injected_adapter_fault_fails_only_its_requests(engine):
    """Every forward holding adapter a4 raises: the batch is bisected down to the a4 requests."""
    engine.step_guard.faults = FaultInjector(adapters={"a4"})
    try:
        done = run(engine, [("Hi there", "a4", GREEDY), ("Bye now", "a4", GREEDY)])
    finally:
        engine.step_guard.faults = None
    for rid in ("x0", "x1"):
        assert done[rid].finish_reason == "abort" and "injected fault" in done[rid].error
    assert_neighbours_unchanged(engine, done)


def test_bad_values_are_refused_before_queueing(engine):
    for sp, field in [
        ({"skip_special_tokens": "no"}, "skip_special_tokens"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"repetition_penalty": 11.0}, "repetition_penalty"),
        ({"max_new_tokens": 2**63}, "max_new_tokens"),
        ({"max_new_tokens": 10**6}, "max_new_tokens"),
        ({"seed": 2**70}, "seed"),
        ({"seed": -1}, "seed"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": True}, "top_k"),
    ]:
        with pytest.raises(ValueError, match=field):
            engine.add_request("Hello", sampling_params=sp)
    with pytest.raises(ValueError, match="input_ids"):
        engine.add_request(input_ids=[True, False])
    assert not engine.has_unfinished()


def test_nan_logits_from_the_model_are_named_per_row():
    """The sampler refuses rows with NaN/Inf logits before multinomial sees them (on CUDA a NaN there is a
    device-side assert), naming them as the model's fault, apart from rows whose parameters overflow."""
    import torch

    from mmlora.engine.request import Request
    from mmlora.engine.sampler import BadSamplingRows, sample
    from mmlora.engine.sampling_params import SamplingParams

    reqs = [
        Request("ok", [1], SamplingParams(temperature=0.0), None),
        Request("model", [1], SamplingParams(temperature=0.7), None),
        Request("params", [1], SamplingParams(temperature=0.7, repetition_penalty=1e-50), None),
    ]
    logits = torch.randn(3, 16)
    logits[1, 3] = float("nan")
    logits[2, 1] = 5.0  # the prompt token: penalised by 1e-50 it overflows to Inf
    with pytest.raises(BadSamplingRows) as e:
        sample(logits, reqs, torch.Generator().manual_seed(0))
    assert set(e.value.rows) == {1, 2} and e.value.model_rows == {1}
    assert "repetition_penalty=1e-50" in e.value.rows[2]


def test_greedy_rows_with_nan_or_posinf_logits_are_named_and_masked_rows_are_not():
    """All-greedy batch without penalties (one gather of the chosen logit instead of full passes): NaN and
    +Inf rows are refused as the model's fault; -Inf entries (grammar masks) are fine; the tokens are the
    argmax; logprobs come back only when a request asks for them."""
    import torch

    from mmlora.engine.request import Request
    from mmlora.engine.sampler import BadSamplingRows, sample
    from mmlora.engine.sampling_params import SamplingParams

    def reqs(n: int, **kw) -> list:
        return [Request(f"r{i}", [1], SamplingParams(temperature=0.0), None, **kw) for i in range(n)]

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 16, generator=g)
    logits[2, :] = float("-inf")
    logits[2, 5] = 0.25  # masked down to one allowed token
    tokens, logprobs = sample(logits, reqs(4), g)
    assert tokens == logits.argmax(dim=-1).tolist() and tokens[2] == 5
    assert logprobs.shape == (4, 0)
    tokens, logprobs = sample(logits, reqs(4, return_logprob=True), g)
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, dim=-1))
    bad = logits.clone()
    bad[0, 3] = float("nan")
    bad[3, 9] = float("inf")
    with pytest.raises(BadSamplingRows) as e:
        sample(bad, reqs(4), g)
    assert set(e.value.rows) == e.value.model_rows == {0, 3}


def test_greedy_rows_held_short_of_min_new_tokens_still_name_nan_logits_behind_the_stop_mask():
    """Greedy rows short of ``min_new_tokens`` take the same one-gather check: their stop tokens are masked
    to -inf before the argmax, so a NaN or +Inf there is read from the raw logits apart; the token is the
    argmax with the stop tokens masked."""
    import torch

    from mmlora.engine.request import Request
    from mmlora.engine.sampler import BadSamplingRows, sample
    from mmlora.engine.sampling_params import SamplingParams

    eos = 7
    reqs = [Request(f"r{i}", [1], SamplingParams(temperature=0.0, min_new_tokens=4), None) for i in range(4)]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 16, generator=g)
    logits[:, eos] = 50.0  # the best token everywhere, but held back
    tokens, _ = sample(logits, reqs, g, eos_ids=frozenset({eos}))
    masked = logits.clone()
    masked[:, eos] = float("-inf")
    assert tokens == masked.argmax(dim=-1).tolist() and eos not in tokens
    bad = logits.clone()
    bad[1, eos] = float("nan")  # only behind the mask
    bad[2, eos] = float("inf")
    bad[3, 2] = float("nan")
    with pytest.raises(BadSamplingRows) as e:
        sample(bad, reqs, g, eos_ids=frozenset({eos}))
    assert set(e.value.rows) == e.value.model_rows == {1, 2, 3}

"""Fair admission in the real engine: a flooding client against a light one, under fcfs and vtc."""

from __future__ import annotations

import pytest
from tiny_models import ALL_SEVEN, make_adapter, make_checkpoint

import mmlora

GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
FLOOD = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("fair")
    base = make_checkpoint(root / "base", "llama")
    adapters = {
        name: make_adapter(base, root / name, seed=i, r=4, lora_alpha=8, target_modules=ALL_SEVEN)
        for i, name in enumerate(["heavy", "light"])
    }
    return base, adapters


def engine(tiny, **kw):
    base, adapters = tiny
    return mmlora.Engine(
        model=str(base),
        lora_paths={n: str(p) for n, p in adapters.items()},
        device="cpu",
        dtype="float32",
        max_running_requests=2,  # a small batch, so a queue forms
        **kw,
    )


def _steps_until_admitted(eng, flood_first: int) -> int:
    """Flood with the heavy adapter, let it run ``flood_first`` steps, then add one light request; the
    number of steps until the light request runs (then the engine is drained)."""
    for _ in range(FLOOD):
        eng.add_request("Hello world", sampling_params=GREEDY, lora="heavy")
    for _ in range(flood_first):
        eng.step()
    light = eng.add_request("Hello world", sampling_params=GREEDY, lora="light")
    steps = 0
    while all(r.rid != light for r in eng.scheduler.running):
        eng.step()
        steps += 1
        assert steps < 500
    while eng.has_unfinished():
        eng.step()
    return steps


def test_light_client_waits_behind_the_flood_under_fcfs_and_not_under_vtc(tiny):
    fcfs_steps = _steps_until_admitted(engine(tiny, schedule_policy="fcfs"), flood_first=3)
    vtc_eng = engine(tiny, schedule_policy="vtc")
    vtc_steps = _steps_until_admitted(vtc_eng, flood_first=3)
    # Under vtc the light client is admitted as soon as a running request finishes: one request's
    # lifetime (prefill + 4 tokens) at most (2 steps measured). Under fcfs it waits for most of the flood
    # to drain (46 steps measured).
    assert vtc_steps <= GREEDY["max_new_tokens"] + 1
    assert fcfs_steps >= 4 * vtc_steps
    heavy, light = vtc_eng.scheduler.vtc.clients["heavy"], vtc_eng.scheduler.vtc.clients["light"]
    assert heavy.waiting == light.waiting == heavy.running == light.running == 0  # books balance at idle
    assert heavy.decode_tokens == FLOOD * GREEDY["max_new_tokens"]
    assert light.decode_tokens == GREEDY["max_new_tokens"]


def test_outputs_do_not_depend_on_the_policy(tiny):
    texts = {}
    for policy in ("fcfs", "vtc"):
        eng = engine(tiny, schedule_policy=policy)
        outs = eng.generate(
            ["Hello world", "Paris is", "The quick"], ["heavy", "light", None], sampling_params=GREEDY
        )
        texts[policy] = [o.output_ids for o in outs]
    assert texts["fcfs"] == texts["vtc"]


def test_client_id_overrides_the_adapter_and_per_client_caps_hold(tiny):
    eng = engine(tiny, schedule_policy="vtc", max_queued_per_client=3, max_running_per_client=1)
    for _ in range(3):
        eng.add_request("Hello", sampling_params=GREEDY, lora="heavy", client_id="acme")
    with pytest.raises(OverflowError, match="acme"):
        eng.add_request("Hello", sampling_params=GREEDY, lora="light", client_id="acme")
    eng.add_request("Hello", sampling_params=GREEDY, lora="light")  # another client: not capped
    eng.step()
    running = [eng.scheduler.client_of(r) for r in eng.scheduler.running]
    assert sorted(running) == ["acme", "light"]  # acme holds one running request, its cap
    while eng.has_unfinished():
        eng.step()
        assert sum(eng.scheduler.client_of(r) == "acme" for r in eng.scheduler.running) <= 1
    with pytest.raises(ValueError, match="client_id"):
        eng.add_request("Hello", sampling_params=GREEDY, client_id="")


def test_unknown_policy_is_an_error(tiny):
    with pytest.raises(ValueError, match="schedule_policy"):
        engine(tiny, schedule_policy="lottery")

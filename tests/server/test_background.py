"""BackgroundEngine: thread-safe submission, sync and async streams, abort, run, failures, limits, shutdown."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from hf_oracle import hf_greedy, tokenize
from server_fixtures import tiny_engine, within

from mmlora.engine.background import BackgroundEngine, EngineUnavailableError, QueueFullError

GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture
def bg(tiny):
    bg = BackgroundEngine(tiny_engine(tiny))
    yield bg
    bg.shutdown(drain=False, timeout=10)


def test_sync_stream_deltas_add_up_and_match_hf(bg, tiny):
    handle = bg.submit("Hello world", sampling_params=GREEDY, lora="a1")
    outs = within(60, list, handle)
    final = outs[-1]
    assert final.finished and all(not o.finished for o in outs[:-1])
    assert "".join(o.delta_text for o in outs) == final.text
    assert [t for o in outs for t in o.delta_ids] == final.output_ids
    assert final.output_ids == hf_greedy(
        tiny.folder, tiny.adapters["a1"], tokenize(tiny.folder, "Hello world"), 8
    )
    assert handle.result(timeout=1) is final


def test_async_streams_from_two_loops_and_threads(bg):
    def run_loop(results: list, lora: str | None) -> None:
        async def main() -> None:
            handles = [
                await bg.submit_async("The quick", sampling_params=GREEDY, lora=lora) for _ in range(3)
            ]
            for h in handles:
                outs = [o async for o in h]
                results.append((outs[-1].finish_reason, "".join(o.delta_text for o in outs) == outs[-1].text))

        asyncio.run(asyncio.wait_for(main(), 60))

    results: list = []
    threads = [
        threading.Thread(target=run_loop, args=(results, lora), daemon=True) for lora in (None, "a0", "a2")
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 90
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a stream did not finish within 90 s"
    assert results == [("length", True)] * 9


def test_validation_errors_reach_the_caller_and_batches_are_atomic(bg):
    with pytest.raises(ValueError, match="temperature"):
        bg.submit("x", sampling_params={"temperature": -1})
    with pytest.raises(ValueError, match="unknown adapter"):
        bg.submit_many([{"prompt": "ok", "sampling_params": GREEDY}, {"prompt": "x", "lora": "missing"}])
    assert bg.num_in_flight == 0
    assert bg.run(lambda eng: eng.has_unfinished(), timeout=30) is False
    with pytest.raises(ValueError, match="already in use"):
        bg.submit_many([{"prompt": "a", "request_id": "same"}, {"prompt": "b", "request_id": "same"}])
    assert bg.num_in_flight == 0


def test_abort_and_run(bg):
    handle = bg.submit("Hello", sampling_params={"max_new_tokens": 400, "ignore_eos": True})
    within(30, next, iter(handle))
    handle.abort()
    final = handle.result(timeout=30)
    assert final.finish_reason == "abort" and len(final.output_ids) < 400
    assert bg.run(lambda eng: eng.stats()["num_running"], timeout=30) == 0
    with pytest.raises(KeyError):
        bg.run(lambda eng: {}["missing"], timeout=30)
    assert bg.run(lambda eng: 41 + 1, timeout=30) == 42  # the loop survived the exception


def test_a_failing_step_fails_its_requests_but_not_the_loop(bg):
    real_step = bg.engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real_step()

    bg.run(lambda eng: setattr(eng, "step", flaky_step), timeout=30)
    failed = bg.submit("Hello", sampling_params={**GREEDY, "max_new_tokens": 50}).result(timeout=30)
    assert failed.finish_reason == "abort" and "boom" in failed.error
    ok = bg.submit("Hello", sampling_params=GREEDY).result(timeout=30)
    assert ok.finish_reason == "length" and len(ok.output_ids) == 8


def test_in_flight_limit_and_idle_thread_sleeps(tiny):
    bg = BackgroundEngine(tiny_engine(tiny), max_in_flight=2)
    try:
        long = {"max_new_tokens": 200, "ignore_eos": True}
        a, b = bg.submit("a", sampling_params=long), bg.submit("b", sampling_params=long)
        with pytest.raises(QueueFullError):
            bg.submit("c")
        a.abort()
        b.abort()
        assert bg.wait_idle(30)
        bg.submit("c", sampling_params=GREEDY).result(timeout=30)
        assert bg.wait_idle(5)
        # The engine thread's own CPU clock: other threads of this process (and other tests) do not count.
        clock = time.pthread_getcpuclockid(bg._thread.ident)
        t0 = time.clock_gettime(clock)
        time.sleep(0.5)
        assert time.clock_gettime(clock) - t0 < 0.005, (
            "the idle engine thread is busy-waiting"
        )  # a 1 ms poll: ~0.012
    finally:
        bg.shutdown(drain=True, timeout=10)


def test_shutdown_drains_then_refuses(tiny):
    bg = BackgroundEngine(tiny_engine(tiny))
    handle = bg.submit("Hello", sampling_params={**GREEDY, "max_new_tokens": 30})
    bg.stop_intake()
    with pytest.raises(EngineUnavailableError):
        bg.submit("late")
    bg.shutdown(drain=True, timeout=30)
    assert handle.result(timeout=1).finish_reason == "length"
    with pytest.raises(EngineUnavailableError):
        bg.run(lambda eng: None, timeout=30)


def test_a_failing_listener_or_output_fails_at_most_its_own_request(bg):
    bg.add_listener(lambda out, now: 1 / 0)  # swallowed and logged
    assert bg.submit("Hello", sampling_params=GREEDY).result(timeout=30).finish_reason == "length"
    bad = bg.submit("Hello", sampling_params={**GREEDY, "max_new_tokens": 30})
    good = bg.submit("The quick", sampling_params={**GREEDY, "max_new_tokens": 30})

    def broken(out):
        raise RuntimeError("cannot deliver")

    bad._fix_delta = broken  # the engine thread reads it on the next output
    assert bad.result(timeout=30).error.endswith("cannot deliver")
    assert good.result(timeout=30).finish_reason == "length"
    assert bg.wait_idle(10) and not bg.run(lambda eng: eng.has_unfinished(), timeout=30)

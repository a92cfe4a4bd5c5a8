"""The Virtual Token Counter's rules, and the paper's service bound over random arrival sequences."""

from __future__ import annotations

import collections
import json

import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

from mmlora.engine.fairness import VirtualTokenCounter, load_client_limits


def test_admit_and_decode_charge_their_weights() -> None:
    vtc = VirtualTokenCounter(prefill_weight=1.0, decode_weight=2.0)
    vtc.on_arrival("a")
    vtc.on_admit("a", prompt_tokens=10)
    vtc.on_decode("a", 3)
    assert vtc.clients["a"].counter == 10 + 2 * 3
    assert (vtc.clients["a"].waiting, vtc.clients["a"].running) == (0, 1)


def test_newly_backlogged_client_is_lifted_to_the_least_served_backlogged_one() -> None:
    vtc = VirtualTokenCounter()
    for c in ("a", "b"):
        vtc.on_arrival(c)
        vtc.on_arrival(c)
    vtc.on_admit("a", 100)
    vtc.on_admit("b", 40)
    # a (100) and b (40) still wait; c arrives after idling: it starts at b's 40, not 0.
    vtc.on_arrival("c")
    assert vtc.clients["c"].counter == 40
    # A client already ahead keeps its counter (the lift never lowers one).
    vtc.clients["d"].counter = 500
    vtc.on_arrival("d")
    assert vtc.clients["d"].counter == 500


def test_arrival_into_an_empty_queue_is_lifted_to_the_last_client_that_left() -> None:
    vtc = VirtualTokenCounter()
    vtc.on_arrival("a")
    vtc.on_admit("a", 70)  # a leaves the queue with counter 70
    vtc.on_arrival("b")
    assert vtc.clients["b"].counter == 70


def test_a_waiting_client_is_not_lifted_again_by_its_own_arrivals() -> None:
    vtc = VirtualTokenCounter()
    vtc.on_arrival("a")
    vtc.on_arrival("b")
    vtc.on_admit("b", 50)
    vtc.on_arrival("b")  # backlogged again: max(50, a's 0) keeps 50, the lift never lowers
    vtc.on_arrival("a")  # a already waits: its counter stays
    assert vtc.clients["a"].counter == 0 and vtc.clients["b"].counter == 50
    assert vtc.order(["b", "a"]) == ["a", "b"]


def test_preempted_request_is_requeued_without_a_second_charge() -> None:
    vtc = VirtualTokenCounter()
    vtc.on_arrival("a")
    vtc.on_admit("a", 30)
    vtc.on_preempt("a")
    assert (vtc.clients["a"].waiting, vtc.clients["a"].running) == (1, 0)
    vtc.on_admit("a", 30, charge=False)
    assert vtc.clients["a"].counter == 30


def test_order_breaks_ties_by_the_order_given() -> None:
    vtc = VirtualTokenCounter()
    assert vtc.order(["x", "y", "z"]) == ["x", "y", "z"]


def test_weights_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        VirtualTokenCounter(prefill_weight=0.0)


def test_client_limits_file(tmp_path) -> None:
    path = tmp_path / "limits.json"
    path.write_text(json.dumps({"heavy": {"max_running": 2, "max_queued": 5}}))
    limits = load_client_limits(str(path), max_running=0, max_queued=100)
    assert (limits.running_cap("heavy"), limits.queued_cap("heavy")) == (2, 5)
    assert (limits.running_cap("light"), limits.queued_cap("light")) == (0, 100)
    path.write_text(json.dumps({"heavy": {"max_runing": 2}}))
    with pytest.raises(ValueError, match="heavy"):
        load_client_limits(str(path), 0, 0)
    path.write_text(json.dumps({"heavy": {"max_running": -1}}))
    with pytest.raises(ValueError, match=">= 0"):
        load_client_limits(str(path), 0, 0)


# ---- the paper's bound, over random arrival sequences ----------------------------------------------

W_P, W_Q = 1.0, 2.0
MAX_PROMPT, MAX_OUTPUT = 24, 16
CAPACITY = 96  # M: the most tokens (prompt + generated) the running batch holds


def _simulate(arrivals: list[list[tuple[str, int, int]]]) -> list[dict[str, tuple[float, bool]]]:
    """Continuous batching under VTC admission: per step, the weighted service so far of each client and
    whether it was backlogged during the whole step."""
    vtc = VirtualTokenCounter(W_P, W_Q)
    queues: dict[str, collections.deque] = collections.defaultdict(collections.deque)
    running: list[list] = []  # [client, prompt, output_len, generated]
    served: dict[str, float] = collections.defaultdict(float)
    trace = []
    for step_arrivals in arrivals + [[]] * 200:
        for client, prompt, out_len in step_arrivals:
            vtc.on_arrival(client)
            queues[client].append((prompt, out_len))
        backlogged_at_start = {c for c, q in queues.items() if q}
        used = sum(p + g for _, p, _, g in running)
        while True:  # admit the least-served backlogged client's head while it fits
            waiting = [c for c, q in queues.items() if q]
            if not waiting:
                break
            client = vtc.order(waiting)[0]
            prompt, out_len = queues[client][0]
            if used + prompt + out_len > CAPACITY:
                break  # work-conserving up to memory: the head of the least-served client waits
            queues[client].popleft()
            vtc.on_admit(client, prompt)
            served[client] += W_P * prompt
            running.append([client, prompt, out_len, 0])
            used += prompt + out_len
        for r in running:
            r[3] += 1
            vtc.on_decode(r[0])
            served[r[0]] += W_Q
        for r in [r for r in running if r[3] >= r[2]]:
            running.remove(r)
            vtc.on_finish(r[0])
        backlogged_at_end = {c for c, q in queues.items() if q}
        trace.append({c: (served[c], c in backlogged_at_start and c in backlogged_at_end) for c in served})
        if not running and not any(queues.values()) and step_arrivals == []:
            break
    return trace


request = st.tuples(
    st.sampled_from(["a", "b", "c", "d"]),
    st.integers(1, MAX_PROMPT),
    st.integers(1, MAX_OUTPUT),
)


@seed(20261201)
@settings(max_examples=150, deadline=None, derandomize=False)
@given(st.lists(st.lists(request, max_size=6), min_size=1, max_size=40))
def test_service_difference_between_backlogged_clients_stays_within_the_paper_bound(arrivals) -> None:
    """Theorem 4.4 of Sheng et al.: |W_f(t1,t2) - W_g(t1,t2)| <= 2 * max(w_p * L_in, w_q * M) for two
    clients backlogged over all of [t1, t2]."""
    bound = 2 * max(W_P * MAX_PROMPT, W_Q * CAPACITY)
    trace = _simulate(arrivals)
    clients = {c for snap in trace for c in snap}
    for f in clients:
        for g in clients:
            if f >= g:
                continue
            start = None  # first step of the current interval where both stay backlogged
            for t, snap in enumerate(trace):
                both = snap.get(f, (0, False))[1] and snap.get(g, (0, False))[1]
                if not both:
                    start = None
                    continue
                if start is None:
                    start = t
                    base = (
                        trace[t - 1].get(f, (0.0,))[0] if t else 0.0,
                        trace[t - 1].get(g, (0.0,))[0] if t else 0.0,
                    )
                diff = (snap[f][0] - base[0]) - (snap[g][0] - base[1])
                assert abs(diff) <= bound, (f, g, start, t, diff, bound)


def test_flooding_client_cannot_starve_a_light_one_in_the_simulation() -> None:
    """The simplest case the bound covers: 40 heavy requests queued first, one light request behind."""
    arrivals = [[("heavy", 20, 8)] * 40, [("light", 20, 8)]]
    trace = _simulate(arrivals)
    light_admitted = next(t for t, snap in enumerate(trace) if snap.get("light", (0.0,))[0] > 0)
    assert light_admitted <= 10

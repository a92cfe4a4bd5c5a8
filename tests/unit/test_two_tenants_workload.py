"""The two-tenants workload generator: rates from capacity, Poisson arrivals per tenant, tenant mix, seeds;
and the vtc/fcfs round comparison."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from mmlora.bench.serving_tenants import (
    LIGHT_TENANTS,
    compare_rounds,
    saturating_workload,
    tenant_rates,
    two_tenant_workload,
)

LENS = SimpleNamespace(input_len=(2, 5), output_len=(8, 32))
VOCAB = 100


def test_rates_turn_token_loads_into_requests_per_second():
    rates = tenant_rates(1000.0, 1.1, (8, 32))
    mean_out = np.arange(8, 32).mean()  # uniform integers in [8, 32)
    assert len(rates) == 1 + LIGHT_TENANTS
    assert rates[0] == pytest.approx(1100.0 / mean_out)
    assert rates[1:] == pytest.approx([100.0 / mean_out] * LIGHT_TENANTS)


def test_each_tenant_is_a_poisson_stream_at_its_rate():
    rates, duration = [20.0] + [2.0] * LIGHT_TENANTS, 500.0
    work = two_tenant_workload(rates, duration, LENS, VOCAB, seed=3)
    arrivals = [w["arrival"] for w in work]
    assert arrivals == sorted(arrivals) and arrivals[0] >= 0.0 and arrivals[-1] < duration
    for tenant, rate in enumerate(rates):
        times = np.array([w["arrival"] for w in work if w["tenant"] == tenant])
        expected = rate * duration
        assert abs(len(times) - expected) < 5 * math.sqrt(expected)  # Poisson count: sd = sqrt(mean)
        gaps = np.diff(times)
        assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.15)  # exponential gaps: CV 1
    heavy_share = sum(w["tenant"] == 0 for w in work) / len(work)
    assert heavy_share == pytest.approx(20.0 / 34.0, abs=0.02)  # the tenant mix follows the rates


def test_lengths_and_tokens_stay_in_their_ranges():
    work = two_tenant_workload([5.0] * (1 + LIGHT_TENANTS), 20.0, LENS, VOCAB, seed=0)
    assert {w["tenant"] for w in work} == set(range(1 + LIGHT_TENANTS))
    assert all(2 <= len(w["input_ids"]) < 5 and 8 <= w["output_len"] < 32 for w in work)
    assert all(0 <= t < VOCAB for w in work for t in w["input_ids"])


def test_seeds_are_deterministic_and_tenants_independent():
    rates = tenant_rates(500.0, 1.1, (8, 32))
    a = two_tenant_workload(rates, 30.0, LENS, VOCAB, seed=7)
    assert a == two_tenant_workload(rates, 30.0, LENS, VOCAB, seed=7)
    assert a != two_tenant_workload(rates, 30.0, LENS, VOCAB, seed=8)
    heavier = two_tenant_workload(tenant_rates(500.0, 3.0, (8, 32)), 30.0, LENS, VOCAB, seed=7)

    def light(work):
        return [w for w in work if w["tenant"] != 0]

    assert light(heavier) == light(a)  # a louder heavy tenant does not move the light tenants' requests
    assert sum(w["tenant"] == 0 for w in heavier) > sum(w["tenant"] == 0 for w in a)


def test_saturating_workload_is_all_at_once_over_every_tenant():
    work = saturating_workload(20, LENS, VOCAB, seed=1)
    assert len(work) == 20 and all(w["arrival"] == 0.0 for w in work)
    assert [w["tenant"] for w in work[:9]] == [0, 1, 2, 3, 4, 5, 6, 7, 0]
    assert work == saturating_workload(20, LENS, VOCAB, seed=1)


def _run(ttft: float, latency: float, tok_s: float) -> dict[str, float]:
    return {"light_ttft_p99_s": ttft, "light_latency_p99_s": latency, "output_tok_per_s": tok_s}


def test_compare_rounds_reports_each_round_and_the_worse_one():
    results = {
        "fcfs": [_run(2.0, 4.0, 100.0), _run(1.0, 5.0, 100.0)],
        "vtc": [_run(0.2, 2.0, 98.0), _run(0.4, 1.0, 90.0)],
    }
    out = compare_rounds(results)
    assert [r["light_ttft_p99_vtc_over_fcfs"] for r in out["per_round"]] == pytest.approx([0.1, 0.4])
    assert [r["light_latency_p99_vtc_over_fcfs"] for r in out["per_round"]] == pytest.approx([0.5, 0.2])
    assert out["worse_round"] == 1  # the higher light TTFT ratio
    assert out["ratios"] == pytest.approx(
        {
            "light_ttft_p99_vtc_over_fcfs": 0.4,
            "light_latency_p99_vtc_over_fcfs": 0.5,  # each ratio's worst, whichever round it came from
            "throughput_vtc_over_fcfs": 0.9,
        }
    )

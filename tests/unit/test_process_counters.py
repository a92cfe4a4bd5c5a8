"""The process-wide counters of the serving breakdown: each counts its events since the last reset."""

from __future__ import annotations

import gc

import torch

from mmlora.bench.process_counters import AllocatorCounter, GCTimer


def test_the_allocator_counter_reports_driver_calls_since_its_reset(monkeypatch):
    stats = {"num_device_alloc": 5, "num_device_free": 1, "num_alloc_retries": 0, "num_ooms": 0}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: dict(stats))
    counter = AllocatorCounter(torch.device("cuda", 0))
    stats.update(num_device_alloc=9, num_device_free=4, num_alloc_retries=2, num_sync_all_streams=2)
    assert counter.summary() == {
        "num_device_alloc": 4,
        "num_device_free": 3,
        "num_alloc_retries": 2,
        "num_sync_all_streams": 2,
        "num_ooms": 0,
    }
    counter.reset()
    assert set(counter.summary().values()) == {0}


def test_the_allocator_counter_is_none_off_cuda():
    assert AllocatorCounter(torch.device("cpu")).summary() is None


def test_the_gc_timer_counts_collections_per_generation():
    timer = GCTimer()
    timer.install()
    try:
        gc.collect(1)
        gc.collect(2)
    finally:
        timer.uninstall()
    summary = timer.summary()
    assert summary["collections"][1] >= 1 and summary["collections"][2] >= 1
    assert summary["total_s"] >= 0.0 and gc.callbacks.count(timer) == 0

"""graph_safety's checks can fail: a forward that waits for the device (``.item()``), or that reads a tensor
made before it that is no static buffer, is refused, and one that only uses its static buffers passes."""

from __future__ import annotations

import pytest
import torch
from graph_safety import LaunchLog, assert_steps_replay_their_captures, record_launches

STATIC = torch.arange(8, dtype=torch.float32)
STALE = torch.ones(8)  # made before the forward, not a static buffer


def _check(monkeypatch, forward) -> None:  # noqa: ANN001
    log = LaunchLog({STATIC.untyped_storage().data_ptr(): "static"})
    record_launches(monkeypatch, log)

    def run() -> list:
        log.start()
        with torch.inference_mode(), log.mode:
            forward()
        log.on = False
        return log.calls

    steps = [("key", run()), ("key", run())]
    assert_steps_replay_their_captures(log, steps, lambda key: (log.start(), forward()))


def test_a_forward_on_its_static_buffers_passes(monkeypatch):
    _check(monkeypatch, lambda: STATIC.mul_(1.0).add_(STATIC * 0))


def test_a_forward_that_waits_for_the_device_is_refused(monkeypatch):
    with pytest.raises(AssertionError, match="item"):
        _check(monkeypatch, lambda: STATIC.add_(STATIC.sum().item() * 0))


def test_a_forward_that_reads_a_tensor_from_outside_is_refused(monkeypatch):
    with pytest.raises(AssertionError, match="outside"):
        _check(monkeypatch, lambda: STATIC.add_(STALE * 0))

"""The Triton backends' memo of checked weights (``FusedTritonBackend``): a warm backend accepts and
refuses exactly what a fresh one does, with the same message, and computes the same output.

Oracle: a fresh backend instance for every call (nothing memoised: the full argument checks) and the
fp64 per-token reference of lora_cases.py. The warm backend first checks the weights on a valid
call; then every bad call below must raise the fresh backend's ValueError, and a valid call after it
must still match the reference (a refused call leaves no state that lets a later bad one through).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must precede the first triton import of the session
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from lora_cases import CPU_CASES, TRITON, make_case, reference  # noqa: E402

from mmlora.backends import get_backend  # noqa: E402
from mmlora.forward.lora import LoRABatchInfo  # noqa: E402


def _bigger_batch_info(c, num_slots: int, top_rank: int) -> LoRABatchInfo:
    """The case's routing on an info addressing ``num_slots`` slots, slot 0 at rank ``top_rank``."""
    info = LoRABatchInfo(c.info.max_tokens, num_slots, c.info.device)
    for s, r in enumerate(c.ranks):
        info.set_slot_rank(s, r)
    info.set_slot_rank(0, top_rank)
    info.fill(c.info.seg_lens_host, c.info.seg_slots_host)
    return info


def _bad_calls(c):
    """(label, out, x, info) calls that a fresh backend refuses."""
    R, S = c.B.shape[2], c.A.shape[0]
    return [
        ("x in_features", c.out, c.x[:, :-1], c.info),
        ("x dtype", c.out, c.x.double(), c.info),
        ("x not contiguous", c.out, c.x.t().contiguous().t(), c.info),
        ("x rows", c.out, c.x[:1], c.info),
        ("x 1-D", c.out, c.x[0], c.info),
        ("out rows", c.out[:1], c.x, c.info),
        ("out width", c.out[:, :-1], c.x, c.info),
        ("out dtype", c.out.to(torch.int32), c.x, c.info),
        ("batch rank above R", c.out, c.x, _bigger_batch_info(c, S, R + 1)),
        ("batch addresses more slots", c.out, c.x, _bigger_batch_info(c, S + 1, 1)),
    ]


def _fresh_error(backend: str, out, x, weights, info) -> str | None:
    try:
        get_backend(backend).add_lora(out.clone(), x, weights, info)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("backend", TRITON)
def test_warm_backend_refuses_what_a_fresh_one_refuses(backend: str) -> None:
    c = make_case(*CPU_CASES["decode-uniform-gateup"], dtype=torch.float32)
    weights = c.weights  # one object: the memo is keyed by it
    _, want = reference(c)
    warm = get_backend(backend)
    out0 = c.out.clone()
    warm.add_lora(c.out, c.x, weights, c.info)  # checks the weights in full, once
    torch.testing.assert_close(c.out.double().cpu(), want, atol=1e-4, rtol=1e-4)
    for label, out, x, info in _bad_calls(c):
        expected = _fresh_error(backend, out, x, weights, info)
        assert expected is not None, f"{label}: the fresh backend accepted it (the case is wrong)"
        with pytest.raises(ValueError) as err:
            warm.add_lora(out.clone(), x, weights, info)
        assert str(err.value) == expected, label
        again = out0.clone()
        warm.add_lora(again, c.x, weights, c.info)  # still accepted, still right
        torch.testing.assert_close(again.double().cpu(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", TRITON)
def test_memo_follows_the_weights_object(backend: str) -> None:
    """Other weights (another module, a different shape) are checked in full, not matched by a memo."""
    c = make_case(*CPU_CASES["decode-uniform-gateup"], dtype=torch.float32)
    warm = get_backend(backend)
    warm.add_lora(c.out.clone(), c.x, c.weights, c.info)
    narrow = c.weights.__class__(c.A, c.B[:, :-1], c.scalings, c.offsets)  # offsets no longer match B
    with pytest.raises(ValueError, match="slice_offsets"):
        warm.add_lora(c.out[:, :-1].clone(), c.x, narrow, c.info)

"""The decode attention's launch settings (``decode_tuning.TUNING``): every setting a sweep may try gives
the same attention as the torch reference and dense fp64 (tests/kernels/test_attention.py's oracles), and
a bad setting is a ValueError naming its knob.

On CPU the kernels run under TRITON_INTERPRET=1, which ignores warps and pipeline stages: there those
cases check that the settings reach the launch; keys per step and the split rule change the arithmetic.
"""

from __future__ import annotations

import pytest
import torch
from test_attention import DEV, _check_triton, _poison_before_window, dense_attention, make_case, run_backend

from mmlora.forward import AttentionMetadata
from mmlora.layers.attention import get_attention_backend, triton_decode
from mmlora.layers.attention.decode_tuning import TUNING, block_n_for, settings, splits_for
from mmlora.layers.attention.triton_backend import TritonAttention, auto_num_kv_splits

# contexts (and so seq lens 70, 3, 41, 1, 151, 17) that are not multiples of any block_n tried
SPECS = [(69, 1), (2, 1), (40, 1), (0, 1), (150, 1), (16, 1)]
CONFIGS = {
    "bn16-w2-s1": {"block_n": 16, "num_warps": 2, "num_stages": 1},
    "bn32-w8-s3": {"block_n": 32, "num_warps": 8, "num_stages": 3, "reduce_warps": 1},
    "bn128-w8-s1": {"block_n": 128, "num_warps": 8, "num_stages": 1, "reduce_warps": 8},
    "bn16-many-splits": {"block_n": 16, "min_tokens_per_split": 16, "occupancy_programs_per_sm": 64},
    "bn64-capped-splits": {
        "block_n": 64,
        "min_tokens_per_split": 1,
        "occupancy_programs_per_sm": 16,
        "max_splits": 3,
    },
}


@pytest.fixture
def tune(monkeypatch: pytest.MonkeyPatch):
    """``tune(**knobs)``: set decode TUNING knobs for this test (restored after it)."""

    def apply(**knobs) -> None:
        for knob, value in knobs.items():
            monkeypatch.setitem(TUNING, knob, value)

    return apply


def test_defaults_reproduce_the_hard_coded_launch() -> None:
    """The defaults are the settings the kernels had before TUNING: BLOCK_N 64 (32 past head dim 128),
    4 warps and 2 stages, and the split rule min(cdiv(len, 256), cdiv(2 * SMs, B * Hkv), 32)."""
    s = settings()
    assert (s.block_n, s.num_warps, s.num_stages, s.reduce_warps) == (None, 4, 2, 4)
    assert [block_n_for(bd, s.block_n) for bd in (32, 64, 128, 256)] == [64, 64, 64, 32]
    for sms in (4, 108, 132):
        for b in (1, 3, 32, 72, 128, 256):
            for hkv in (1, 8):
                for length in (1, 255, 256, 780, 4096, 32768):
                    old = max(1, min(-(-length // 256), -(-2 * sms // (b * hkv)), 32))
                    assert splits_for(b, hkv, length, sms) == old
    assert auto_num_kv_splits(32, 8, 4096, torch.device("cpu")) == 1


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_decode_matches_reference_under_config(config: str, splits: int | None, tune) -> None:
    tune(**CONFIGS[config])
    case = make_case(SPECS, hq=6, hkv=2, d=24, page=8, seed=7)
    _check_triton(case, 0.3, None, None, atol=1e-5, rtol=1e-5, num_kv_splits=splits)
    _check_triton(case, 0.3, 9, 3.0, atol=1e-5, rtol=1e-5, num_kv_splits=splits)


def test_settings_reach_the_launch(tune, monkeypatch: pytest.MonkeyPatch) -> None:
    """What each kernel launch is given (the interpreter runs any warps and stages the same)."""
    launches = []
    real = triton_decode.fast

    def spy(kernel):
        launcher = real(kernel)

        class Spy:
            def __getitem__(self, grid):
                def call(*args, **kwargs):
                    launches.append((kernel, tuple(grid), kwargs))
                    return launcher[grid](*args, **kwargs)

                return call

        return Spy()

    monkeypatch.setattr(triton_decode, "fast", spy)
    tune(**CONFIGS["bn32-w8-s3"])
    case = make_case(SPECS, hq=6, hkv=2, d=24, page=8, seed=7)
    run_backend(TritonAttention(3), case, 0.3, None, None)
    (split_kernel, grid, split), (reduce_kernel, _, reduce) = launches
    assert (
        split_kernel is triton_decode._decode_split_kernel
        and reduce_kernel is triton_decode._decode_reduce_kernel
    )
    assert grid == (len(SPECS), 2, 3)
    assert (split["BLOCK_N"], split["num_warps"], split["num_stages"], reduce["num_warps"]) == (32, 8, 3, 1)


def test_split_rule_knobs_change_the_automatic_split_count(tune) -> None:
    cpu = torch.device("cpu")
    tune(**CONFIGS["bn16-many-splits"])  # cdiv(151, 16) = 10 by length; cdiv(64 * 4, 6 * 2) = 22 by occupancy
    assert auto_num_kv_splits(6, 2, 151, cpu) == 10
    tune(max_splits=3)
    assert auto_num_kv_splits(6, 2, 151, cpu) == 3
    tune(min_tokens_per_split=256, occupancy_programs_per_sm=1, max_splits=32)
    assert auto_num_kv_splits(6, 2, 4096, cpu) == 1


@pytest.mark.parametrize("config", ["bn16-many-splits", "bn128-w8-s1"])
def test_padded_rows_and_requests_under_config(config: str, tune) -> None:
    """A CUDA-graph bucket's padding: a request of seq_len 0 writing to slot -1, and token rows past
    ``meta.num_tokens``; both come back zero, the real requests match the reference."""
    tune(**CONFIGS[config])
    case = make_case(SPECS, hq=4, hkv=2, d=16, page=4, seed=8)
    seq_lens, slots = case.meta.seq_lens.clone(), case.meta.slot_mapping.clone()
    seq_lens[1], slots[1] = 0, -1
    slots = torch.cat([slots, torch.tensor([-1, -1], device=DEV)])
    meta = AttentionMetadata(**{**case.meta.__dict__, "seq_lens": seq_lens, "slot_mapping": slots})
    pad = lambda x: torch.cat([x, torch.ones_like(x[:2])])  # noqa: E731
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    out = TritonAttention().forward(pad(case.q), pad(case.k), pad(case.v), kc, vc, meta, scale=0.25)
    ref, _, _ = run_backend(get_attention_backend("torch", DEV), case, 0.25, None, None)
    keep = [b for b in range(len(SPECS)) if b != 1]
    assert out[1].abs().sum() == 0 and out[len(SPECS) :].abs().sum() == 0
    torch.testing.assert_close(out[keep], ref[keep], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("config", ["bn16-many-splits", "bn128-w8-s1"])
def test_window_never_reads_pages_before_it_under_config(config: str, tune) -> None:
    tune(**CONFIGS[config])
    window = 16
    case = make_case([(400, 1), (150, 1), (5, 1), (77, 1)], hq=3, hkv=1, d=16, page=4, seed=9)
    _poison_before_window(case, window, margin=0)  # decode starts at the window's first token
    out, _, _ = run_backend(TritonAttention(), case, 0.25, window, None)
    assert not out.isnan().any(), "a page before the sliding window was read"
    torch.testing.assert_close(
        out.double().cpu(), dense_attention(case, 0.25, window, None), atol=1e-5, rtol=1e-5
    )


BAD = [
    ("block_n", 8),
    ("block_n", 48),
    ("block_n", 0),
    ("block_n", True),
    ("block_n", 64.0),
    ("num_warps", 3),
    ("num_warps", 32),
    ("num_warps", None),
    ("reduce_warps", 0),
    ("num_stages", 0),
    ("num_stages", 1.5),
    ("min_tokens_per_split", 0),
    ("occupancy_programs_per_sm", -2),
    ("max_splits", 0),
    ("max_splits", [4]),
]


@pytest.mark.parametrize("knob,value", BAD, ids=[f"{k}={v!r}" for k, v in BAD])
def test_bad_tuning_raises_value_error_naming_the_knob(knob: str, value, tune) -> None:
    tune(**{knob: value})
    case = make_case([(5, 1)], hq=2, hkv=1, d=16, page=4)
    with pytest.raises(ValueError, match=knob):
        run_backend(TritonAttention(), case, 0.25, None, None)
    with pytest.raises(ValueError, match=knob):
        auto_num_kv_splits(1, 1, 5, torch.device("cpu"))


def test_unknown_or_missing_knob_raises_value_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(TUNING, "num_warp", 2)
    with pytest.raises(ValueError, match="unknown knobs \\['num_warp'\\]"):
        settings()
    monkeypatch.delitem(TUNING, "num_warp")
    monkeypatch.delitem(TUNING, "max_splits")
    with pytest.raises(ValueError, match="missing knobs \\['max_splits'\\]"):
        settings()

"""The fused decode LoRA kernel (one launch per module) against the fp64 per-token oracle of
lora_cases.py: adapter popularity (distinct, uniform, skewed, identical, base rows), mixed ranks,
dtypes and odd sizes, at interpreter-friendly shapes on CPU (TRITON_INTERPRET=1, set by that module)."""

from __future__ import annotations

import pytest
import torch
from lora_cases import CPU_CASES, DEV, HAS_CUDA, assert_out, make_case, reference

from mmlora.backends import get_backend
from mmlora.backends.triton_fused_decode import fused_decode_add_lora

# (T, in, slice widths, R, ranks per slot, popularity, token split): decode batches, several runs of
# one adapter longer than the kernel's 16-row heads, odd widths and ranks.
CASES = {
    "distinct-qkv": (7, 64, (64, 16, 16), 16, [16, 8, 4, 16, 2, 16, 8, 1], "distinct", "decode"),
    "uniform-gateup": (19, 48, (48, 48), 8, [8, 8, 4], "uniform", "decode"),
    "zipf-odd": (41, 40, (24,), 12, [12, 1, 5, 12, 3], "zipf", "decode"),
    "identical-long-run": (37, 32, (40, 8), 16, [16, 16], "identical", "decode"),
    "base-mix-qkv": (23, 64, (64, 16, 16), 16, [16, 4, 8], "base_mix", "decode"),
    "ranks-1-to-64": (9, 32, (32, 16, 16), 64, [1, 64, 33, 7], "distinct", "decode"),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_fused_decode_matches_reference(name: str, dtype: torch.dtype) -> None:
    if dtype != torch.float32 and not HAS_CUDA and name not in ("distinct-qkv", "identical-long-run"):
        pytest.skip("interpreter: fp32 covers it")
    c = make_case(*CASES[name], dtype=dtype, seed=sum(map(ord, name)), spare_rows=2)
    _, want = reference(c)
    out0 = c.out.clone()
    get_backend("triton-fused").add_lora(c.out, c.x, c.weights, c.info)
    assert_out(c, c.out, want, out0)


def test_rows_sorted_by_adapter_give_the_same_result() -> None:
    """The graph runner sorts decode rows by slot: runs then span several heads (and blocks of 16 rows)."""
    c = make_case(*CASES["uniform-gateup"], dtype=torch.float32, seed=4)
    order = sorted(range(len(c.token_slots)), key=lambda t: c.token_slots[t])
    c.x, c.out = c.x[order].contiguous(), c.out[order].contiguous()
    c.token_slots = [c.token_slots[t] for t in order]
    for s, r in enumerate(c.ranks):
        c.info.set_slot_rank(s, r)
    c.info.fill([1] * len(order), c.token_slots)
    _, want = reference(c)
    out0 = c.out.clone()
    get_backend("triton-fused").add_lora(c.out, c.x, c.weights, c.info)
    assert_out(c, c.out, want, out0)


def test_any_batch_is_right_and_prefill_goes_to_sgmv() -> None:
    """The kernel itself is right for prefill runs too; the backend routes such batches to SGMV."""
    c = make_case(*CPU_CASES["prefill-basemix-gateup"], dtype=torch.float32, seed=9)
    _, want = reference(c)
    out0 = c.out.clone()
    fused_decode_add_lora(c.out, c.x, c.weights, c.info)
    assert_out(c, c.out, want, out0)
    assert c.info.num_tokens >= 2 * c.info.num_segments and DEV.type in ("cpu", "cuda")

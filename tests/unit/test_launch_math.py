"""The host-side launch arithmetic (``cdiv``, ``next_pow2``) equals Triton's own functions, which since
Triton 3.5 are constexpr functions with a costly host-call wrapper (mmlora.backends.triton_common)."""

from __future__ import annotations

import random

import triton

from mmlora.backends.triton_common import cdiv, next_pow2


def test_cdiv_equals_triton_cdiv() -> None:
    rng = random.Random(7)
    pairs = [(a, b) for a in range(-70, 300) for b in range(1, 70)]
    pairs += [(rng.randrange(-(1 << 40), 1 << 40), rng.randrange(1, 1 << 20)) for _ in range(2000)]
    for a, b in pairs:
        assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_next_pow2_equals_triton_for_positive_sizes() -> None:
    rng = random.Random(8)
    sizes = list(range(1, 5000)) + [rng.randrange(1, 1 << 40) for _ in range(2000)] + [1 << 40, (1 << 40) + 1]
    for n in sizes:
        assert next_pow2(n) == triton.next_power_of_2(n), n

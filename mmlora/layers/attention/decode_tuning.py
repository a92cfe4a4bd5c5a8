"""Launch settings of the Triton paged decode attention (:func:`~.triton_decode.decode_attention`) and
of its split rule (:func:`~.triton_backend.auto_num_kv_splits`).

``TUNING`` is read at every launch, so a benchmark can sweep it
(``benchmarks/scripts/decode_attention_sweep.py``). The defaults are the settings the kernels had while
they were hard-coded (up to commit d28c092). An H100 sweep of 144 settings at serving's decode shapes
(benchmarks/results/h100-2026-12-05-session31) ranked them first by geometric mean over the shapes:
others gain up to 3% at B=128 and lose up to 8.5% on serving's ragged contexts. The H200 has not swept
them. The split rule is baked into captured CUDA graphs (``auto_num_kv_splits`` per batch-size bucket),
so a changed rule takes effect at the next capture; the kernel knobs at the next launch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

#: The decode attention's launch settings (see the module doc). On an H200 at Mistral-7B heads (Hq 32,
#: Hkv 8, D 128, bf16, pages of 16), a base-only decode step at B=32 spends 969 us of its 32 layers in
#: the split kernel at about 3.3 TB/s of KV reads (copies reach 4.27 TB/s), B=72 and 128 3.4-3.7 TB/s.
TUNING: dict[str, Any] = {
    # Keys per step of the split kernel's loop: a power of two >= 16 (the width of ``tl.dot``'s inner
    # dimension). None: 64 where the head dim pads to <= 128, else 32.
    "block_n": None,
    # Warps of a split-kernel program (one request, one KV head, one slice of its context).
    "num_warps": 4,
    # Software-pipeline depth of the split kernel's key loop (1: no pipelining).
    "num_stages": 2,
    # Warps of a reduce-kernel program (one request and query head merging its splits).
    "reduce_warps": 4,
    # auto_num_kv_splits: no split shorter than this many tokens of the longest sequence ...
    "min_tokens_per_split": 256,
    # ... and enough splits to give every SM this many programs (num_seqs * Hkv * splits >= this * SMs) ...
    "occupancy_programs_per_sm": 2,
    # ... and never more splits than this.
    "max_splits": 32,
}

_WARPS = (1, 2, 4, 8, 16)
_POSITIVE = ("num_stages", "min_tokens_per_split", "occupancy_programs_per_sm", "max_splits")


class DecodeSettings(NamedTuple):
    """``TUNING`` checked: ``block_n`` None or a power of two >= 16, warps in {1, 2, 4, 8, 16}, the rest >= 1."""

    block_n: int | None
    num_warps: int
    num_stages: int
    reduce_warps: int
    min_tokens_per_split: int
    occupancy_programs_per_sm: int
    max_splits: int


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate(tuning: dict[str, Any]) -> DecodeSettings:
    """``tuning`` as :class:`DecodeSettings`; ValueError naming the knob for a missing, unknown or bad one."""
    names = set(DecodeSettings._fields)
    if set(tuning) != names:
        unknown, missing = sorted(set(tuning) - names), sorted(names - set(tuning))
        raise ValueError(f"decode attention TUNING: unknown knobs {unknown}, missing knobs {missing}")
    block_n = tuning["block_n"]
    if block_n is not None and not (_is_int(block_n) and block_n >= 16 and block_n & (block_n - 1) == 0):
        raise ValueError(
            f"decode attention TUNING['block_n'] must be None or a power of two >= 16, got {block_n!r}"
        )
    for knob in ("num_warps", "reduce_warps"):
        if not (_is_int(tuning[knob]) and tuning[knob] in _WARPS):
            raise ValueError(
                f"decode attention TUNING[{knob!r}] must be one of {_WARPS}, got {tuning[knob]!r}"
            )
    for knob in _POSITIVE:
        if not (_is_int(tuning[knob]) and tuning[knob] >= 1):
            raise ValueError(f"decode attention TUNING[{knob!r}] must be an int >= 1, got {tuning[knob]!r}")
    return DecodeSettings(**tuning)


_checked: dict[tuple[Any, ...], DecodeSettings] = {}


def settings() -> DecodeSettings:
    """The current ``TUNING``, validated once per distinct content (a dict lookup on every later launch)."""
    key = tuple(TUNING.items())
    try:
        return _checked[key]
    except KeyError:
        pass
    except TypeError:  # an unhashable value: validate says which
        return validate(TUNING)
    if len(_checked) > 64:  # a sweep tries many settings; keep the memo small
        _checked.clear()
    return _checked.setdefault(key, validate(TUNING))


def block_n_for(block_d: int, block_n: int | None) -> int:
    """Keys per step of the split kernel for a head dim padded to ``block_d``."""
    if block_n is not None:
        return block_n
    return 64 if block_d <= 128 else 32


def splits_for(num_seqs: int, num_kv_heads: int, max_seq_len: int, sms: int) -> int:
    """The split rule of ``auto_num_kv_splits`` on a device with ``sms`` SMs: enough splits to give every
    SM ``occupancy_programs_per_sm`` programs, no split shorter than ``min_tokens_per_split`` tokens of
    ``max_seq_len``, at most ``max_splits``."""
    s = settings()
    by_len = -(-max(max_seq_len, 1) // s.min_tokens_per_split)
    by_occupancy = -(-(s.occupancy_programs_per_sm * sms) // max(num_seqs * num_kv_heads, 1))
    return max(1, min(by_len, by_occupancy, s.max_splits))

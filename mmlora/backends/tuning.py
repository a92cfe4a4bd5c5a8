"""The Triton backends' launch-setting tables (each module's ``TUNING``) by name, with the step inputs'
host-copy switch (``host-copy``: :mod:`mmlora.forward.host_copy`), the shrink stage's (``stage``:
:mod:`mmlora.forward.stage_policy`), and the ``BACKEND:KNOB=JSON``
overrides that benchmark and compile-check scripts try before a setting becomes a default
(``benchmarks/scripts/with_tuning.py``, ``scripts/cuda_compile_check.py --tuning``)."""

from __future__ import annotations

import json
from typing import Any

from mmlora.backends import triton_auto, triton_bgmv, triton_fused_decode, triton_sgmv, triton_sgmv_act
from mmlora.forward import host_copy, stage_policy

TABLES: dict[str, dict[str, Any]] = {
    "triton-sgmv": triton_sgmv.TUNING,
    "triton-bgmv": triton_bgmv.TUNING,
    "triton-sgmv-act": triton_sgmv_act.TUNING,
    "triton-fused": triton_fused_decode.TUNING,
    "triton-auto": triton_auto.TUNING,
    "host-copy": host_copy.SETTINGS,
    "stage": stage_policy.SETTINGS,
}


def parse_override(spec: str) -> tuple[dict[str, Any], str, Any]:
    """(the TUNING table, knob, value) that ``BACKEND:KNOB=JSON`` names; SystemExit naming what is wrong
    for an unknown backend or knob, or a value that is not JSON."""
    backend, _, setting = spec.partition(":")
    knob, eq, value = setting.partition("=")
    expected = f"override {spec!r}: expected BACKEND:KNOB=JSON"
    if backend not in TABLES or not eq:
        raise SystemExit(f"{expected} with BACKEND one of {sorted(TABLES)}")
    table = TABLES[backend]
    if knob not in table:
        raise SystemExit(f"{expected}; {backend} has no knob {knob!r} (knobs: {sorted(table)})")
    try:
        return table, knob, json.loads(value)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"{expected}; {value!r} is not JSON ({exc})") from None

"""Issue 13: gate_up's LoRA expand and the gated activation, two kernels against one
(:mod:`mmlora.backends.triton_sgmv_act`), on the batches serving launches, per layer.

Cases (Mistral-7B gate_up, bf16, rank 16; built by ``lora_tuning_sweep._points``): decode runs B=128 and
256 on 32 adapters (as triton-auto replays decode graphs), a mixed step (128 decode rows on 32 adapters and
a 2048-token chunk; ``mixed-sorted``: the rows side by side per adapter, as eager steps order them) and a
4096-token prefill over 8 adapters. Each mode is timed through CUDA graphs over rotated adapter copies
(``mmlora.bench.kernels._time_calls``), the modes alternating, --rounds rounds:
- ``expand``: shrink, expand into gate_up, activation (three launches);
- ``fused``: shrink, then the activation with the expand inside (two).
Both include the shrink, which is the same launch. ``--variants``: more fused modes, each a JSON object of
:mod:`mmlora.backends.triton_sgmv_act` TUNING overrides (``fused:0``, ``fused:1``, ...); ``--pick-into``: write
the overrides of the variant fastest over the decode-runs cases (its worst round) to that file, for a run
that follows. ``--smoke``: tiny shapes on CPU under the interpreter.

    PYTHONPATH=. python benchmarks/scripts/act_expand_kernels.py --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lora_tuning_sweep as sweep  # noqa: E402

from mmlora.backends import get_backend, triton_sgmv_act  # noqa: E402
from mmlora.bench import kernels as kb  # noqa: E402
from mmlora.layers.fused_ops import silu_and_mul_triton  # noqa: E402

CASES = [
    ("decode-runs", 128, 32),
    ("decode-runs", 256, 32),
    ("mixed", 128, 32),
    ("mixed-sorted", 128, 32),
    ("prefill", 0, 8),
]
SMOKE_CASES = [("decode-runs", 8, 2), ("mixed-sorted", 8, 2)]


def _calls(mode: str, backend, pt) -> list:  # noqa: ANN001
    buf = pt.out.clone()

    def expand(k: int) -> None:
        backend.add_lora(buf, pt.x, pt.weights, pt.infos[k])
        silu_and_mul_triton(buf)

    def fused(k: int) -> None:
        backend.defer_lora(pt.x, pt.weights, pt.infos[k]).act_and_mul(buf, 0)

    fn = fused if mode == "fused" else expand
    return [lambda k=k: fn(k) for k in range(len(pt.infos))]


def _timed(mode: str, overrides: dict, backend, pt, device) -> float:  # noqa: ANN001
    saved = dict(triton_sgmv_act.TUNING)
    triton_sgmv_act.TUNING.update(overrides)
    for info in pt.infos:  # launch plans are kept per batch info
        info.host_derived.clear()
    try:
        return kb._time_calls(_calls(mode, backend, pt), device)[0] * 1e6
    finally:
        triton_sgmv_act.TUNING.clear()
        triton_sgmv_act.TUNING.update(saved)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", nargs="*", default=[])
    p.add_argument("--pick-into", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    kb.PROJECTIONS = {"gate_up": kb.PROJECTIONS["gate_up"]}
    kb.SMOKE_PROJECTIONS = {"gate_up": (64, (32, 32))}
    backend = get_backend("triton-sgmv")
    modes = {"expand": {}, "fused": {}}
    modes.update({f"fused:{i}": json.loads(v) for i, v in enumerate(args.variants)})
    rows = []
    for case, B, n in SMOKE_CASES if args.smoke else CASES:
        (pt,) = sweep._points(case, B, n, 16, args.smoke, device)
        row = {"case": case, "B": B, "adapters": n, "us": {m: [] for m in modes}}
        names = list(modes)
        for r in range(args.rounds):
            for mode in names[r % len(names) :] + names[: r % len(names)]:
                kernel_mode = "expand" if mode == "expand" else "fused"
                row["us"][mode].append(_timed(kernel_mode, modes[mode], backend, pt, device))
        best_expand = min(row["us"]["expand"])
        row["worst_over_best_expand"] = {m: max(v) / best_expand for m, v in row["us"].items()}
        rows.append(row)
        print(
            f"{case} B={B} adapters={n}: "
            + "; ".join(f"{m} {[round(v, 1) for v in row['us'][m]]}" for m in modes)
            + " us; worst / best expand "
            + ", ".join(f"{m} {v:.3f}" for m, v in row["worst_over_best_expand"].items()),
            flush=True,
        )
        sweep._release([pt], device)
    fused = [m for m in modes if m != "expand"]
    runs = [r for r in rows if r["case"] == "decode-runs"]
    pick = min(fused, key=lambda m: sum(max(r["us"][m]) for r in runs)) if runs else "fused"
    print(f"fastest fused variant over decode runs: {pick} {modes[pick]}", flush=True)
    if args.pick_into:
        with open(args.pick_into, "w") as f:
            json.dump(modes[pick], f)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "rows": rows,
                    "modes": modes,
                    "picked": pick,
                    "device": str(device),
                    "torch": torch.__version__,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()

"""Issue 13: each LoRA module's whole delta on the side stream (``lora_side_max_tokens``), against the
shrink alone there (the split) and against one stream, on decode graphs, in one process.

One engine (dummy Mistral-7B, bf16, 32 rank-16 adapters), decode batches of B rows at context ~512 cycling
over the adapters (B=32: BGMV rows; B >= 64: SGMV runs). For each B the decode graph of bucket B is
recaptured in three modes, in a rotating order, --rounds times: ``delta`` (shrink and expand into a zeroed
buffer on the side stream, one add on the main stream), ``side`` (the shrink there, the expand after the
base GEMM: the default before this) and ``plain`` (one stream). Each capture is timed as graph replay
(median of 5 x 20 replays) and engine steps (20). A short greedy generation per mode is compared with
``side``: same tokens, and the largest logprob difference (``delta`` rounds the delta to bf16 before adding
it, so bits may differ).

Session 13 ran it at e2e45a0, where any batch up to the limit took the delta; since then only batches of
one row per segment do (B >= 64 here are SGMV runs, so its "delta" mode now equals "side" there).

    PYTHONPATH=. python benchmarks/scripts/lora_side_ab.py --out FILE.json
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from lora_overlap_ab import engine_with_adapters, mode_rounds, recapture

import mmlora

MODES = ("delta", "side", "plain")


def set_mode(engine: mmlora.Engine, bucket: int, mode: str, side: torch.cuda.Stream) -> None:
    engine.runner.lora._ctx.side_max_tokens = bucket if mode == "delta" else 0
    recapture(engine, bucket, mode != "plain", side)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="dummy:mistral-7b-v0.3")
    p.add_argument("--batch", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--adapters", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    engine, side, adapters = engine_with_adapters(args.model, max(args.batch), args.adapters)
    rng = np.random.default_rng(0)
    rows = []
    for bsz in args.batch:
        names = [adapters[i % args.adapters]["name"] for i in range(bsz)]
        row, outs = mode_rounds(engine, side, names, MODES, set_mode, args.rounds, rng)
        row["same_tokens_as_side"] = {
            m: all(a.output_ids == b.output_ids for a, b in zip(outs[m], outs["side"])) for m in MODES
        }
        row["max_logprob_diff_vs_side"] = {
            m: max(
                (abs(x - y) for a, b in zip(outs[m], outs["side"]) for x, y in zip(a.logprobs, b.logprobs)),
                default=0.0,
            )
            for m in MODES
        }
        print(
            f"B={bsz}: same tokens as 'side': {row['same_tokens_as_side']}; largest logprob difference "
            f"{row['max_logprob_diff_vs_side']}",
            flush=True,
        )
        rows.append(row)
    with open(args.out, "w") as f:
        json.dump(
            {"model": args.model, "adapters": args.adapters, "modes": MODES, "rows": rows,
             "torch": torch.__version__, "device": torch.cuda.get_device_name()},
            f, indent=1,
        )  # fmt: skip


if __name__ == "__main__":
    main()

"""Issue 13: LoRA expands as programmatic dependent launches of their shrinks (PDL), against plain launches,
with and without the side-stream shrink, in one process.

One engine (dummy Mistral-7B, bf16, 32 rank-16 adapters), decode batches of B rows at context ~512 cycling
over the adapters (B=32: BGMV rows; B >= 64: SGMV runs). For each B the decode graph of bucket B is
recaptured in four modes, in a rotating order, --rounds times: side stream on/off x PDL on/off. (With the
side stream on, BGMV's split expand follows the base GEMM, not its shrink, so it launches plainly: PDL
then changes only SGMV.) Each capture is timed as graph replay (median of 5 x 20 replays) and engine steps
(20). Greedy tokens and logprobs of a short generation are compared across the modes (bit for bit).

    PYTHONPATH=. python benchmarks/scripts/lora_pdl_ab.py --out FILE.json
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from lora_overlap_ab import engine_with_adapters, mode_rounds, recapture, same_tokens_and_logprobs

import mmlora
from mmlora.backends import triton_bgmv, triton_sgmv

MODES = ("side", "side+pdl", "pdl", "plain")  # side: the shrink on the side stream (today's default)


def set_mode(engine: mmlora.Engine, bucket: int, mode: str, side: torch.cuda.Stream) -> None:
    for module in (triton_bgmv, triton_sgmv):
        module.TUNING["pdl"] = "pdl" in mode
    recapture(engine, bucket, mode.startswith("side"), side)


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
        row["same_tokens_and_logprobs"] = {m: same_tokens_and_logprobs(outs[m], outs["side"]) for m in MODES}
        print(f"B={bsz}: same tokens and logprobs as 'side': {row['same_tokens_and_logprobs']}", flush=True)
        rows.append(row)
    with open(args.out, "w") as f:
        json.dump(
            {"model": args.model, "adapters": args.adapters, "modes": MODES, "rows": rows,
             "torch": torch.__version__, "device": torch.cuda.get_device_name()},
            f, indent=1,
        )  # fmt: skip


if __name__ == "__main__":
    main()

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

import torch
from lora_overlap_ab import recapture, run_mode_ab, same_tokens_and_logprobs

import mmlora
from mmlora.backends import triton_bgmv, triton_sgmv

MODES = ("side", "side+pdl", "pdl", "plain")  # side: the shrink on the side stream (today's default)


def set_mode(engine: mmlora.Engine, bucket: int, mode: str, side: torch.cuda.Stream) -> None:
    for module in (triton_bgmv, triton_sgmv):
        module.TUNING["pdl"] = "pdl" in mode
    recapture(engine, bucket, mode.startswith("side"), side)


def compare(row: dict, outs: dict, names: list[str]) -> str:
    row["same_tokens_and_logprobs"] = {m: same_tokens_and_logprobs(outs[m], outs["side"]) for m in MODES}
    return f"same tokens and logprobs as 'side': {row['same_tokens_and_logprobs']}"


if __name__ == "__main__":
    run_mode_ab(MODES, set_mode, compare)

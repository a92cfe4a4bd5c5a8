"""Issue 13: o_proj's and down_proj's SGMV expand fused into the RMSNorm that reads their output
(``triton_sgmv_norm`` TUNING ``norm_expand``), against the plain expand then the norm, on decode graphs, in
one process.

One engine (dummy Mistral-7B, bf16, 32 rank-16 adapters), decode batches of B rows at context ~512 cycling
over the adapters (B >= 64: SGMV runs, where the fusion applies; B=32 replays BGMV rows, unchanged: a
control). For each B the decode graph of bucket B is recaptured in both modes, in a rotating order,
--rounds times, each timed as graph replay (median of 5 x 20 replays) and engine steps (20). A short greedy
generation per mode must give the same tokens and logprobs (the fused kernel rounds where the expand and
the norm round; a GPU's dot products may differ in their last bit, so a token may part late).

    PYTHONPATH=. python benchmarks/scripts/norm_expand_ab.py --out FILE.json
"""

from __future__ import annotations

import torch
from lora_overlap_ab import recapture, run_mode_ab, same_tokens_and_logprobs

import mmlora
from mmlora.backends import triton_sgmv_norm

MODES = ("fused", "expand")


def set_mode(engine: mmlora.Engine, bucket: int, mode: str, side: torch.cuda.Stream) -> None:
    triton_sgmv_norm.TUNING["norm_expand"] = mode == "fused"
    recapture(engine, bucket, True, side)


def compare(row: dict, outs: dict, names: list[str]) -> str:
    row["same_tokens_and_logprobs"] = same_tokens_and_logprobs(outs["fused"], outs["expand"])
    return f"fused and expand give the same tokens and logprobs: {row['same_tokens_and_logprobs']}"


if __name__ == "__main__":
    run_mode_ab(MODES, set_mode, compare, default_batch=(32, 64, 128))

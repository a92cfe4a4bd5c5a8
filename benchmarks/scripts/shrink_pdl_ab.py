"""Issue 13: SGMV's shrink as a programmatic dependent launch of the base GEMM before it
(``triton_sgmv.TUNING["shrink_pdl"]``, through ``LoRABackend.add_lora_after_base``) against a plain
launch, in decode graphs, in one process.

One engine (dummy Mistral-7B, bf16, --adapters rank-16 adapters), decode batches of B rows at context ~512
cycling over the adapters (B >= 2 x adapters: SGMV runs, which this changes; fewer rows: BGMV rows, which
it does not). For each B the decode graph of bucket B is recaptured in both modes, in a rotating order,
--rounds times, and timed as graph replay (median of 5 x 20 replays) and engine steps (20). Greedy tokens
and logprobs of a short generation are compared across the modes (bit for bit).

    PYTHONPATH=. python benchmarks/scripts/shrink_pdl_ab.py --batch 72 128 --adapters 24 --out FILE.json
"""

from __future__ import annotations

import torch
from lora_overlap_ab import recapture, run_mode_ab, same_tokens_and_logprobs

import mmlora
from mmlora.backends import triton_sgmv

MODES = ("plain", "shrink_pdl")


def set_mode(engine: mmlora.Engine, bucket: int, mode: str, side: torch.cuda.Stream) -> None:
    triton_sgmv.TUNING["shrink_pdl"] = mode == "shrink_pdl"  # launch plans are keyed by it
    recapture(engine, bucket, True, side)


def compare(row: dict, outs: dict, names: list[str]) -> str:
    row["distinct_adapters"] = len(set(names))
    row["same_tokens_and_logprobs"] = same_tokens_and_logprobs(outs["shrink_pdl"], outs["plain"])
    return f"shrink_pdl gives the plain launches' tokens and logprobs: {row['same_tokens_and_logprobs']}"


if __name__ == "__main__":
    run_mode_ab(MODES, set_mode, compare, default_batch=(72, 128))

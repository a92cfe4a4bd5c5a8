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

import torch
from lora_overlap_ab import recapture, run_mode_ab

import mmlora

MODES = ("delta", "side", "plain")


def set_mode(engine: mmlora.Engine, bucket: int, mode: str, side: torch.cuda.Stream) -> None:
    engine.runner.lora._ctx.side_max_tokens = bucket if mode == "delta" else 0
    recapture(engine, bucket, mode != "plain", side)


def compare(row: dict, outs: dict, names: list[str]) -> str:
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
    return (
        f"same tokens as 'side': {row['same_tokens_as_side']}; largest logprob difference "
        f"{row['max_logprob_diff_vs_side']}"
    )


if __name__ == "__main__":
    run_mode_ab(MODES, set_mode, compare)

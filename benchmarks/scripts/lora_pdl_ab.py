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
from lora_overlap_ab import engine_with_adapters, measure, recapture

import mmlora
from mmlora.backends import triton_bgmv, triton_sgmv
from mmlora.bench.serving_parts import abort_all, start_decode_batch

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
        rids = start_decode_batch(engine, [None] * bsz, 512, rng)
        set_mode(engine, bsz, "side", side)
        base = measure(engine)
        abort_all(engine, rids)
        rids = start_decode_batch(engine, names, 512, rng)
        row = {
            "batch": bsz,
            "base_replay_ms": base["replay_ms"],
            "base_step_ms": base["step_ms"],
            "rounds": [],
        }
        for r in range(args.rounds):
            got = {}
            for mode in MODES[r % 4 :] + MODES[: r % 4]:
                set_mode(engine, bsz, mode, side)
                got[mode] = measure(engine)
            row["rounds"].append(got)
            print(
                f"B={bsz} round {r + 1}: replay "
                + ", ".join(f"{m} {got[m]['replay_ms']:.3f}" for m in MODES)
                + f" ms (base-only {base['replay_ms']:.3f}); step "
                + ", ".join(f"{m} {got[m]['step_ms']:.2f}" for m in MODES)
                + f" ms; key {got['side']['key']}",
                flush=True,
            )
        abort_all(engine, rids)
        prompts = [rng.integers(0, engine.model.arch.vocab_size, 64).tolist() for _ in range(bsz)]
        sp = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
        outs = {}
        for mode in MODES:
            set_mode(engine, bsz, mode, side)
            engine.flush_cache()
            outs[mode] = engine.generate(
                input_ids=prompts, lora_paths=names, sampling_params=sp, return_logprob=True
            )
        row["same_tokens_and_logprobs"] = {
            m: all(
                a.output_ids == b.output_ids and a.logprobs == b.logprobs
                for a, b in zip(outs[m], outs["side"])
            )
            for m in MODES
        }
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

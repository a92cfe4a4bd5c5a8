"""Issue 13, base-only decode over its floor: the base linears' weights column-major (each [out, in]
parameter a view of its contiguous transpose, ``mmlora.layers.packed_linear.set_weight_layout``) against
today's row-major weights, in real decode graphs of one engine.

Session 31's probe on an H100 had ``x @ Wt`` with a contiguous [in, out] weight at 0.93-1.01x the time of
``F.linear`` at Mistral-7B's decode shapes (benchmarks/results/h100-2026-12-05-session31). This asks
whether whole decode steps gain too: one engine (dummy Mistral-7B, bf16, --adapters rank-16 adapters),
decode batches of B rows at context ~512, base-only and on adapters (rows cycling over them). For each
batch the decode graph of bucket B is recaptured in each layout, in an order rotating each round, and timed
as graph replay (median of 5 x 20) and engine steps. Mixed-step graphs are dropped at the first switch
(they hold the old weights), so prefills run eagerly. Then the greedy tokens and logprobs of a short
generation in each layout (cuBLAS may pick other kernels, so bits may differ; the largest difference is
reported).

    PYTHONPATH=.:benchmarks/scripts python benchmarks/scripts/weight_layout_ab.py --batch 32 72 128 --out FILE.json
"""

from __future__ import annotations

import numpy as np
import torch
from lora_overlap_ab import ab_setup, measure, recapture, write_ab

import mmlora
from mmlora.bench.serving_parts import abort_all, start_decode_batch
from mmlora.layers.packed_linear import set_weight_layout

MODES = ("rowmajor", "colmajor")


def set_mode(engine: mmlora.Engine, bucket: int, mode: str, side: torch.cuda.Stream) -> int:
    changed = set_weight_layout(engine.model, mode == "colmajor")
    if engine.runner.mixed_graphs is not None:
        engine.runner.mixed_graphs.close()
        engine.runner.mixed_graphs = None
    recapture(engine, bucket, True, side)
    return changed


def main() -> None:
    args, engine, side, adapters = ab_setup((32, 72, 128), default_adapters=24)
    rng = np.random.default_rng(0)
    rows = []
    for bsz in args.batch:
        for lora in (False, True):
            names = [adapters[i % args.adapters]["name"] for i in range(bsz)] if lora else [None] * bsz
            rids = start_decode_batch(engine, names, 512, rng)
            row = {"batch": bsz, "lora": lora, "rounds": []}
            for r in range(args.rounds):
                order = MODES[r % 2 :] + MODES[: r % 2]
                got = {}
                for mode in order:
                    changed = set_mode(engine, bsz, mode, side)
                    got[mode] = {**measure(engine), "weights_changed": changed}
                row["rounds"].append({"order": list(order), **got})
                ratio = got["colmajor"]["replay_ms"] / got["rowmajor"]["replay_ms"]
                print(
                    f"B={bsz} {'lora' if lora else 'base'} round {r + 1} ({', '.join(order)}): replay rowmajor "
                    f"{got['rowmajor']['replay_ms']:.3f} colmajor {got['colmajor']['replay_ms']:.3f} ms "
                    f"({ratio:.3f}x); step {got['rowmajor']['step_ms']:.2f} / {got['colmajor']['step_ms']:.2f} ms",
                    flush=True,
                )
            abort_all(engine, rids)
            rows.append(row)
    prompts = [rng.integers(0, engine.model.arch.vocab_size, 64).tolist() for _ in range(16)]
    names = [adapters[i % args.adapters]["name"] for i in range(16)]
    sp = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    outs = {}
    for mode in MODES:
        set_mode(engine, 16, mode, side)
        engine.flush_cache()
        outs[mode] = engine.generate(
            input_ids=prompts, lora_paths=names, sampling_params=sp, return_logprob=True
        )
    a, b = outs["rowmajor"], outs["colmajor"]
    check = {
        "same_tokens": all(x.output_ids == y.output_ids for x, y in zip(a, b)),
        "max_logprob_diff": max(abs(u - v) for x, y in zip(a, b) for u, v in zip(x.logprobs, y.logprobs)),
    }
    print(f"colmajor against rowmajor: {check}", flush=True)
    write_ab(args, {"rows": rows, "check": check})


if __name__ == "__main__":
    main()

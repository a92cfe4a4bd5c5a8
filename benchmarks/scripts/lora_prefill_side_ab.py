"""Issue 13: the SGMV shrink of prefill batches on the side stream beside the base GEMM (SGMV's
``TUNING["side_min_tokens"]``), against the whole LoRA after the GEMM on one stream, in one process.

One engine (dummy Mistral-7B, bf16, --adapters adapters of --rank, 32 of rank 16 by default). For each configuration (prompts x prompt
length, at most max_num_batched_tokens = 2048 in all, adapters cycled over the prompts) one prefill forward
is timed in each mode, in rotating order, --rounds times. The GPU time of the forward alone: a long GPU sleep is queued first, so the host has launched the
whole forward before the GPU reaches it; CUDA events around the forward then time the GPU's work, not the
host's launches (the host time is recorded beside it, and must stay under the sleep). The greedy first
tokens and their logprobs must be identical across the modes (same kernels; only the streams differ).

    PYTHONPATH=. python benchmarks/scripts/lora_prefill_side_ab.py --out FILE.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from lora_overlap_ab import engine_with_adapters, write_ab

from mmlora.backends import triton_sgmv

MODES = ("side", "main")
SLEEP_CYCLES = 400_000_000  # ~0.2 s at the H200's clock: longer than launching one forward


def timed_prefill(engine, prompts: list[list[int]], names: list[str]) -> tuple[float, float, list]:  # noqa: ANN001
    """(GPU ms, host ms) of the prefill forward of one generate call of one new token, and its outputs."""
    runner = engine.runner
    recorded = runner.forward
    got = []

    def forward(sched):  # noqa: ANN001, ANN202
        if got:
            return recorded(sched)
        torch.cuda._sleep(SLEEP_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        out = recorded(sched)
        host = time.perf_counter() - t0
        end.record()
        got.append((start, end, host))
        return out

    runner.forward = forward
    try:
        outs = engine.generate(
            input_ids=prompts,
            lora_paths=names,
            sampling_params={"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True},
            return_logprob=True,
        )
    finally:
        del runner.forward
    start, end, host = got[0]
    end.synchronize()
    return start.elapsed_time(end), host * 1e3, [(o.output_ids, o.logprobs) for o in outs]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="dummy:mistral-7b-v0.3")
    p.add_argument("--adapters", type=int, default=32)
    p.add_argument("--configs", nargs="+", default=["32x32", "16x128", "4x512"], help="PROMPTSxLENGTH")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rank", type=int, default=16, help="the adapters' rank, and the pool's")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    engine, _side, adapters = engine_with_adapters(args.model, 64, args.adapters, args.rank)
    rng = np.random.default_rng(0)
    original = triton_sgmv.TUNING["side_min_tokens"]
    default = original or 512  # the threshold under test (off by default since this A/B)
    rows = []
    for config in args.configs:
        n, length = (int(v) for v in config.split("x"))
        prompts = [rng.integers(0, engine.model.arch.vocab_size, length).tolist() for _ in range(n)]
        names = [adapters[i % args.adapters]["name"] for i in range(n)]
        timed_prefill(engine, prompts, names)  # warm-up: slot loads, compiles
        got: dict[str, list] = {m: [] for m in MODES}
        outputs = {}
        for r in range(args.rounds):
            for mode in MODES[r % 2 :] + MODES[: r % 2]:
                triton_sgmv.TUNING["side_min_tokens"] = default if mode == "side" else 1 << 30
                engine.flush_cache()
                gpu_ms, host_ms, outputs[mode] = timed_prefill(engine, prompts, names)
                got[mode].append({"gpu_ms": gpu_ms, "host_ms": host_ms})
        triton_sgmv.TUNING["side_min_tokens"] = original
        row = {
            "config": config,
            "tokens": n * length,
            "rounds": got,
            "median_gpu_ms": {m: statistics.median(x["gpu_ms"] for x in got[m]) for m in MODES},
            "worst_gpu_ms": {m: max(x["gpu_ms"] for x in got[m]) for m in MODES},
            "max_host_ms": max(x["host_ms"] for m in MODES for x in got[m]),
            "same_tokens_and_logprobs": outputs["side"] == outputs["main"],
        }
        rows.append(row)
        print(
            f"{config} ({n * length} tokens): GPU ms side {[round(x['gpu_ms'], 3) for x in got['side']]}, "
            f"main {[round(x['gpu_ms'], 3) for x in got['main']]}; median side/main "
            f"{row['median_gpu_ms']['side'] / row['median_gpu_ms']['main']:.3f}; host up to "
            f"{row['max_host_ms']:.1f} ms; same tokens and logprobs {row['same_tokens_and_logprobs']}",
            flush=True,
        )
    write_ab(args, {"side_min_tokens": default, "rows": rows})


if __name__ == "__main__":
    main()

"""Issue 21: a CPU prefill step with its attention through the in-place C kernel (each prompt token a row)
against the batched torch path, interleaved call by call; SmolLM2-135M, 640 prompt tokens in prompts of 40,
128 and 256 tokens, mixed adapters (``cpu_decode_step.py``'s setup), fp32 and bf16. Prints the median ms of
each and their ratio; ``mmlora.layers.attention.torch_ref.PREFILL_IN_PLACE_MAX_KEYS`` is set from it.

    PYTHONPATH=. python benchmarks/scripts/cpu_prefill_attention_ab.py
"""

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_decode_step  # noqa: E402

from mmlora.layers.attention import torch_ref  # noqa: E402


def main() -> None:
    for ctx in (40, 128, 256):
        for dt in ("float32", "bfloat16"):
            prompts = max(1, 640 // ctx)
            argv = ["--dtype", dt, "--prefill", "--context", str(ctx), "--batch", str(prompts)]
            engine, batch, mixed, _ = cpu_decode_step.setup(cpu_decode_step.parse(argv))
            ways = (("c", 1 << 16), ("torch", 0))
            res: dict[str, list[float]] = {name: [] for name, _ in ways}
            saved = torch_ref.PREFILL_IN_PLACE_MAX_KEYS
            try:
                with torch.inference_mode():
                    for _, limit in ways:  # warm-up
                        torch_ref.PREFILL_IN_PLACE_MAX_KEYS = limit
                        engine.runner.run_batch(batch, mixed)
                    for _ in range(4):
                        for name, limit in ways:
                            torch_ref.PREFILL_IN_PLACE_MAX_KEYS = limit
                            t0 = time.perf_counter()
                            engine.runner.run_batch(batch, mixed)
                            res[name].append(time.perf_counter() - t0)
            finally:
                torch_ref.PREFILL_IN_PLACE_MAX_KEYS = saved
            c, t = statistics.median(res["c"]), statistics.median(res["torch"])
            print(f"{prompts} prompts of {ctx} tokens, {dt}: C kernel {c * 1e3:.0f} ms, torch {t * 1e3:.0f} ms, "
                  f"ratio {c / t:.3f}", flush=True)  # fmt: skip
            engine.close()


if __name__ == "__main__":
    main()

"""The C panel GEMM (:mod:`mmlora.backends.cpu_gemm`) against oneDNN's prepacked matmul in the CPU decode
forward (issue 21): two engines in one process, one packed for each (``onednn.PANEL_GEMM``), their forwards
on the same step alternating call by call. The step is :mod:`cpu_decode_step`'s (16 rows on four rank-8
adapters and the base at ``--context``, or ``--prefill``), routed mixed and base-only; prints per round the
median ms of each and checks that both give the same hidden states (to fp32 rounding).

    PYTHONPATH=. python benchmarks/scripts/cpu_gemm_ab.py [--dtype bfloat16] [--rounds 3] [--out F]
"""

import json
import statistics
import sys
import time

import torch

sys.path.insert(0, "benchmarks/scripts")
import cpu_decode_step as step  # noqa: E402

from mmlora.backends import onednn  # noqa: E402


def main() -> None:
    args = step.parse()
    systems = {}
    for name, panel in (("onednn", False), ("panel", True)):
        onednn.PANEL_GEMM = panel
        systems[name] = step.setup(args)
    onednn.PANEL_GEMM = True
    kinds = [(f"{r}-{n}", systems[n], r) for n in systems for r in ("mixed", "base")]
    res: dict[str, list[float]] = {k: [] for k, _, _ in kinds}
    with torch.inference_mode():
        outs = {}
        for name, (engine, batch, mixed, base), r in kinds:
            for _ in range(3):
                outs[name] = engine.runner.run_batch(batch, mixed if r == "mixed" else base).clone()
        for r in ("mixed", "base"):
            a, b = outs[f"{r}-onednn"], outs[f"{r}-panel"]
            print(
                f"{r}: max |panel - onednn| {float((a - b).abs().max()):.2e} (max |h| {float(a.abs().max()):.1f})"
            )
        for rnd in range(args.rounds):
            times: dict[str, list[float]] = {k: [] for k, _, _ in kinds}
            for _ in range(args.calls):
                for name, (engine, batch, mixed, base), r in kinds:
                    t0 = time.perf_counter()
                    engine.runner.run_batch(batch, mixed if r == "mixed" else base)
                    times[name].append(time.perf_counter() - t0)
            for k, v in times.items():
                res[k].append(1e3 * statistics.median(v))
            print(f"round {rnd}: " + ", ".join(f"{k} {v[-1]:.2f} ms" for k, v in res.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**vars(args), "median_ms": res}, f, indent=2)


if __name__ == "__main__":
    main()

"""Host (launch) time of one eager LoRA add per backend, against a base GEMM, at decode / mixed / prefill
layouts of Mistral-7B's qkv (after ../shared/tools/launch_overhead.py).

Per backend: host us per call with no sync in the loop (what an eager forward pays per module), the same
for the backend's launches alone (``_fused``: validation skipped), wall us and GPU us per call.
Usage (on a GPU, from the project root): python benchmarks/scripts/lora_host_overhead.py OUT.json
"""

from __future__ import annotations

import json
import sys
import time

import torch

from mmlora.backends import get_backend
from mmlora.forward import LoRABatchInfo, LoRAWeights


def per_call(fn, n: int = 300) -> tuple[float, float, float]:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / n
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    e0.record()
    for _ in range(n):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return host * 1e6, wall * 1e6, e0.elapsed_time(e1) / n * 1e3


def layout_rows(name, lens, slots, A, B, sc, W, offs) -> list[dict]:  # noqa: ANN001
    dev, dt = A.device, A.dtype
    S, R = A.shape[0], B.shape[2]
    T = sum(lens)
    info = LoRABatchInfo(T, S, dev)
    for s in range(S):
        info.set_slot_rank(s, R)
    info.fill(lens, slots)
    x = torch.randn(T, A.shape[2], device=dev).to(dt)
    out = torch.zeros(T, B.shape[1], device=dev, dtype=dt)
    weights = LoRAWeights(A, B, sc, offs)
    host, wall, gpu = per_call(lambda: torch.matmul(x, W.t()))
    rows = [{"layout": name, "what": "base-gemm", "host_us": host, "wall_us": wall, "gpu_us": gpu}]
    for bname in ("triton-bgmv", "triton-sgmv", "triton-auto", "torch-gather"):
        b = get_backend(bname)
        host, wall, gpu = per_call(lambda b=b: b.add_lora(out, x, weights, info))
        row = {"layout": name, "what": bname, "host_us": host, "wall_us": wall, "gpu_us": gpu}
        inner = b.pick(info) if hasattr(b, "pick") else b
        if hasattr(inner, "_fused"):
            row["launch_only_host_us"] = per_call(lambda f=inner._fused: f(out, x, weights, info, R))[0]
        rows.append(row)
        print(row, flush=True)
    return rows


def main(path: str) -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    in_f, R, S = 4096, 16, 32
    offs = (0, 4096, 5120, 6144)
    out_f = offs[-1]
    A = (torch.randn(S, 3 * R, in_f, device=dev) / 64).to(dt)
    B = (torch.randn(S, out_f, R, device=dev) / 4).to(dt)
    sc = torch.full((S, 3), 2.0, device=dev)
    W = (torch.randn(out_f, in_f, device=dev) / 64).to(dt)
    layouts = [
        ("decode 32 rows / 32 adapters", [1] * 32, list(range(32))),
        ("mixed: 40 decode rows + 1 chunk of 2048", [1] * 40 + [2048], [i % 32 for i in range(40)] + [5]),
        ("prefill 4 x 512", [512] * 4, [0, 1, 2, 3]),
    ]
    rows = [r for name, lens, slots in layouts for r in layout_rows(name, lens, slots, A, B, sc, W, offs)]
    with open(path, "w") as f:
        json.dump(
            {
                "command": " ".join(sys.argv),
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "rows": rows,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main(sys.argv[1])

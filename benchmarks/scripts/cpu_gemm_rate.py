"""The rate of SmolLM2's decode GEMMs on this CPU, fp32 against bf16 (issue 21): each module's packed oneDNN
matmul (the path a CPU decode step takes, LoRA shrink columns stacked under the base weight as with four
rank-8 adapters) at 16 rows, its weight hot in cache, and the lm_head (tied embedding, 49,152 x 576)
streamed. Prints us per call, GFLOP/s and GB/s of weights: whether a decode step is bound by FLOPs or bytes.

    PYTHONPATH=. python benchmarks/scripts/cpu_gemm_rate.py
"""

import time

import torch

from mmlora.backends.onednn import pack_weight, packed_matmul

ROWS = 16
#: (in, out) of qkv, gate_up, down (each with 4 x rank 8 x slices of shrink columns) and the lm_head.
SHAPES = [(576, 576 + 2 * 192 + 4 * 8 * 3), (576, 2 * 1536 + 4 * 8 * 2), (1536, 576 + 4 * 8), (576, 49152)]

torch.manual_seed(0)
print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {ROWS} rows")
for dtype in (torch.float32, torch.bfloat16):
    for k, n in SHAPES:
        w = torch.randn(n, k, dtype=dtype) * 0.02
        packed = pack_weight(w, ROWS)
        x = torch.randn(ROWS, k, dtype=dtype)
        for _ in range(10):
            packed_matmul(x, packed)
        calls = 200 if n < 10_000 else 20
        t0 = time.perf_counter()
        for _ in range(calls):
            packed_matmul(x, packed)
        sec = (time.perf_counter() - t0) / calls
        flops, nbytes = 2 * ROWS * k * n, w.numel() * w.element_size()
        print(
            f"{str(dtype):15s} in {k:5d} out {n:6d}: {sec * 1e6:8.1f} us  "
            f"{flops / sec / 1e9:6.1f} GFLOP/s  {nbytes / sec / 1e9:5.1f} GB/s"
        )

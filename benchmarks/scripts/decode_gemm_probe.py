"""Issue 13, base-only decode over its floor: can a decode step's base GEMMs read their weights faster
than cuBLAS does at serving's batch sizes?

Session 27's profile of a base-only decode graph (B=32) had cuBLAS's nvjet kernels reading qkv at 3.05
TB/s, o at 2.6-3.0 (split-K and its reduce), down at 3.5-3.75 and gate_up at 3.9 TB/s, against 4.27 TB/s
of copy bandwidth; the GEMMs are 3.99 of the step's 5.51 ms. This probe times, per Mistral-7B projection
and batch M, in CUDA graphs (20 calls a capture, median of 30 replays: ``mmlora.bench.attention.time_graph``):

- ``linear``: ``F.linear(x, W)`` with W [N, K] (today's path);
- ``mm_t``: ``x @ Wt`` with Wt a contiguous [K, N] copy (cuBLAS picks other kernels for that layout);
- ``triton``: a plain Triton skinny GEMM (whole M in one tile, W streamed once, optional split-K with
  fp32 partials summed by torch), over a handful of launch configs; the best is reported.

Each variant's output is checked against ``linear`` (bf16 tolerance). Rows are written as JSON with the
bytes each call must move and the TB/s it reaches. CUDA only.

Usage: PYTHONPATH=$PWD python benchmarks/scripts/decode_gemm_probe.py --out gemm.json [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone

import torch
import triton
import triton.language as tl

from mmlora.bench.attention import time_graph

#: Mistral-7B v0.3 projections: name -> (N, K).
SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (32768, 4096),
}
#: (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages)
CONFIGS = [
    (64, 128, 1, 4, 4),
    (32, 256, 1, 4, 4),
    (64, 256, 1, 4, 3),
    (128, 128, 1, 8, 4),
    (32, 128, 2, 4, 5),
    (64, 128, 2, 4, 4),
    (64, 64, 4, 4, 6),
    (128, 64, 2, 4, 4),
]


@triton.jit
def _skinny_gemm(
    x_ptr, w_ptr, out_ptr, M, K, stride_xm, stride_wn, stride_os, stride_om, K_PER_SPLIT,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[split, m, n] = sum over this split's K range of x[m, k] * w[n, k] (N, K multiples of the tiles)."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k0 = split * K_PER_SPLIT
    for k in range(k0, tl.minimum(k0 + K_PER_SPLIT, K), BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None], other=0.0)
        b = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None])
        acc += tl.dot(a, b)
    dst = out_ptr + split * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])


def triton_linear(x: torch.Tensor, w: torch.Tensor, config: tuple[int, ...]) -> torch.Tensor:
    block_n, block_k, split_k, warps, stages = config
    M, K = x.shape
    N = w.shape[0]
    block_m = max(16, triton.next_power_of_2(M))
    k_per = triton.cdiv(K, split_k * block_k) * block_k
    if split_k == 1:
        out = torch.empty(1, M, N, device=x.device, dtype=x.dtype)
    else:
        out = torch.empty(split_k, M, N, device=x.device, dtype=torch.float32)
    _skinny_gemm[(N // block_n, split_k)](
        x, w, out, M, K, x.stride(0), w.stride(0), out.stride(0), out.stride(1), k_per,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out[0] if split_k == 1 else out.sum(0).to(x.dtype)


def probe(batches: list[int], rounds: int, budget_s: float) -> list[dict]:
    dev = torch.device("cuda")
    t0 = time.monotonic()
    rows = []
    for name, (N, K) in SHAPES.items():
        g = torch.Generator(device=dev).manual_seed(0)
        w = (torch.randn(N, K, device=dev, generator=g) / K**0.5).to(torch.bfloat16)
        wt = w.t().contiguous()
        for M in batches:
            x = torch.randn(M, K, device=dev, generator=g).to(torch.bfloat16)
            want = torch.nn.functional.linear(x, w)
            nbytes = (N * K + M * K + M * N) * 2
            variants: dict[str, object] = {
                "linear": lambda x=x, w=w: torch.nn.functional.linear(x, w),
                "mm_t": lambda x=x, wt=wt: x @ wt,
            }
            for c in CONFIGS:
                if N % c[0] == 0 and K % c[1] == 0:
                    variants["triton" + "/".join(map(str, c))] = lambda c=c, x=x, w=w: triton_linear(x, w, c)
            for r in range(rounds):
                if time.monotonic() - t0 > budget_s:
                    print(f"budget of {budget_s:.0f} s spent: stopping", flush=True)
                    return rows
                timed = []
                for variant, fn in variants.items():
                    row = {"shape": name, "N": N, "K": K, "M": M, "round": r + 1, "variant": variant}
                    try:
                        err = (fn().float() - want.float()).abs().max().item()
                        us = time_graph(fn, iters=30, repeat=20) * 1e3
                        row.update(us=round(us, 2), tb_per_s=round(nbytes / us / 1e6, 3), max_abs_diff=err)
                        row["ok"] = err <= 0.05
                    except Exception as e:  # a config that cannot launch here (shared memory, ...)
                        row.update(error=f"{type(e).__name__}: {str(e)[:200]}")
                    timed.append(row)
                rows += timed
                best = {}
                for row in timed:
                    if row.get("ok"):
                        kind = "triton" if row["variant"].startswith("triton") else row["variant"]
                        if kind not in best or row["us"] < best[kind]["us"]:
                            best[kind] = row
                line = "  ".join(f"{k} {v['us']:.1f} us {v['tb_per_s']:.2f} TB/s" for k, v in best.items())
                tri = best.get("triton", {}).get("variant", "-")
                print(f"{name:8s} M={M:4d} round {r + 1}: {line}  (best triton {tri})", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, nargs="+", default=[32, 72, 128])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=120.0)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_gemm_probe.py needs a CUDA device")
    rows = probe(args.batch, args.rounds, args.budget_s)
    result = {
        "benchmark": "decode-shape GEMMs: F.linear vs x @ Wt vs a Triton skinny GEMM (Mistral-7B, bf16)",
        "command": " ".join(sys.argv),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

"""What ``torch.compile`` (inductor, CPU) costs and gives for one small decode-step op, against the torch
reference and the C kernel of :mod:`mmlora.backends.cpu_kernels` (issue 21, session 12).

One RMSNorm with the residual add at SmolLM2's decode shape ([16, 576], fp32): the first compiled call
(inductor builds and compiles C++ with the system compiler), then microseconds per call of the compiled
function, the torch reference (``fused_ops.rms_norm_ref``) and the C kernel, each timed over 2,000 calls.

    PYTHONPATH=. python benchmarks/scripts/cpu_compile_probe.py [--out F]
"""

import argparse
import json
import shutil
import time

import torch

from mmlora.backends import cpu_kernels
from mmlora.layers.fused_ops import rms_norm_ref


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    x, r, w = torch.randn(16, 576), torch.randn(16, 576), torch.rand(576) + 0.5
    res: dict = {"compiler": shutil.which("c++") or shutil.which("g++"), "threads": torch.get_num_threads()}
    t0 = time.perf_counter()
    compiled = torch.compile(lambda x, r: rms_norm_ref(x, w, 1e-5, 0.0, r), dynamic=False)
    with torch.no_grad():
        compiled(x, r)
    res["first_compiled_call_s"] = time.perf_counter() - t0
    variants = {
        "compiled": lambda: compiled(x, r),
        "torch_ref": lambda: rms_norm_ref(x, w, 1e-5, 0.0, r),
        "c_kernel": lambda: cpu_kernels.rms_norm_unchecked(x, w, 1e-5, r),
    }
    with torch.no_grad():
        for name, fn in variants.items():
            for _ in range(50):
                fn()
            t0 = time.perf_counter()
            for _ in range(2000):
                fn()
            res[f"{name}_us_per_call"] = (time.perf_counter() - t0) / 2000 * 1e6
    print(json.dumps(res, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()

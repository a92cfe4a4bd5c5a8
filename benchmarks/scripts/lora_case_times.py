"""Graph-replayed add_lora time (four Mistral-7B projections, rank 16) of four decode cases, twice: the
same measurement on any version of the code that has ``lora_tuning_sweep._points`` (a regression check
between commits). ``--sgmv`` / ``--bgmv``: JSON overrides of the backends' TUNING.

    PYTHONPATH=. python benchmarks/scripts/lora_case_times.py [--sgmv '{"pdl": false}']
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks", "scripts"))
import lora_tuning_sweep as sweep  # noqa: E402

from mmlora.backends import get_backend, triton_bgmv, triton_sgmv  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--sgmv", default="{}")
p.add_argument("--bgmv", default="{}")
args = p.parse_args()
triton_sgmv.TUNING.update(json.loads(args.sgmv))
triton_bgmv.TUNING.update(json.loads(args.bgmv))
device = torch.device("cuda")
for case, B, n, name in [
    ("decode-runs", 128, 32, "triton-sgmv"),
    ("decode-rows", 32, 32, "triton-bgmv"),
    ("decode-rows", 128, 32, "triton-bgmv"),
    ("decode-rows", 128, 128, "triton-bgmv"),
]:
    points = sweep._points(case, B, n, 16, False, device)
    backend = get_backend(name)
    times = []
    for _ in range(2):
        secs, nbytes = sweep._time(backend, points, device)
        times.append(round(secs * 1e6, 1))
    print(f"{case} B={B} adapters={n} {name}: {times} us, {nbytes / min(times) * 1e-3:.0f} GB/s", flush=True)
    sweep._release(points, device)

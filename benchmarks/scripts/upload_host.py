"""Host time of ``LoRAPool.write_slot`` through the staged path (issue 13, uploads): Mistral-7B's module
structure (32 layers x 4 packed modules, 7 targets) at tiny widths, so the copies cost almost nothing and
what is left is the per-upload Python and dispatch work. CPU; prints the median of 7 uploads per pool rank.

    PYTHONPATH=. python benchmarks/scripts/upload_host.py
"""

import time

import torch

from mmlora.forward.lora import LoRABatchInfo
from mmlora.lora.adapter import LoadedAdapter, LoRAModuleWeights
from mmlora.lora.pool import LoRAPool
from mmlora.lora.spec import LoRAModelSpec, LoRATarget
from mmlora.lora.staging import flatten as _flatten

W = 16
SPEC = LoRAModelSpec(
    num_layers=32,
    targets=(
        LoRATarget("qkv_proj", ("q_proj", "k_proj", "v_proj"), W, (W, W, W)),
        LoRATarget("o_proj", ("o_proj",), W, (W,)),
        LoRATarget("gate_up_proj", ("gate_proj", "up_proj"), W, (W, W)),
        LoRATarget("down_proj", ("down_proj",), W, (W,)),
    ),
    layers_prefix="model.layers",
    module_parents={
        m: "x" for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    },
)
r = 16
weights = {}
for layer in range(32):
    for t in SPEC.targets:
        n = len(t.slices)
        weights[(layer, t.name)] = LoRAModuleWeights(
            A=tuple(torch.randn(r, W, dtype=torch.bfloat16) for _ in range(n)),
            B=tuple(torch.randn(W, r, dtype=torch.bfloat16) for _ in range(n)),
            scalings=(2.0,) * n,
        )
ad = _flatten(LoadedAdapter(path="x", rank=r, weights=weights, config={}, nbytes=0), pin=False)
for R in (16, 64):
    info = LoRABatchInfo(16, 4, "cpu")
    pool = LoRAPool(SPEC, 4, R, None, torch.bfloat16, torch.device("cpu"), info.set_slot_rank)
    for _ in range(3):
        pool.write_slot(1, ad)
    ts = []
    for _ in range(7):
        t0 = time.perf_counter()
        pool.write_slot(1, ad)
        ts.append(time.perf_counter() - t0)
    print(f"pool rank {R}, adapter rank {r}: write_slot host {sorted(ts)[3] * 1e3:.2f} ms (median of 7)")

"""Issue 13 item 5 on any machine: the host time of a decode step, the forward stubbed out.

A tiny Llama checkpoint with a real (byte-level BPE) tokenizer (``tests/tiny_models.py``), B requests
decoding at context ~200 through the CUDA-graph runner's static-buffer path (``capture=False``), whose
forward is replaced by a fixed logits tensor: what is left is the engine's own work per step (schedule,
inputs, sampling, detokenizing, outputs). A/B of the detokenizer's decode: the tokenizer's ``decode``
against :func:`mmlora.engine.detokenizer.ids_decoder`'s, alternating, ``--rounds`` times, in one process.

    PYTHONPATH=.:tests python benchmarks/scripts/host_step_cpu.py [--batch 128] [--out FILE.json]
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tiny_models import make_checkpoint

import mmlora
from mmlora.bench.serving_parts import start_decode_batch

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=128)
p.add_argument("--rounds", type=int, default=2)
p.add_argument("--steps", type=int, default=200)
p.add_argument("--out", default=None)
args = p.parse_args()
base = make_checkpoint(Path(tempfile.mkdtemp()) / "base", "llama")
B = args.batch
engine = mmlora.Engine(
    model=str(base), max_running_requests=B, max_model_len=512, dtype="float32", block_size=16,
    max_kv_tokens=B * 512, device="cpu",
)  # fmt: skip
engine.runner.enable_cuda_graphs(B, engine.max_model_len, capture=False)
start_decode_batch(engine, [None] * B, 200, np.random.default_rng(0))
logits = torch.randn(B, engine.model.lm_head.weight.shape[0])
engine.runner.decode_graphs._replay = lambda bs, bound, layout: logits[:bs]  # the forward stubbed out
tok = engine.tokenizer
decoders = {
    "tokenizer.decode": lambda ids, skip, spaces: tok.decode(
        ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces
    ),
    "ids_decoder": engine._decode_ids,
}
for _ in range(5):
    engine.step()
rows = []
for r in range(args.rounds):
    order = list(decoders) if r % 2 == 0 else list(reversed(decoders))
    for name in order:
        engine._decode_ids = decoders[name]
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        ms = (time.perf_counter() - t0) / args.steps * 1e3
        rows.append({"round": r + 1, "decode": name, "host_ms_per_step": ms})
        print(f"round {r + 1}: {name:17s} {ms:.3f} ms of host time per decode step (B={B})", flush=True)
if args.out:
    Path(args.out).write_text(json.dumps({"batch": B, "torch": torch.__version__, "rows": rows}, indent=1))

"""Issue 13 item 5: the engine's decode step with the overlap scheduler on and off, against its graph
replay, in one process. For each round, batch size and adapter mix, both settings run back to back (the
order alternating by round) on a fresh decode batch: 3 untimed steps, then ``--steps`` timed ones.

    PYTHONPATH=. python benchmarks/scripts/overlap_ab.py --out overlap_ab.json [--batch 32 128] [--adapters 32]
"""

import argparse
import json
import tempfile
import time

import numpy as np
import torch

import mmlora
from mmlora.bench.adapters import write_random_adapters
from mmlora.bench.serving_parts import abort_all, mean_step_seconds, start_decode_batch, time_graph_replay

p = argparse.ArgumentParser()
p.add_argument("--model", default="dummy:mistral-7b-v0.3")
p.add_argument("--batch", type=int, nargs="+", default=[32, 128])
p.add_argument("--context", type=int, default=768)
p.add_argument("--steps", type=int, default=30)
p.add_argument("--rounds", type=int, default=2)
p.add_argument(
    "--adapters", type=int, default=32, help="LoRA rows cycle over this many random rank-16 adapters"
)
p.add_argument("--out", required=True)
args = p.parse_args()
made = write_random_adapters(args.model.removeprefix("dummy:"), tempfile.mkdtemp(), args.adapters, [16])
paths = {m["name"]: m["path"] for m in made}
engine = mmlora.Engine(
    model=args.model, lora_paths=paths, max_loras_per_batch=max(8, args.adapters), max_lora_rank=16,
    max_running_requests=max(args.batch), max_model_len=4096,
)  # fmt: skip
engine.tokenizer = None  # as the serving benchmark (its requests are random ids)
rng = np.random.default_rng(0)
rows = []
for rnd in range(args.rounds):
    for bsz in args.batch:
        for lora in (False, True):
            names = [list(paths)[i % args.adapters] if lora else None for i in range(bsz)]
            order = (True, False) if rnd % 2 == 0 else (False, True)
            for overlap in order:
                assert engine._inflight is None
                engine.overlap = overlap  # safe between batches: nothing is in flight
                rids = start_decode_batch(engine, names, args.context, rng)
                step_ms = mean_step_seconds(engine, args.steps) * 1e3
                replay_ms = (time_graph_replay(engine) or float("nan")) * 1e3
                abort_all(engine, rids)
                row = {
                    "round": rnd + 1, "batch": bsz, "adapters": args.adapters if lora else 0, "overlap": overlap,
                    "engine_step_ms": step_ms, "graph_replay_ms": replay_ms, "gap_ms": step_ms - replay_ms,
                }  # fmt: skip
                rows.append(row)
                print(row, flush=True)
engine.overlap = True
result = {
    "benchmark": "overlap_ab",
    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "device": torch.cuda.get_device_name(),
    "args": vars(args),
    "rows": rows,
}
with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
for bsz in args.batch:
    for adapters in (0, args.adapters):
        for overlap in (True, False):
            sel = [
                r for r in rows if r["batch"] == bsz and r["adapters"] == adapters and r["overlap"] == overlap
            ]
            worst = max(sel, key=lambda r: r["gap_ms"])
            print(
                f"B={bsz} adapters={adapters} overlap={overlap}: worse round step {worst['engine_step_ms']:.2f} ms, "
                f"replay {worst['graph_replay_ms']:.2f} ms, gap {worst['gap_ms']:.2f} ms"
            )

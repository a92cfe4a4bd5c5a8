"""Issue 13: the LoRA shrink on a second CUDA stream beside the base GEMM, against one stream, in one process.

One engine (dummy Mistral-7B, bf16, 32 rank-16 adapters), decode batches of B rows at context ~512, for
B in --batch: 32 rows on 32 distinct adapters (BGMV graphs), 128 rows on 32 adapters, and base-only. For
each LoRA batch the decode graph of bucket B is recaptured with the side stream on and off, alternating,
--rounds times; each capture is timed as graph replay (median of 5 x 20 replays) and engine steps (20).
Also checks that both modes give the same greedy tokens and logprobs (bit for bit: only the stream
order differs) on a short generation through the same graphs.

    PYTHONPATH=. python benchmarks/scripts/lora_overlap_ab.py --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import numpy as np
import torch

import mmlora
from mmlora.bench.adapters import write_random_adapters
from mmlora.bench.serving_parts import abort_all, start_decode_batch
from mmlora.engine import cuda_graph


def recapture(engine: mmlora.Engine, bucket: int, overlap: bool, side: torch.cuda.Stream) -> None:
    """Decode graphs of bucket ``bucket`` only, captured with the side stream on or off."""
    runner = engine.runner
    old = runner.decode_graphs
    old.close()
    runner.lora._ctx.side_stream = side if overlap else None
    buckets = cuda_graph.batch_buckets
    cuda_graph.batch_buckets = lambda max_bs: [max_bs]
    try:
        runner.decode_graphs = cuda_graph.CudaGraphRunner(
            runner, bucket, engine.max_model_len, pad_page=old.pad_page
        )
    finally:
        cuda_graph.batch_buckets = buckets


def _set_overlap(engine: mmlora.Engine, bucket: int, mode: str, side: torch.cuda.Stream) -> None:
    recapture(engine, bucket, mode == "overlap", side)


def measure(engine: mmlora.Engine, steps: int = 20) -> dict:
    engine.step()
    graphs = engine.runner.decode_graphs
    graph = graphs.graphs[graphs.last_key]
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.graph.replay()
        start.record()
        for _ in range(20):
            graph.graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 20)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step_ms = (time.perf_counter() - t0) / steps * 1e3
    return {
        "key": list(graphs.last_key),
        "replay_ms": statistics.median(times),
        "replays_ms": times,
        "step_ms": step_ms,
    }


def engine_with_adapters(model: str, max_bs: int, n_adapters: int, rank: int = 16) -> tuple:
    """(engine, its side stream, adapters loaded into it): bf16, ``n_adapters`` random adapters of ``rank``
    in a pool of that rank (paged as the engine's default pages it)."""
    engine = mmlora.Engine(
        model=model, dtype="bfloat16", max_running_requests=max_bs, max_loras_per_batch=n_adapters,
        max_lora_rank=rank, max_model_len=2048,
    )  # fmt: skip
    side = engine.lora._ctx.side_stream
    assert side is not None, "the engine has no side stream (disable_lora_overlap?)"
    adapters = write_random_adapters(
        engine.hf_config, tempfile.mkdtemp(), n_adapters, [rank], dtype=torch.bfloat16
    )
    for a in adapters:
        engine.load_lora(a["name"], a["path"])
    return engine, side, adapters


def mode_rounds(
    engine: mmlora.Engine,
    side: torch.cuda.Stream,
    names: list[str],
    modes: tuple[str, ...],
    set_mode,  # noqa: ANN001
    rounds: int,
    rng: np.random.Generator,
) -> tuple[dict, dict]:
    """One decode batch of ``len(names)`` rows (``names[i]``: row i's adapter) at context ~512, timed in each
    of ``modes`` (``set_mode(engine, bucket, mode, side)`` recaptures the bucket's graph) for ``rounds``
    rounds, the order rotating by one each round, after a base-only batch (graphs as ``modes[0]``).
    Then each mode's greedy tokens and logprobs of a short generation. Returns (row, outputs per mode)."""
    bsz = len(names)
    rids = start_decode_batch(engine, [None] * bsz, 512, rng)
    set_mode(engine, bsz, modes[0], side)
    base = measure(engine)
    abort_all(engine, rids)
    rids = start_decode_batch(engine, names, 512, rng)
    row = {"batch": bsz, "base_replay_ms": base["replay_ms"], "base_step_ms": base["step_ms"], "rounds": []}
    for r in range(rounds):
        got = {}
        order = modes[r % len(modes) :] + modes[: r % len(modes)]
        for mode in order:
            set_mode(engine, bsz, mode, side)
            got[mode] = measure(engine)
        row["rounds"].append({"order": order, **got})
        print(
            f"B={bsz} round {r + 1} ({', '.join(order)}): replay "
            + ", ".join(f"{m} {got[m]['replay_ms']:.3f}" for m in modes)
            + f" ms (base-only {base['replay_ms']:.3f}); step "
            + ", ".join(f"{m} {got[m]['step_ms']:.2f}" for m in modes)
            + f" ms; key {got[modes[0]]['key']}",
            flush=True,
        )
    abort_all(engine, rids)
    prompts = [rng.integers(0, engine.model.arch.vocab_size, 64).tolist() for _ in range(bsz)]
    sp = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    outs = {}
    for mode in modes:
        set_mode(engine, bsz, mode, side)
        engine.flush_cache()
        outs[mode] = engine.generate(
            input_ids=prompts, lora_paths=names, sampling_params=sp, return_logprob=True
        )
    return row, outs


def same_tokens_and_logprobs(a: list, b: list) -> bool:
    return all(x.output_ids == y.output_ids and x.logprobs == y.logprobs for x, y in zip(a, b))


def ab_setup(default_batch: tuple[int, ...], default_adapters: int = 32) -> tuple:
    """The decode-graph A/B scripts' command line (--model, --batch, --adapters, --rounds, --rank, --out) and
    their engine: (args, engine, its side stream, adapters loaded into it)."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="dummy:mistral-7b-v0.3")
    p.add_argument("--batch", type=int, nargs="+", default=list(default_batch))
    p.add_argument("--adapters", type=int, default=default_adapters)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rank", type=int, default=16, help="the adapters' rank, and the pool's")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    return (args, *engine_with_adapters(args.model, max(args.batch), args.adapters, args.rank))


def write_ab(args: argparse.Namespace, fields: dict) -> None:
    """An A/B script's result to --out (JSON): its model, adapter count and rank, ``fields``, torch and the
    device."""
    with open(args.out, "w") as f:
        json.dump(
            {"model": args.model, "adapters": args.adapters, "rank": args.rank, **fields,
             "torch": torch.__version__, "device": torch.cuda.get_device_name()},
            f, indent=1,
        )  # fmt: skip


def run_mode_ab(
    modes: tuple[str, ...],
    set_mode,  # noqa: ANN001
    compare,  # noqa: ANN001
    default_batch: tuple[int, ...] = (32, 64, 128),
) -> None:
    """The decode-graph A/B scripts' main: for each --batch B, :func:`mode_rounds` over ``modes`` on B rows
    cycling over --adapters adapters, then ``compare(row, outputs per mode, names)`` adds its checks to the
    row and returns the line printed for it; the rows go to --out (JSON)."""
    args, engine, side, adapters = ab_setup(default_batch)
    rng = np.random.default_rng(0)
    rows = []
    for bsz in args.batch:
        names = [adapters[i % args.adapters]["name"] for i in range(bsz)]
        row, outs = mode_rounds(engine, side, names, modes, set_mode, args.rounds, rng)
        print(f"B={bsz}: {compare(row, outs, names)}", flush=True)
        rows.append(row)
    write_ab(args, {"modes": modes, "rows": rows})


def _compare(row: dict, outs: dict, names: list[str]) -> str:
    row["distinct_adapters"] = len(set(names))
    row["same_tokens_and_logprobs"] = same_tokens_and_logprobs(outs["overlap"], outs["serial"])
    return f"overlap and serial give the same tokens and logprobs: {row['same_tokens_and_logprobs']}"


if __name__ == "__main__":
    run_mode_ab(("overlap", "serial"), _set_overlap, _compare, default_batch=(32, 128))

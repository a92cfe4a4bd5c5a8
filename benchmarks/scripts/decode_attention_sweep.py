"""Launch-setting sweep of the Triton paged decode attention (``layers/attention/decode_tuning.TUNING``) at
serving's decode shapes. CUDA only (``--dry-run`` lists the grid and the estimate without one).

Each time is one decode attention call as ``TritonAttention.forward`` makes it in a decode graph (store of
the new token's K/V, split kernel, reduce) at Mistral-7B's heads (Hq 32, Hkv 8, D 128, bf16, pages of 16
on randomly permuted blocks, block tables ``cdiv(max_model_len, 16)`` wide as the graph runner's), timed
by ``mmlora.bench.attention.time_graph`` (``--repeat`` calls in one CUDA graph, median of ``--iters``
replays). Grid (every combination; the split-rule knobs stay at their defaults):

    block_n {32, 64, 128} x num_warps {2, 4, 8} x num_stages {1, 2, 3, 4} x splits {auto, 1, 2, 4}

at B {32, 72, 128} x context {780 (serving's mean), 2048}, and at B=72 with contexts drawn uniformly
from 200-1400 (``--seed``), as serving's are. ``auto`` is the split count serving's graphs use,
``auto_num_kv_splits(B, 8, max_model_len)`` (132 SMs: 2 at B=32, 1 from B=72); a fixed count equal to
it is the same launch and is timed once, as ``auto``.

The default config (today's TUNING, auto splits) runs first and last in every round (its drift is
printed); the others run in an order rotated each round. Every output is compared with the default's
at that shape (max abs diff; above ``--tol``, bf16's tolerance in tests/kernels, the row is a mismatch,
left out of the rankings, and the exit status is 1). A config that fails to compile or launch (e.g.
shared memory overflow at block_n 128 with 4 stages) is recorded and not tried again. Past
``--budget-s`` no new config starts (the round's closing default still runs). The JSON is rewritten
after each config, so a run cut short leaves what it timed; each config prints one progress line.

Duration on paper (H200; ``--dry-run`` prints it for the arguments given): 36 kernel configs x split
counts {1, 2, 4} = 108 variants of the split kernel to compile, about 1 s each: about 110 s one after
another, about 20 s with ``--compile-workers 8`` (child processes compile shares of the variants into
Triton's on-disk cache before the timing starts; the main process then loads them). Timing: per round
the default twice and 143 other configs, 107 of them distinct launches at each of the 7 shapes; at
3.3 TB/s of KV reads 122 calls per config and shape (two eager, ``--repeat`` 10 x (``--warmup`` 2 +
``--iters`` 10) in graphs) take about 0.11 s over the 7 shapes, plus about 5 ms of capture and checks
per shape: about 16 s a round. Whole grid, 2 rounds: about 60 s with 8 compile workers (16 cores),
about 155 s with none, plus process start; ``--budget-s`` bounds it either way.

    PYTHONPATH=$PWD python benchmarks/scripts/decode_attention_sweep.py --out decode_sweep.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from itertools import product

import torch
import triton

from mmlora.bench.attention import decode_inputs, time_graph
from mmlora.bench.cli import make_parser
from mmlora.layers.attention.decode_tuning import TUNING, block_n_for, splits_for
from mmlora.layers.attention.triton_backend import TritonAttention

HQ, HKV, D, PAGE, DTYPE = 32, 8, 128, 16, torch.bfloat16
DEFAULTS = dict(TUNING)
EST_TB_PER_S, EST_COMPILE_S, EST_OVERHEAD_S = 3.3, 1.0, 0.005  # the paper estimate's rates


@dataclass(frozen=True)
class Config:
    block_n: int | None
    num_warps: int
    num_stages: int
    splits: int | None  # None: auto_num_kv_splits, as serving's graphs

    def kernel(self) -> tuple[int, int, int]:
        return block_n_for(D, self.block_n), self.num_warps, self.num_stages

    @property
    def kernel_label(self) -> str:
        return "bn{} w{} s{}".format(*self.kernel())

    @property
    def label(self) -> str:
        return f"{self.kernel_label} " + ("auto" if self.splits is None else f"sp{self.splits}")

    def apply(self) -> None:
        """Set TUNING to the defaults with this config's kernel knobs."""
        TUNING.clear()
        TUNING.update(DEFAULTS, block_n=self.block_n, num_warps=self.num_warps, num_stages=self.num_stages)


DEFAULT = Config(DEFAULTS["block_n"], DEFAULTS["num_warps"], DEFAULTS["num_stages"], None)


@dataclass(frozen=True)
class Shape:
    name: str
    contexts: tuple[int, ...]

    @property
    def batch(self) -> int:
        return len(self.contexts)

    @property
    def kv_bytes(self) -> int:
        return 2 * sum(self.contexts) * HKV * D * DTYPE.itemsize


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = make_parser("decode_attention_sweep.py", __doc__)
    p.add_argument("--out", default="decode_attention_sweep.json", help="path of the JSON report")
    p.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--splits", nargs="+", default=["auto", "1", "2", "4"], help="'auto' or fixed counts")
    p.add_argument("--batches", type=int, nargs="+", default=[32, 72, 128])
    p.add_argument("--contexts", type=int, nargs="+", default=[780, 2048])
    p.add_argument("--ragged-batch", type=int, default=72, help="batch of ragged contexts (0: none)")
    p.add_argument("--ragged-range", type=int, nargs=2, default=[200, 1400], metavar=("LO", "HI"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=4096, help="block-table width and auto splits")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--iters", type=int, default=10, help="graph replays timed per config and shape")
    p.add_argument("--repeat", type=int, default=10, help="calls captured in one graph")
    p.add_argument("--warmup", type=int, default=2, help="graph replays before timing")
    p.add_argument("--tol", type=float, default=2e-2, help="max abs diff from the default's output")
    p.add_argument("--budget-s", type=float, default=240.0, help="start no new config past this")
    workers = min(8, (os.cpu_count() or 2) // 2)
    p.add_argument("--compile-workers", type=int, default=workers, help="precompiling processes (0: none)")
    p.add_argument("--top", type=int, default=5, help="configs per shape in the tables")
    p.add_argument("--sms", type=int, default=132, help="SMs assumed by --dry-run (the GPU's otherwise)")
    p.add_argument("--dry-run", action="store_true", help="list the grid and the estimate; no CUDA needed")
    p.add_argument("--precompile-shard", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        args.split_rules = [None if s == "auto" else int(s) for s in args.splits]
    except ValueError:
        p.error(f"--splits takes 'auto' or ints, got {args.splits}")
    if min(args.rounds, args.iters, args.repeat, *(1 if n is None else n for n in args.split_rules)) < 1:
        p.error("split counts, --rounds, --iters and --repeat must be >= 1")
    return args


class Plan:
    """The configs (besides the default) and shapes of a sweep on a GPU of ``sms`` SMs."""

    def __init__(self, args: argparse.Namespace, sms: int) -> None:
        self.args, self.sms = args, sms
        self.shapes = [Shape(f"{b}x{c}", (c,) * b) for b in args.batches for c in args.contexts]
        if args.ragged_batch:
            (lo, hi), rng = args.ragged_range, random.Random(args.seed)
            contexts = tuple(rng.randint(lo, hi) for _ in range(args.ragged_batch))
            self.shapes.append(Shape(f"{args.ragged_batch}xU{lo}-{hi}", contexts))
        every = [Config(*c) for c in product(args.block_n, args.warps, args.stages, args.split_rules)]
        self.configs = [c for c in every if c.kernel() != DEFAULT.kernel() or c.splits is not None]

    def splits(self, config: Config, shape: Shape) -> int:
        return config.splits or splits_for(shape.batch, HKV, self.args.max_model_len, self.sms)

    def timed(self, config: Config, shape: Shape) -> bool:
        """False for a fixed split count equal to the automatic one: the same launch as its auto config."""
        return config.splits is None or config.splits != self.splits(DEFAULT, shape)

    def variants(self) -> list[Config]:
        """The split kernel's distinct compilations: kernel config x split count launched."""
        seen = {Config(*c.kernel(), self.splits(c, s)) for c in [DEFAULT, *self.configs] for s in self.shapes}
        return sorted(seen, key=lambda c: (*c.kernel(), c.splits))

    def estimate(self) -> dict:
        """On paper: EST_COMPILE_S a variant spread over the compile workers, kernels at EST_TB_PER_S of
        KV reads, EST_OVERHEAD_S a config and shape for the capture and the check."""
        workers = self.args.compile_workers
        compile_s = len(self.variants()) * EST_COMPILE_S / max(workers, 1) + (5 if workers else 0)
        calls = 2 + self.args.repeat * (self.args.warmup + self.args.iters)
        per_round = sum(
            (2 + sum(self.timed(c, s) for c in self.configs))
            * (calls * s.kv_bytes / (EST_TB_PER_S * 1e12) + EST_OVERHEAD_S)
            for s in self.shapes
        )
        timing_s = per_round * self.args.rounds
        return {"variants": len(self.variants()), "compile_s": round(compile_s), "timing_s": round(timing_s)}

    def inputs(self, shape: Shape, device: torch.device) -> tuple:
        width = -(-self.args.max_model_len // PAGE)  # the graph runner's block tables
        contexts = list(shape.contexts)
        return decode_inputs(
            shape.batch, contexts, HQ, HKV, D, PAGE, DTYPE, device, width, self.args.max_model_len
        )


def precompile(plan: Plan) -> None:
    """Shard ``I/N`` of the variants compiled into Triton's disk cache, on a tiny step with the real
    shapes' launch specializations (dtypes, strides, block-table width)."""
    shard, nshards = map(int, plan.args.precompile_shard.split("/"))
    t0, failed = time.perf_counter(), 0
    inputs = plan.inputs(Shape("tiny", (33, 70)), torch.device("cuda"))
    variants = plan.variants()[shard::nshards]
    for v in variants:
        v.apply()
        try:
            TritonAttention(v.splits).forward(*inputs, scale=D**-0.5)
        except Exception:  # noqa: BLE001 - the main process records it
            failed += 1
    torch.cuda.synchronize()
    took = time.perf_counter() - t0
    print(
        f"precompile {shard}/{nshards}: {len(variants)} variants in {took:.1f} s, {failed} failed", flush=True
    )


def start_precompile(plan: Plan, argv: list[str]) -> list[subprocess.Popen]:
    n = plan.args.compile_workers
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--precompile-shard"]
    return [subprocess.Popen([*cmd, f"{i}/{n}"]) for i in range(n)]


class Sweep:
    """The rounds, their rows and the report (rewritten after every config)."""

    def __init__(self, plan: Plan, argv: list[str], device: torch.device) -> None:
        self.plan, self.args, self.device = plan, plan.args, device
        self.t0 = time.perf_counter()
        self.rows: list[dict] = []
        self.errors: list[dict] = []
        self.failed: set[Config] = set()
        self.ref: dict[str, torch.Tensor] = {}  # shape -> the default config's output
        self.default_ms: dict[tuple[int, str], float] = {}  # (round, shape) -> its first default run
        self.inputs: dict[str, tuple] = {}
        self.stopped = ""
        self.report = {
            "benchmark": "triton paged decode attention launch settings (Hq 32, Hkv 8, D 128, bf16, page 16)",
            "command": " ".join(["python benchmarks/scripts/decode_attention_sweep.py", *argv]),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
            "sms": plan.sms,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "host": platform.node(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "args": {k: v for k, v in vars(self.args).items() if k != "split_rules"},
            "tuning_defaults": DEFAULTS,
            "estimate": plan.estimate(),
            "shapes": [
                {
                    "shape": s.name,
                    "batch": s.batch,
                    "mean_context": round(sum(s.contexts) / s.batch, 1),
                    "kv_bytes": s.kv_bytes,
                    "auto_splits": plan.splits(DEFAULT, s),
                }
                for s in plan.shapes
            ],
        }

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def time_config(self, rnd: int, pos: int, config: Config) -> list[str]:
        """Time ``config`` at every shape (a failure skips it from then on); the progress line's cells."""
        if config in self.failed:
            return ["skipped (failed before)"]
        cells = []
        for shape in self.plan.shapes:
            if config in self.failed or not self.plan.timed(config, shape):
                continue
            n = self.plan.splits(config, shape)
            backend, inputs = TritonAttention(n), self.inputs[shape.name]
            fn = lambda b=backend, a=inputs: b.forward(*a, scale=D**-0.5)  # noqa: E731
            config.apply()
            try:
                out = fn().float()
                ms = time_graph(fn, self.args.iters, self.args.repeat, self.args.warmup)
            except Exception as exc:  # noqa: BLE001 - compile or launch failure: record, skip the config
                self.failed.add(config)
                error = f"{type(exc).__name__}: {str(exc)[:400]}"
                self.errors.append(
                    {"round": rnd, "config": config.label, "shape": shape.name, "error": error}
                )
                cells.append(f"{shape.name} FAILED {error[:120]!r}")
                if self.device.type == "cuda":
                    torch.cuda.synchronize()  # a broken CUDA context raises here and ends the sweep
                continue
            finally:
                DEFAULT.apply()
            run = None
            if config == DEFAULT:
                run = "last" if (rnd, shape.name) in self.default_ms else "first"
                self.default_ms.setdefault((rnd, shape.name), ms)
                self.ref.setdefault(shape.name, out)
            diff = (out - self.ref[shape.name]).abs().max().item()
            ratio = ms / self.default_ms[(rnd, shape.name)]
            self.rows.append({
                "round": rnd, "position": pos, "config": config.label, "kernel": config.kernel_label, "block_n": config.kernel()[0],
                "num_warps": config.num_warps, "num_stages": config.num_stages,
                "splits": config.splits or "auto", "num_kv_splits": n, "shape": shape.name,
                "batch": shape.batch, "ms": round(ms, 5), "kv_tb_per_s": round(shape.kv_bytes / ms / 1e9, 3),
                "ratio_to_default": round(ratio, 4), "max_abs_diff": diff,
                "mismatch": not diff <= self.args.tol, "default_run": run,
            })  # fmt: skip
            mark = " MISMATCH" if self.rows[-1]["mismatch"] else ""
            cells.append(f"{shape.name} {ms * 1e3:.1f}us {ratio:.3f}{mark}")
        return cells

    def run(self) -> None:
        torch.manual_seed(self.args.seed)
        self.inputs = {s.name: self.plan.inputs(s, self.device) for s in self.plan.shapes}
        others = self.plan.configs
        for rnd in range(1, self.args.rounds + 1):
            if rnd > 1 and self.elapsed() > self.args.budget_s:
                self.stopped = f"budget of {self.args.budget_s} s spent before round {rnd}"
                break
            shift = (rnd - 1) * len(others) // self.args.rounds
            order = [DEFAULT, *others[shift:], *others[:shift], DEFAULT]
            for pos, config in enumerate(order):
                if 0 < pos < len(order) - 1 and self.elapsed() > self.args.budget_s:
                    self.stopped = self.stopped or f"budget of {self.args.budget_s} s spent in round {rnd}"
                    continue  # the round's closing default still runs
                cells = self.time_config(rnd, pos, config)
                if DEFAULT in self.failed:
                    raise SystemExit(f"the default config failed: {self.errors[-1]['error']}")
                line = f"[r{rnd} {pos}/{len(order) - 1} {self.elapsed():.0f}s] {config.label}: "
                print(line + "; ".join(cells), flush=True)
                self.write()
            self.print_round(rnd)
            if self.stopped:
                break

    def write(self) -> None:
        mismatches = sum(r["mismatch"] for r in self.rows)
        self.report.update(rows=self.rows, errors=self.errors, mismatches=mismatches)
        self.report.update(stopped_early=self.stopped or None, elapsed_s=round(self.elapsed(), 1))
        with open(f"{self.args.out}.tmp", "w") as f:
            json.dump(self.report, f, indent=1)
        os.replace(f"{self.args.out}.tmp", self.args.out)

    def print_round(self, rnd: int) -> None:
        print(
            f"\n== round {rnd}: best {self.args.top} per shape (us, KV TB/s, ratio to the round's first default)"
        )
        for shape in self.plan.shapes:
            rows = [r for r in self.rows if r["round"] == rnd and r["shape"] == shape.name]
            defaults = [r for r in rows if r["default_run"]]
            if not defaults:
                continue
            first, drift = (
                defaults[0],
                (f"{defaults[-1]['ms'] / defaults[0]['ms']:.3f}" if len(defaults) > 1 else "-"),
            )
            print(f"{shape.name} (auto = {first['num_kv_splits']} splits): default {first['ms'] * 1e3:.1f}us "
                  f"{first['kv_tb_per_s']:.2f} TB/s, last/first {drift}")  # fmt: skip
            ok = sorted(
                (r for r in rows if not r["default_run"] and not r["mismatch"]), key=lambda r: r["ms"]
            )
            for r in ok[: self.args.top]:
                print(f"  {r['config']:<18} sp={r['num_kv_splits']:<2} {r['ms'] * 1e3:8.1f}us "
                      f"{r['kv_tb_per_s']:5.2f} TB/s {r['ratio_to_default']:.3f}")  # fmt: skip

    def print_summary(self) -> None:
        """Kernel configs (block_n, warps, stages) by the geometric mean over shapes of their ratio (mean
        over rounds): with auto splits, and with each shape's best split count."""
        ratios: dict[tuple[str, str | None, str], list[float]] = {}
        for r in self.rows:
            if not r["mismatch"] and r["default_run"] != "last":
                key = (r["kernel"], r["splits"], r["shape"])
                ratios.setdefault(key, []).append(r["ratio_to_default"])
        mean = {k: sum(v) / len(v) for k, v in ratios.items()}
        kernels = sorted({k for k, _, _ in mean})
        names = [s.name for s in self.plan.shapes]
        for title, auto_only in (("auto splits", True), ("each shape's best split count", False)):
            scored = []
            for k in kernels:
                vals = [min((v for (kk, sp, sh), v in mean.items() if kk == k and sh == name
                             and (sp == "auto" or not auto_only)), default=None) for name in names]  # fmt: skip
                if None not in vals:
                    scored.append((math.exp(sum(map(math.log, vals)) / len(vals)), k, vals))
            print(
                f"\n== kernel configs by geomean ratio to the default over shapes ({title}; mean over rounds)"
            )
            print(f"  {'':<14} {'geomean':>7} " + " ".join(f"{n:>11}" for n in names))
            for g, k, vals in sorted(scored)[: self.args.top]:
                print(f"  {k:<14} {g:7.3f} " + " ".join(f"{v:11.3f}" for v in vals))


def dry_run(plan: Plan) -> None:
    est = plan.estimate()
    print(f"{len(plan.configs)} configs besides the default ({DEFAULT.label}), {plan.args.rounds} rounds, "
          f"{plan.sms} SMs assumed")  # fmt: skip
    for s in plan.shapes:
        timed = sum(plan.timed(c, s) for c in plan.configs)
        print(f"  {s.name:<14} mean context {sum(s.contexts) / s.batch:6.1f}, KV {s.kv_bytes / 1e6:6.1f} MB, "
              f"auto splits {plan.splits(DEFAULT, s)}, {timed} configs timed a round")  # fmt: skip
    print(f"{est['variants']} split-kernel variants: compile about {est['compile_s']} s with "
          f"{plan.args.compile_workers} workers; timing about {est['timing_s']} s")  # fmt: skip
    print("configs: " + ", ".join(c.label for c in plan.configs))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.dry_run:
        dry_run(Plan(args, args.sms))
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("decode_attention_sweep.py needs a CUDA device (it times kernels on the GPU); "
                         "--dry-run lists the grid without one")  # fmt: skip
    plan = Plan(args, torch.cuda.get_device_properties(0).multi_processor_count)
    if args.precompile_shard:
        precompile(plan)
        return 0
    sweep = Sweep(plan, argv, torch.device("cuda"))
    print(f"{sweep.report['device']} ({plan.sms} SMs), torch {torch.__version__}, triton {sweep.report['triton']}:"
          f" {len(plan.configs) + 1} configs, {len(plan.shapes)} shapes, {args.rounds} rounds; estimate "
          f"{sweep.report['estimate']}", flush=True)  # fmt: skip
    workers = start_precompile(plan, argv) if args.compile_workers > 0 else []
    for w in workers:
        try:
            w.wait(timeout=max(args.budget_s / 2 - sweep.elapsed(), 1))
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait()
    print(f"[{sweep.elapsed():.0f}s] precompile done; timing", flush=True)
    try:
        sweep.run()
    finally:
        sweep.write()
    sweep.print_summary()
    n = sweep.report["mismatches"]
    print(f"\n{len(sweep.rows)} rows, {len(sweep.failed)} failed configs, {n} mismatches, {sweep.elapsed():.0f} s"
          f"{'; ' + sweep.stopped if sweep.stopped else ''}; JSON in {args.out}")  # fmt: skip
    return 1 if n else 0


if __name__ == "__main__":
    sys.exit(main())

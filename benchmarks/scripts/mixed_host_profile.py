"""Host profile of the mixed steps replayed from graphs in a ``bench serving`` run (session 40).

The 1000-adapter runs of issue 13 spend 0.44-0.69 s launching their ~62 mixed-graph steps against
0.12-0.14 s in every other run, and the adapter uploads' host time explains only 0.06-0.11 s of it. This
runs ``python -m mmlora.bench serving`` with the given arguments under a cProfile of each
``MixedGraphRunner.run`` call, one profile for steps with an adapter row and one for base-only steps, and
writes both (top functions by total and cumulative time) with the calls' wall seconds into OUT every 10
calls, so a run cut short still leaves them.

Session 40's run (benchmarks/results/h100-2026-12-06-session40/p) found the time in the step's first
launch after the graph replay, the logits GEMM: 9.4 ms a call in steps with an adapter row, 0.1 ms in
base-only ones. So each logits call is also logged (``logits.txt``: the step's kind, seconds, rows, whether this
process's logits GEMM had that many rows before, and whether the current stream was idle and the pool's
upload stream busy just before it), to tell a host blocked on a new shape (a kernel loaded lazily on first
use can synchronize the context) from one blocked behind uploads.

    python benchmarks/scripts/mixed_host_profile.py OUT serving --model ... --num-adapters 1000 ...
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

from mmlora.bench.__main__ import main as bench_main
from mmlora.engine import mixed_graph


def _dump(out: Path, profiles: dict, walls: dict) -> None:
    for name, prof in profiles.items():
        if not walls[name]:
            continue
        text = io.StringIO()
        text.write(f"{name}: {len(walls[name])} calls, wall {sum(walls[name]):.3f} s\n")
        for key in ("tottime", "cumulative"):
            pstats.Stats(prof, stream=text).sort_stats(key).print_stats(30)
        (out / f"{name}.txt").write_text(text.getvalue())


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    profiles = {"lora": cProfile.Profile(), "base": cProfile.Profile()}
    walls: dict[str, list[float]] = {"lora": [], "base": []}
    logits_log = ["step seconds rows first_time_rows current_stream_idle upload_stream_busy"]
    seen_rows: set[int] = set()  # row counts the logits GEMM has had in this process
    step = {"kind": None}  # the mixed step running now: "lora" or "base"
    run = mixed_graph.MixedGraphRunner.run

    def dump() -> None:
        _dump(out, profiles, walls)
        (out / "logits.txt").write_text("".join(line + "\n" for line in logits_log))

    def watch_logits(runner) -> None:  # noqa: ANN001
        """Log each mixed step's logits call (a decode step's, outside ``profiled``, is not logged)."""
        model = runner.model
        if getattr(model.compute_logits, "watched", False):
            return
        compute = model.compute_logits
        upload = runner.lora._pool.upload_stream  # a benchmark instrument, as bench's breakdown

        def compute_logits(hidden):  # noqa: ANN001, ANN202
            kind = step["kind"]
            if kind is None:
                return compute(hidden)
            rows = hidden.shape[0]
            first = rows not in seen_rows
            seen_rows.add(rows)
            idle = torch.cuda.current_stream().query()
            uploading = upload is not None and not upload.query()
            t0 = time.perf_counter()
            logits = compute(hidden)
            seconds = time.perf_counter() - t0
            logits_log.append(f"{kind} {seconds:.6f} {rows} {int(first)} {int(idle)} {int(uploading)}")
            return logits

        compute_logits.watched = True
        model.compute_logits = compute_logits

    def profiled(self, sched, future=None):  # noqa: ANN001, ANN202
        if self.device.type == "cuda":
            watch_logits(self)
        name = step["kind"] = "lora" if any(r.slot >= 0 for r in sched.requests) else "base"
        t0 = time.perf_counter()
        profiles[name].enable()
        try:
            return run(self, sched, future)
        finally:
            profiles[name].disable()
            step["kind"] = None
            walls[name].append(time.perf_counter() - t0)
            if sum(map(len, walls.values())) % 10 == 0:
                dump()

    mixed_graph.MixedGraphRunner.run = profiled
    try:
        bench_main(sys.argv[2:])
    finally:
        dump()


if __name__ == "__main__":
    main()

"""benchmarks/scripts/decode_attention_sweep.py off the GPU: its default grid, its refusal without CUDA,
and small sweeps on CPU (kernels under TRITON_INTERPRET=1, a stand-in for the CUDA-graph timer)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from mmlora.layers.attention.decode_tuning import TUNING

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "scripts" / "decode_attention_sweep.py"


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("decode_attention_sweep", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_default_grid(sweep) -> None:
    plan = sweep.Plan(sweep.parse_args([]), sms=132)
    assert len(plan.configs) == 3 * 3 * 4 * 4 - 1 and sweep.DEFAULT not in plan.configs
    assert [s.name for s in plan.shapes] == [
        "32x780", "32x2048", "72x780", "72x2048", "128x780", "128x2048", "72xU200-1400",
    ]  # fmt: skip
    ragged = plan.shapes[-1].contexts
    assert len(ragged) == 72 and min(ragged) >= 200 and max(ragged) <= 1400 and len(set(ragged)) > 30
    assert ragged == sweep.Plan(sweep.parse_args([]), sms=132).shapes[-1].contexts  # seeded
    assert [plan.splits(sweep.DEFAULT, s) for s in plan.shapes] == [2, 2, 1, 1, 1, 1, 1]
    assert all(sum(plan.timed(c, s) for c in plan.configs) == 107 for s in plan.shapes)
    assert len(plan.variants()) == 36 * 3
    assert plan.estimate()["timing_s"] < 60


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_refuses_without_cuda(sweep) -> None:
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        sweep.main(["--out", "unused.json"])
    with pytest.raises(SystemExit):
        sweep.parse_args(["--splits", "auto", "x"])
    assert sweep.main(["--dry-run", "--rounds", "1"]) == 0


# The small sweeps run their kernels on CPU tensors, which Triton takes only in its interpreter, and the
# tests' conftest turns that on only where there is no CUDA.
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter (set without CUDA)"
)


def _small(sweep, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *extra: str):
    """A sweep of block_n {16, 32, 8 (invalid: fails)} x splits {auto, 2} at two tiny shapes, 8 query
    heads on 2 KV heads, timed as 0.1 ms for the default, 0.08 for block_n 16 and 0.12 for 32."""
    monkeypatch.setattr(sweep, "HQ", 8)
    monkeypatch.setattr(sweep, "HKV", 2)
    monkeypatch.setattr(sweep, "time_graph", lambda fn, *a: fn() is None or {None: 0.1, 16: 0.08, 32: 0.12}[TUNING["block_n"]])  # fmt: skip
    argv = [
        "--block-n", "16", "32", "8", "--warps", "4", "--stages", "2", "--splits", "auto", "2",
        "--batches", "2", "--contexts", "40", "--ragged-batch", "3", "--ragged-range", "5", "60",
        "--max-model-len", "128", "--compile-workers", "0", "--out", str(tmp_path / "sweep.json"), *extra,
    ]  # fmt: skip
    run = sweep.Sweep(sweep.Plan(sweep.parse_args(argv), sms=4), argv, torch.device("cpu"))
    run.run()
    run.write()
    run.print_summary()
    return run, json.loads((tmp_path / "sweep.json").read_text())


@interpreted
def test_small_sweep_on_cpu(sweep, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    run, report = _small(sweep, tmp_path, monkeypatch)
    rows = report["rows"]
    assert dict(TUNING) == sweep.DEFAULTS
    assert report["mismatches"] == 0 and report["stopped_early"] is None
    assert {r["round"] for r in rows} == {1, 2}
    for rnd in (1, 2):  # default first and last, the others rotated
        order = [r["config"] for r in rows if r["round"] == rnd and r["shape"] == "2x40"]
        assert order[0] == order[-1] == "bn64 w4 s2 auto"
        assert len(order) == 6  # default twice, bn16 and bn32 with auto and 2 splits
    firsts = [[r["config"] for r in rows if r["round"] == rnd and r["shape"] == "2x40"][1] for rnd in (1, 2)]
    assert firsts[0] != firsts[1]
    assert [e["config"] for e in report["errors"]] == ["bn8 w4 s2 auto", "bn8 w4 s2 sp2"]  # not retried
    assert "block_n" in report["errors"][0]["error"]
    by = {(r["round"], r["config"], r["shape"]): r for r in rows}
    r16 = by[(2, "bn16 w4 s2 sp2", "3xU5-60")]
    assert r16["ratio_to_default"] == 0.8 and r16["num_kv_splits"] == 2 and r16["max_abs_diff"] < 1e-2
    assert by[(1, "bn32 w4 s2 auto", "2x40")]["num_kv_splits"] == 1
    out = capsys.readouterr().out
    assert "== round 2" in out and "bn16 w4 s2 sp2" in out
    assert re.search(r"\n  bn16 w4 s2 +0\.800 +0\.800 +0\.800\n", out)  # summary: geomean, per shape


@interpreted
def test_budget_stops_after_the_closing_default(
    sweep, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, report = _small(sweep, tmp_path, monkeypatch, "--budget-s", "0")
    assert {(r["round"], r["default_run"]) for r in report["rows"]} == {(1, "first"), (1, "last")}
    assert "budget" in report["stopped_early"]

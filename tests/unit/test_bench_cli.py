"""Smoke tests of the benchmark CLIs at toy scale on CPU: they run end to end and write what they promise."""

from __future__ import annotations

import json

import pytest
from tiny_models import make_checkpoint

from mmlora.bench.__main__ import main as bench_main


def test_serving_cli_on_cpu(tmp_path, capsys):
    # A tiny checkpoint folder rather than a dummy preset: dummies borrow SmolLM2's tokenizer (slow to parse).
    base = make_checkpoint(tmp_path / "base", "llama")
    out = tmp_path / "serving"
    argv = [
        "serving", "--model", str(base), "--device", "cpu", "--dtype", "float32",
        "--num-adapters", "1", "3", "--num-requests", "4", "--input-len", "4", "10", "--output-len", "3", "6",
        "--max-model-len", "128", "--max-loras-per-batch", "3", "--max-running-requests", "4",
        "--hf-batch", "3", "--hf-tokens", "2", "--hf-adapters", "2", "--micro-batch", "2", "--micro-context", "16",
        "--micro-adapters", "1", "--out", str(out),
    ]  # fmt: skip
    assert bench_main(argv) == 0
    result = json.loads((out / "serving.json").read_text())
    assert (out / "serving.png").stat().st_size > 0
    systems = [(r["system"], r["num_adapters"]) for r in result["runs"]]
    assert systems == [("base-only", 0), ("mmlora", 1), ("mmlora", 3)]
    for run in result["runs"]:
        assert run["num_requests"] == 4 and run["output_tokens"] >= 4 * 3
        assert run["output_tok_per_s"] > 0 and run["ttft_p50_s"] >= 0 and run["decode_floor_seconds"] > 0
        kinds, host = run["breakdown"]["step_kinds"], run["breakdown"]["host_phases_s"]
        decode = kinds["decode_eager"]["count"] + kinds["decode_graph"]["count"]  # CPU plans are graph steps
        assert kinds["prefill"]["count"] >= 1 and decode >= 1
        assert sum(k["wall_s"] for k in kinds.values()) <= run["seconds"]
        assert all(
            host[p] > 0 for p in ("schedule", "build_inputs", "lora_batch_info", "sample", "postprocess")
        )
        lora_calls = sum(k["lora_calls"] for k in kinds.values())
        assert (lora_calls > 0) == (run["num_adapters"] > 0) and (host["lora_host"] > 0) == (lora_calls > 0)
    # Registering an adapter loads it into a free slot: the warm-up's two were uploaded there (counted in
    # its breakdown), and a timed run that uploads counts bytes with its uploads.
    warm_uploads = result["warmup"]["breakdown"]["adapter_uploads"]
    assert warm_uploads["count"] == 2 and warm_uploads["bytes"] > 0 and warm_uploads["host_s"] > 0
    uploads = [r["breakdown"]["adapter_uploads"] for r in result["runs"][1:]]
    assert all((u["bytes"] > 0) == (u["count"] > 0) for u in uploads)
    assert result["triton_compiles_in_timed_runs"] is not None
    memory = result["memory"]  # no stage on CPU unless --lora-stage-slots (auto stages on CUDA only)
    assert memory["stage_bytes"] == 0 and memory["kv_tokens"] > 0 and memory["adapter_slot_bytes"] > 0
    # The warm-up ran the timed workload once (its breakdown kept; no CUDA allocator on CPU).
    warm = result["warmup"]["breakdown"]
    assert warm["step_kinds"]["prefill"]["count"] >= 1 and warm["cuda_allocator"] is None
    assert all(r["breakdown"]["cuda_allocator"] is None for r in result["runs"])
    assert {(m["batch"], m["lora"]) for m in result["decode_step"]} == {(2, True), (2, False)}
    # --micro-adapters 1: both rows on one adapter; no graphs on CPU, so no per-layout replays.
    assert [m["distinct_adapters"] for m in result["decode_step"]] == [1, 0]
    assert all(m["graph_replay_ms_by_layout"] is None for m in result["decode_step"])
    assert all(m["engine_step_steady_ms"] > 0 for m in result["decode_step"])
    assert result["hf_peft"]["output_tok_per_s"] > 0, result["hf_peft"]
    assert result["mmlora_subset"]["output_tok_per_s"] > 0
    printed = capsys.readouterr().out
    assert "out tok/s" in printed and f"KV cache {memory['kv_tokens']} tokens" in printed


def test_serving_rank_mix_sweep(tmp_path):
    """--rank-mixes: each mix runs every adapter count (one plot line each) and reports its slot padding."""
    base = make_checkpoint(tmp_path / "base", "llama")
    out = tmp_path / "serving"
    argv = [
        "serving", "--model", str(base), "--device", "cpu", "--dtype", "float32", "--rank-mixes", "4", "2,8",
        "--num-adapters", "2", "--num-requests", "3", "--input-len", "4", "8", "--output-len", "2", "4",
        "--max-model-len", "64", "--max-loras-per-batch", "2", "--max-running-requests", "3",
        "--hf-batch", "0", "--micro-batch", "--out", str(out),
    ]  # fmt: skip
    assert bench_main(argv) == 0
    result = json.loads((out / "serving.json").read_text())
    assert [(r["num_adapters"], r.get("ranks")) for r in result["runs"]] == [(0, None), (2, [4]), (2, [2, 8])]
    # Slots are sized for rank 8 and adapter bytes grow linearly with the rank.
    assert result["runs"][1]["slot_padding_fraction"] == pytest.approx(0.5)
    assert result["runs"][2]["slot_padding_fraction"] in (pytest.approx(0.75), 0.0, pytest.approx(0.375))
    assert set(result["mixed_over_base"]) == {"0", "ranks 4 n=2", "ranks 2,8 n=2"}
    assert (out / "serving.png").stat().st_size > 0


def test_serving_points_take_the_same_requests_in_any_run(tmp_path, monkeypatch):
    """Which adapter each request takes depends on the round and the adapter count only: a run of one
    rank mix and a run of two give that mix's points the same assignment (so an A/B across runs with other
    points times the same requests), and the rounds differ from each other."""
    from mmlora.bench import serving

    base = make_checkpoint(tmp_path / "base", "llama")
    seen: list[list[str | None]] = []
    real = serving.run_workload
    monkeypatch.setattr(
        serving,
        "run_workload",
        lambda engine, work, *a: seen.append([w["lora"] for w in work]) or real(engine, work, *a),
    )

    def points(mixes: list[str]) -> dict[tuple[int, str], list]:
        seen.clear()
        argv = [
            "serving", "--model", str(base), "--device", "cpu", "--dtype", "float32", "--rank-mixes", *mixes,
            "--num-adapters", "4", "--num-requests", "12", "--input-len", "4", "6", "--output-len", "2", "4",
            "--max-model-len", "64", "--max-loras-per-batch", "4", "--max-running-requests", "4",
            "--sweep-rounds", "2", "--hf-batch", "0", "--micro-batch", "--out", str(tmp_path / "-".join(mixes)),
        ]  # fmt: skip
        assert bench_main(argv) == 0
        result = json.loads((tmp_path / "-".join(mixes) / "serving.json").read_text())
        timed = seen[-len(result["runs"]) :]  # after the warm-up's
        return {
            (r["round"], ",".join(map(str, r.get("ranks") or []))): w for r, w in zip(result["runs"], timed)
        }

    one, two = points(["4"]), points(["2", "4"])
    assert one[(0, "4")] == two[(0, "4")] and one[(1, "4")] == two[(1, "4")]
    assert one[(0, "4")] != one[(1, "4")]
    assert None not in one[(0, "4")] and len(set(one[(0, "4")])) > 1  # every request on one of the adapters


def test_serving_sweep_rounds_and_pool_rank(tmp_path):
    """--sweep-rounds: base-only then the mix, in turn, each ratio against its own round's base-only run;
    --pool-rank sizes the slots (rank 2 adapters in rank-8 slots: three quarters padding)."""
    base = make_checkpoint(tmp_path / "base", "llama")
    out = tmp_path / "serving"
    argv = [
        "serving", "--model", str(base), "--device", "cpu", "--dtype", "float32", "--ranks", "2",
        "--pool-rank", "8", "--sweep-rounds", "2", "--num-adapters", "2", "--num-requests", "3", "--input-len", "4",
        "8", "--output-len", "2", "4", "--max-model-len", "64", "--max-loras-per-batch", "2",
        "--max-running-requests", "3", "--hf-batch", "0", "--micro-batch", "--out", str(out),
    ]  # fmt: skip
    assert bench_main(argv) == 0
    result = json.loads((out / "serving.json").read_text())
    runs = result["runs"]
    assert [(r["round"], r["num_adapters"]) for r in runs] == [(0, 0), (0, 2), (1, 0), (1, 2)]
    assert result["pool_rank"] == 8
    for base_run, lora_run in (runs[:2], runs[2:]):
        assert lora_run["slot_padding_fraction"] == pytest.approx(0.75)
        assert lora_run["slot_padding_fraction_pool"] == pytest.approx(0.75)
        assert lora_run["over_base"] == pytest.approx(
            lora_run["output_tok_per_s"] / base_run["output_tok_per_s"]
        )
        assert lora_run["ttft_p50_over_base"] == pytest.approx(
            lora_run["ttft_p50_s"] / base_run["ttft_p50_s"]
        )
        # the adapters' bytes only add to a decode step's floor: the bound is below 1
        assert lora_run["decode_bytes_bound"] == pytest.approx(
            base_run["decode_floor_seconds"] / lora_run["decode_floor_seconds"]
        )
        assert 0 < lora_run["decode_bytes_bound"] < 1
    assert set(result["mixed_over_base"]) == {"0 round 1", "2 round 1", "0 round 2", "2 round 2"}
    with pytest.raises(ValueError, match="pool-rank"):
        bench_main([*argv[:9], "--pool-rank", "1", *argv[11:]])


def test_serving_shared_prefix_workload_on_cpu(tmp_path, capsys):
    base = make_checkpoint(tmp_path / "base", "llama")
    out = tmp_path / "prefix"
    argv = [
        "serving", "--workload", "shared-prefix", "--model", str(base), "--device", "cpu", "--dtype", "float32",
        "--num-adapters", "2", "--num-requests", "6", "--shared-prefix", "40", "4", "3", "--input-len", "4", "10",
        "--output-len", "3", "6", "--max-model-len", "128", "--max-loras-per-batch", "2", "--out", str(out),
    ]  # fmt: skip
    assert bench_main(argv) == 0
    result = json.loads((out / "serving_prefix.json").read_text())
    rows = {r["workload"]: r for r in result["results"]}
    assert set(rows) == {"shared-prefix", "no-sharing"}
    for row in rows.values():  # two timed pairs (the default), the order alternating
        assert [p["order"] for p in row["pairs"]] == ["on first", "off first"]
        assert row["worse"]["throughput_on_over_off"] == min(
            p["ratios"]["throughput_on_over_off"] for p in row["pairs"]
        )
        assert row["worse"]["ttft_p50_on_over_off"] == max(
            p["ratios"]["ttft_p50_on_over_off"] for p in row["pairs"]
        )
    for pair in rows["shared-prefix"]["pairs"]:
        on, off = pair["on"], pair["off"]
        # 6 turns over 2 system prompts of 40 tokens (16-token pages): 4 turns find 32 of their 44 tokens cached.
        assert off["prefill_tokens_computed"] == 6 * 44
        assert on["prefill_tokens_computed"] == 6 * 44 - 4 * 32
        assert on["cached_prompt_tokens"] == 4 * 32 and off["cached_prompt_tokens"] == 0
        for run in (on, off):
            assert run["output_tok_per_s"] > 0 and run["ttft_p99_s"] >= run["ttft_p50_s"] > 0
            kinds = run["breakdown"]["step_kinds"]
            assert sum(k["count"] for k in kinds.values()) > 0
            assert run["breakdown"]["host_phases_s"]["schedule"] > 0
    for pair in rows["no-sharing"]["pairs"]:
        assert pair["on"]["prefill_tokens_computed"] == pair["off"]["prefill_tokens_computed"]
    assert "prefill computed" in capsys.readouterr().out


def test_cpu_cli_on_a_tiny_checkpoint(tmp_path, capsys):
    base = make_checkpoint(tmp_path / "base", "llama")
    out = tmp_path / "cpu.json"
    argv = [
        "cpu", "--model", str(base), "--num-prompts", "3", "--max-new-tokens", "3", "--num-adapters", "2",
        "--rank", "4", "--repeats", "2", "--out", str(out),
    ]  # fmt: skip
    assert bench_main(argv) == 0
    result = json.loads(out.read_text())
    from mmlora.bench.cpu_roofline import cpu_has_fast_bf16

    bf16_run = {"mmlora_mixed_bf16"} if cpu_has_fast_bf16() else set()  # measured where the CPU has bf16
    assert set(result["output_tokens_per_s"]) == {"mmlora_mixed", "mmlora_base", "hf_peft_mixed", *bf16_run}
    assert result["ratio_mmlora_vs_hf_peft"] > 0 and result["ratio_mixed_vs_base"] > 0
    assert result["rows"] == ["lora0", "lora1", None]
    # fp32, same weights: mmlora's greedy tokens equal HF + PEFT's on every row
    assert result["greedy_rows_equal_to_hf_peft"] == "3/3"
    # issue 21's figures: each done-when check, and decode steps against a positive roofline floor
    assert set(result["checks"]) == {
        "mmlora_vs_hf_peft", "mixed_vs_base", "decode_fraction_of_fp32_roofline", "bf16_vs_fp32",
    }  # fmt: skip
    roof = result["roofline_fp32_mixed"]
    # one roofline run per round; as with the rounds, the best counts
    assert len(roof["runs"]) == 2
    assert roof["fraction_of_roofline"] == max(r["fraction_of_roofline"] for r in roof["runs"])
    assert roof["decode_steps"] == 2 and roof["decode_floor_seconds"] > 0 and roof["weight_bytes"] > 0
    assert 0 < result["checks"]["decode_fraction_of_fp32_roofline"]["value"] == roof["fraction_of_roofline"]
    # the roofline's bandwidth: the best STREAM-like copy timed right beside its decode run, all kept
    samples = roof["bandwidth_samples_gb_s"]
    assert len(samples["just_before"]) == len(samples["just_after"]) > 1
    assert (
        result["copy_bandwidth_gb_s"]
        == roof["bandwidth_gb_s"]
        == max(samples["just_before"] + samples["just_after"])
    )
    # the compute ceiling: 2 FLOPs per fp32 parameter (4 bytes) per row of each 3-row decode step, at the
    # probed GEMM rate, and its share of the steps' own time (not bounded by 1 here: the probe and the steps
    # are timed at different moments, and under a parallel test run the probe can land in a slow one)
    assert roof["gemm_rows"] == 3 and roof["gemm_gflop_s"] > 0
    per_step = 2 * 3 * (roof["weight_bytes"] / 4) / (roof["gemm_gflop_s"] * 1e9)
    assert roof["mean_decode_compute_floor_ms"] == pytest.approx(1e3 * per_step, rel=1e-6)
    assert roof["fraction_of_compute_floor"] == pytest.approx(
        roof["mean_decode_compute_floor_ms"] / roof["mean_decode_step_ms"], rel=1e-9
    )
    out = capsys.readouterr().out
    assert "mixed adapters / own base-only" in out and "compute ceiling" in out


def test_profiled_step_shows_the_c_kernels():
    """torch.profiler sees torch ops only: inside c_kernels_traced the C kernels' ctypes calls appear as
    mmlora_c:: ranges, with their own time; outside it the entry points are the plain functions again."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from mmlora.backends import cpu_gemm, cpu_kernels
    from mmlora.bench.cpu_roofline import C_ENTRY_POINTS, c_kernels_traced

    if not cpu_gemm.dtypes():
        pytest.skip("the C kernels are not built here")
    before = [getattr(owner, name) for owner, name in C_ENTRY_POINTS]
    w, x = cpu_gemm.pack(torch.randn(64, 32)), torch.randn(4, 32)
    with c_kernels_traced(), profile(activities=[ProfilerActivity.CPU]) as prof:
        cpu_gemm.matmul_unchecked(x, w)
        cpu_kernels.rms_norm_unchecked(x, torch.ones(32), 1e-6)
    events = {e.key: e for e in prof.key_averages()}
    assert events["mmlora_c::matmul"].count == 1 and events["mmlora_c::rms_norm"].count == 1
    assert events["mmlora_c::matmul"].self_cpu_time_total > 0
    assert [getattr(owner, name) for owner, name in C_ENTRY_POINTS] == before


def test_cpu_bf16_flags_read_from_cpuinfo(tmp_path):
    from mmlora.engine.cpu_decode import cpu_bf16_flags

    with_bf16, without = tmp_path / "with_bf16", tmp_path / "without"
    with_bf16.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_tile\n")
    without.write_text("processor\t: 0\nflags\t\t: fpu avx2\n")
    assert cpu_bf16_flags(str(with_bf16)) == {"avx512_bf16"}
    assert cpu_bf16_flags(str(without)) == frozenset()
    assert cpu_bf16_flags(str(tmp_path / "missing")) == frozenset()


def test_random_adapters_follow_each_model_class_layout(tmp_path):
    """Qwen2-VL's decoder layers live under model.language_model: generated adapters load there, change
    the output, and the decode floor counts the language tower only."""
    from tiny_models import make_qwen2_vl_checkpoint

    import mmlora
    from mmlora.bench.adapters import write_random_adapters
    from mmlora.bench.serving_parts import weight_bytes
    from mmlora.models.loader import load_config, resolve_model

    base = make_qwen2_vl_checkpoint(tmp_path / "vl")
    made = write_random_adapters(
        load_config(resolve_model(str(base))), tmp_path / "adapters", 1, [4], dtype="float32"
    )
    engine = mmlora.Engine(model=str(base), device="cpu", dtype="float32", max_lora_rank=4)
    engine.load_lora("r", made[0]["path"])
    sp = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    plain, adapted = engine.generate(
        input_ids=[[40, 41, 42, 43]] * 2, lora_paths=[None, "r"], sampling_params=sp
    )
    assert plain.output_ids != adapted.output_ids
    model = engine.model
    everything = sum(p.numel() * p.element_size() for p in model.parameters())
    vision = sum(p.numel() * p.element_size() for p in model.visual.parameters())
    embed = model.model.embed_tokens.weight
    untied = 0 if embed is model.lm_head.weight else embed.numel() * embed.element_size()
    assert weight_bytes(model) == everything - vision - untied


def test_grammar_cli_on_a_tiny_checkpoint(tmp_path, capsys):
    base = make_checkpoint(tmp_path / "base", "llama")
    argv = [
        "grammar",
        "--model",
        str(base),
        "--device",
        "cpu",
        "--batch",
        "4",
        "--constrained",
        "2",
        "--steps",
        "3",
    ]
    assert bench_main(argv) == 0
    out = capsys.readouterr().out
    assert "B=4, 2 constrained" in out and "% of a step" in out


def test_serving_two_tenants_workload_on_cpu(tmp_path, capsys):
    base = make_checkpoint(tmp_path / "base", "llama")
    out = tmp_path / "tenants"
    argv = [
        "serving", "--workload", "two-tenants", "--model", str(base), "--device", "cpu", "--dtype", "float32",
        "--duration", "3", "--rounds", "2", "--input-len", "4", "10", "--output-len", "3", "6",
        "--max-model-len", "64", "--max-running-requests", "4", "--max-loras-per-batch", "4", "--ranks", "4",
        "--out", str(out),
    ]  # fmt: skip
    assert bench_main(argv) == 0
    result = json.loads((out / "serving_tenants.json").read_text())
    assert result["capacity"]["output_tok_per_s"] > 0 and result["capacity"]["requests"] == 8
    assert [len(result["policies"][p]) for p in ("fcfs", "vtc")] == [2, 2]  # each policy twice
    runs = result["policies"]["fcfs"] + result["policies"]["vtc"]
    assert len({tuple(run["requests"].values()) for run in runs}) == 1  # one workload for every run
    for run in runs:
        assert run["output_tok_per_s"] > 0 and run["slot_loads"] >= 0
        if run["requests"]["light"]:
            assert run["light_latency_p99_s"] >= run["light_ttft_p99_s"] > 0
    assert len(result["per_round"]) == 2 and result["worse_round"] in (0, 1)
    assert "worse round" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "disabled"),
    [([], False), (["--disable-mixed-cuda-graph"], True), (["--enable-mixed-cuda-graph"], False)],
)
def test_serving_runs_mixed_step_graphs_unless_told_not_to(argv, disabled):
    from mmlora.bench.serving_cli import parse_args

    args = parse_args(["--model", "dummy:tiny-llama", *argv], "serving")
    assert args.disable_mixed_cuda_graph is disabled

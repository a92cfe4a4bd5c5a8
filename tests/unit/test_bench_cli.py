"""Smoke tests of the benchmark CLIs at toy scale on CPU: they run end to end and write what they promise."""

from __future__ import annotations

import json

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
        "--out", str(out),
    ]  # fmt: skip
    assert bench_main(argv) == 0
    result = json.loads((out / "serving.json").read_text())
    assert (out / "serving.png").stat().st_size > 0
    systems = [(r["system"], r["num_adapters"]) for r in result["runs"]]
    assert systems == [("base-only", 0), ("mmlora", 1), ("mmlora", 3)]
    for run in result["runs"]:
        assert run["num_requests"] == 4 and run["output_tokens"] >= 4 * 3
        assert run["output_tok_per_s"] > 0 and run["ttft_p50_s"] >= 0 and run["decode_floor_seconds"] > 0
    assert {(m["batch"], m["lora"]) for m in result["decode_step"]} == {(2, True), (2, False)}
    assert result["hf_peft"]["output_tok_per_s"] > 0, result["hf_peft"]
    assert result["mmlora_subset"]["output_tok_per_s"] > 0
    assert "out tok/s" in capsys.readouterr().out


def test_cpu_cli_on_a_tiny_checkpoint(tmp_path, capsys):
    base = make_checkpoint(tmp_path / "base", "llama")
    out = tmp_path / "cpu.json"
    argv = [
        "cpu", "--model", str(base), "--num-prompts", "3", "--max-new-tokens", "3", "--num-adapters", "2",
        "--rank", "4", "--repeats", "1", "--out", str(out),
    ]  # fmt: skip
    assert bench_main(argv) == 0
    result = json.loads(out.read_text())
    assert set(result["output_tokens_per_s"]) == {"mmlora_mixed", "mmlora_base", "hf_peft_mixed"}
    assert result["ratio_mmlora_vs_hf_peft"] > 0 and result["ratio_mixed_vs_base"] > 0
    assert result["rows"] == ["lora0", "lora1", None]
    # fp32, same weights: mmlora's greedy tokens equal HF + PEFT's on every row
    assert result["greedy_rows_equal_to_hf_peft"] == "3/3"
    # issue 21's figures: each done-when check, and decode steps against a positive roofline floor
    assert set(result["checks"]) == {
        "mmlora_vs_hf_peft", "mixed_vs_base", "decode_fraction_of_fp32_roofline", "bf16_vs_fp32",
    }  # fmt: skip
    roof = result["roofline_fp32_mixed"]
    assert roof["decode_steps"] == 2 and roof["decode_floor_seconds"] > 0 and roof["weight_bytes"] > 0
    assert 0 < result["checks"]["decode_fraction_of_fp32_roofline"]["value"] == roof["fraction_of_roofline"]
    assert "mixed adapters / own base-only" in capsys.readouterr().out


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

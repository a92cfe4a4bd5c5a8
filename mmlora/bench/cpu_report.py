"""The console report of ``python -m mmlora.bench cpu`` (:mod:`mmlora.bench.cpu`): throughputs, greedy
agreement with HF + PEFT, the decode roofline and issue 21's done-when figures."""

from __future__ import annotations

from typing import Any

from mmlora.bench.cpu_roofline import format_profile


def report(result: dict[str, Any]) -> str:
    """The console lines of a CPU benchmark result (the JSON that ``run`` returns)."""
    tps, cps = result["output_tokens_per_s"], result["output_tokens_per_cpu_s"]
    rows = [
        ("mmlora mixed adapters", "mmlora_mixed"),
        ("mmlora base only", "mmlora_base"),
        ("HF + PEFT mixed batch", "hf_peft_mixed"),
        ("mmlora mixed, bf16", "mmlora_mixed_bf16"),
    ]
    lines = [
        f"CPU benchmark: {result['model']} fp32, {result['num_prompts']} prompts x {result['max_new_tokens']} new "
        f"tokens, {result['adapters']['count']} rank-{result['adapters']['rank']} adapters + base rows, "
        f"{result['threads']} torch threads, load average {result['load_average'][0]:.1f}",
        f"  {'':22s}  {'wall tok/s':>10s}  {'tok/CPU-s':>10s}",
        *(f"  {label:22s}  {tps[key]:10.1f}  {cps[key]:10.1f}" for label, key in rows if key in tps),
        f"  greedy rows equal to HF + PEFT: {result['greedy_rows_equal_to_hf_peft']}",
        *(
            f"    row {d['row']} ({d['adapter']}) parts at token {d['position']}: HF's top-2 margin there "
            f"{d['hf_top2_margin']:.2e}, mmlora's token {d['mmlora_token_below_hf_best']:.2e} below HF's best"
            for d in result.get("greedy_divergences", [])
        ),
        *_roofline_lines(result["roofline_fp32_mixed"], result["copy_bandwidth_gb_s"]),
        "  done when (issue 21; ratios of process CPU time, each round's pair, median over rounds):",
        *(_check_line(label, result["checks"][key]) for label, key in CHECK_LABELS),
    ]
    return "\n".join(lines)


CHECK_LABELS = (
    ("mixed adapters / HF + PEFT (fp32)", "mmlora_vs_hf_peft"),
    ("mixed adapters / own base-only", "mixed_vs_base"),
    ("decode share of the fp32 roofline", "decode_fraction_of_fp32_roofline"),
    ("bf16 / fp32 (mixed adapters)", "bf16_vs_fp32"),
)


def _check_line(label: str, check: dict[str, Any]) -> str:
    if check["met"] is None:
        why = check.get("why", "not measured")
        return f"    {label:36s}:   n/a   (target >= {check['target']}; {why})"
    mark = "met" if check["met"] else "MISSED"
    return f"    {label:36s}: {check['value']:5.2f}   (target >= {check['target']})  {mark}"


def _roofline_lines(roof: dict[str, Any], bandwidth_gb_s: float) -> list[str]:
    return [
        f"  roofline ({roof['dtype']}, mixed adapters): copy bandwidth {bandwidth_gb_s:.1f} GB/s, weights "
        f"{roof['weight_bytes'] / 1e6:.0f} MB, KV {roof['kv_bytes_per_token'] / 1e3:.1f} kB/token",
        f"    {roof['decode_steps']} decode steps: {roof['mean_decode_step_ms']:.1f} ms each (wall) against "
        f"a floor of {roof['mean_decode_floor_ms']:.1f} ms = {roof['fraction_of_roofline']:.0%} of the "
        f"roofline; {roof['prefill_steps']} prefill steps {roof['prefill_seconds']:.2f} s",
        "    every roofline run (the best counts): "
        + ", ".join(
            f"{r['mean_decode_step_ms']:.1f} ms at {r['bandwidth_gb_s']:.1f} GB/s = {r['fraction_of_roofline']:.0%}"
            for r in roof.get("runs", [roof])
        ),
        f"    compute ceiling: the widest layer GEMM at {roof['gemm_rows']} rows runs at "
        f"{roof['gemm_gflop_s']:.0f} GFLOP/s (weight in cache), so a step's GEMMs take at least "
        f"{roof['mean_decode_compute_floor_ms']:.1f} ms = {roof['fraction_of_compute_floor']:.0%} of a step",
        *format_profile(roof["profile"]),
    ]

"""What ``python -m mmlora.bench kernels`` reports: the targets read off its results, its table and
its figure."""

from __future__ import annotations

import json
from pathlib import Path

from mmlora.bench.cli import target_mark

BACKENDS = ("torch-gather", "triton-sgmv", "triton-bgmv")


def summary(results: list[dict]) -> dict:
    """The issue's targets, read off the results."""
    by = {}
    for r in results:
        by.setdefault((r["proj"], r["rank"], r["phase"], r["tokens"], r["popularity"]), {})[r["backend"]] = r
    bgmv = [r for r in results if r["backend"] == "triton-bgmv" and r["phase"] == "decode"
            and r["popularity"] == "distinct" and r["tokens"] >= 32]  # fmt: skip
    sgmv = [
        r for r in results if r["backend"] == "triton-sgmv" and r["phase"] == "prefill" and r["rank"] == "16"
    ]
    losses = {b: [] for b in ("triton-sgmv", "triton-bgmv")}
    wins = {"decode": {}, "prefill": {}}
    for key, row in by.items():
        tg = row.get("torch-gather")
        for b in losses:
            if b in row and tg and row[b]["time_us"] >= tg["time_us"]:
                losses[b].append("/".join(map(str, key)))
        tri = {b: row[b]["time_us"] for b in losses if b in row}
        if tri:
            best = min(tri, key=tri.get)
            wins[key[2]][best] = wins[key[2]].get(best, 0) + 1
    return {
        "bgmv_decode_distinct_T>=32_min_bw_frac": min((r["bw_frac"] for r in bgmv), default=None),
        "bgmv_decode_distinct_T>=32_target": 0.60,
        "sgmv_prefill_rank16_max_lora_over_gemm": max((r["lora_over_gemm"] for r in sgmv), default=None),
        "sgmv_prefill_rank16_target": 0.15,
        "max_rel_err_vs_first_backend": {
            b: max(r["rel_err_vs_first"] for r in results if r["backend"] == b)
            for b in dict.fromkeys(r["backend"] for r in results)
        },
        "points_not_faster_than_torch_gather": losses,
        "fastest_triton_backend_count": wins,
    }


def plot(data: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    res = data["results"]
    projs = list(dict.fromkeys(r["proj"] for r in res))
    rank = "16" if any(r["rank"] == "16" for r in res) else res[0]["rank"]
    fig, axes = plt.subplots(3, len(projs), figsize=(4.2 * len(projs), 10), squeeze=False)
    rows = (
        ("decode", "distinct", "time_us"),
        ("prefill", "uniform", "time_us"),
        ("decode", "distinct", "bw_frac"),
    )
    for j, proj in enumerate(projs):
        for i, (phase, pop, metric) in enumerate(rows):
            ax = axes[i][j]
            sel = [
                r
                for r in res
                if (r["proj"], r["phase"], r["popularity"], r["rank"]) == (proj, phase, pop, rank)
            ]
            for be in dict.fromkeys(r["backend"] for r in sel):
                pts = sorted((r["tokens"], r[metric]) for r in sel if r["backend"] == be)
                ax.plot(*zip(*pts), marker="o", label=be)
            if metric == "time_us":
                gemm = sorted({(r["tokens"], r["gemm_us"]) for r in sel})
                if gemm:
                    ax.plot(*zip(*gemm), "k--", label="base GEMM")
                ax.set_yscale("log")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{proj} {phase} {pop} r{rank}: {metric}", fontsize=9)
            ax.set_xlabel("tokens")
            ax.grid(alpha=0.3)
            if sel:
                ax.legend(fontsize=7)
    fig.suptitle(f"LoRA shrink+expand, {data['meta']['device']}, copy {data['meta']['copy_GBps']:.0f} GB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def table(data: dict) -> str:
    lines = [f"copy bandwidth {data['meta']['copy_GBps']:.0f} GB/s; times in us (GEMM = base projection)"]
    lines.append(f"{'proj':8}{'phase':8}{'T':>6}{'r':>6} {'pop':10}{'gemm':>9}" + "".join(f"{b:>15}" for b in BACKENDS)
                 + f"{'bgmv bw%':>10}")  # fmt: skip
    rows: dict = {}
    for r in data["results"]:
        rows.setdefault((r["proj"], r["phase"], r["tokens"], r["rank"], r["popularity"]), {})[
            r["backend"]
        ] = r
    for (proj, phase, T, rank, pop), row in rows.items():
        any_r = next(iter(row.values()))
        cells = "".join(f"{row[b]['time_us']:15.1f}" if b in row else f"{'-':>15}" for b in BACKENDS)
        bw = f"{100 * row['triton-bgmv']['bw_frac']:9.0f}%" if "triton-bgmv" in row else f"{'-':>10}"
        lines.append(f"{proj:8}{phase:8}{T:6d}{rank:>6} {pop:10}{any_r['gemm_us']:9.1f}{cells}{bw}")
    summary = data["summary"]
    bw, ratio = (
        summary["bgmv_decode_distinct_T>=32_min_bw_frac"],
        summary["sgmv_prefill_rank16_max_lora_over_gemm"],
    )
    bw_target, ratio_target = (
        summary["bgmv_decode_distinct_T>=32_target"],
        summary["sgmv_prefill_rank16_target"],
    )
    lines.append(
        f"BGMV decode, distinct adapters, T>=32: min {_fmt(bw)} of copy bandwidth "
        f"(target >= {bw_target}: {target_mark(bw, bw_target)})"
    )
    lines.append(
        f"SGMV prefill, rank 16: max {_fmt(ratio)} of the base GEMM "
        f"(target <= {ratio_target}: {target_mark(ratio, ratio_target, at_least=False)})"
    )
    lines.append("summary: " + json.dumps(summary))
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"

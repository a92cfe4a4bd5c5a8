"""The serving benchmark's plot: output tokens/s against the number of adapters, a line per rank mix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def plot(result: dict[str, Any], path: Path) -> None:
    """Output tokens/s against number of adapters: mmlora, base-only, HF + PEFT (its subset), mmlora on it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result["runs"] if r["num_adapters"] > 0]
    base = float(np.mean([r["output_tok_per_s"] for r in result["runs"] if r["num_adapters"] == 0]))
    xs = sorted({r["num_adapters"] for r in runs})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    mixes = sorted({tuple(r.get("ranks") or ()) for r in runs})
    for mix in mixes:  # one line per rank mix, the mean of its rounds at each adapter count
        line = [r for r in runs if tuple(r.get("ranks") or ()) == mix]
        ns = sorted({r["num_adapters"] for r in line})
        tps = [np.mean([r["output_tok_per_s"] for r in line if r["num_adapters"] == n]) for n in ns]
        label = "mmlora (multi-LoRA)" + (f", ranks {','.join(map(str, mix))}" if len(mixes) > 1 else "")
        ax.plot(ns, tps, "o-", label=label)
    ax.plot(xs, [base] * len(xs), "k--", label="mmlora base model only")
    hf, sub = result.get("hf_peft") or {}, result.get("mmlora_subset") or {}
    if "output_tok_per_s" in hf:
        label = f"HF + PEFT (batch {hf['batch']} x {hf['new_tokens_each']} tok, {hf['adapters']} adapters)"
        ax.plot(xs, [hf["output_tok_per_s"]] * len(xs), "r:", label=label)
    if "output_tok_per_s" in sub:
        ax.plot([sub["adapters"]], [sub["output_tok_per_s"]], "g^", label="mmlora on the HF + PEFT subset")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.minorticks_off()
    ax.set_xlabel("number of adapters")
    ax.set_ylabel("output tokens / s")
    args = result["args"]
    ax.set_title(
        f"{args['model']} on {result['device']}: {args['num_requests']} requests, {args['popularity']}"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

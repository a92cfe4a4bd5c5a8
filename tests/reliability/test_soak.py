"""A 30 s soak after a warm-up round: 32 streaming clients on the base model and four adapters, one of
them loaded and unloaded in a loop (``mmlora.bench.soak``, which runs the same for hours)."""

from __future__ import annotations

import shutil

from mmlora.bench.soak import run_soak


def test_soak_32_streaming_clients_with_load_unload(server, tiny):
    shutil.copytree(tiny.adapters["a3"], tiny.root / "churn")
    report = run_soak(
        server.url,
        server.bg,
        adapters=["a0", "a1", "a2"],
        churn_path="churn",
        duration=30,
        clients=32,
        warmup=5,
    )
    rss = [round(mb, 1) for _, mb in report.rss]
    print(f"\nsoak: {dict(report.outcomes)} admin {dict(report.admin)} idle {report.idle}")
    print(f"soak RSS (MiB, every 1 s after warm-up): {rss}; growth {report.rss_growth_mb:+.1f} MiB")
    assert report.problems(max_rss_growth_mb=50) == []
    assert report.outcomes["ok"] >= 100, report.outcomes
    assert report.admin["load_200"] >= 3 and report.admin["unload_200"] >= 3, report.admin

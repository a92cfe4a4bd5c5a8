"""``python -m mmlora.bench cpu``'s console report, rendered from a committed result of that benchmark: every
done-when figure appears with the value and mark the JSON holds, and every measured system's throughput."""

from __future__ import annotations

import json
from pathlib import Path

from mmlora.bench.cpu_report import CHECK_LABELS, report

RESULT = Path(__file__).parents[2] / "benchmarks/results/cpu-2026-12-04-session23/run1.json"


def test_report_shows_every_check_and_throughput_of_a_real_result() -> None:
    result = json.loads(RESULT.read_text())
    lines = report(result).splitlines()
    for label, key in CHECK_LABELS:
        check = result["checks"][key]
        (line,) = [ln for ln in lines if ln.strip().startswith(label)]
        if check["met"] is None:
            assert "n/a" in line
        else:
            assert f"{check['value']:5.2f}" in line
            assert line.endswith("met" if check["met"] else "MISSED")
    for key, tok_s in result["output_tokens_per_s"].items():
        assert any(f"{tok_s:10.1f}" in ln for ln in lines), key
    assert any(
        f"greedy rows equal to HF + PEFT: {result['greedy_rows_equal_to_hf_peft']}" in ln for ln in lines
    )

"""Issue 13: the host time of serving's steps against the adapter uploads of each run, from ``python -m
mmlora.bench serving`` JSON files: per run (sweep round, adapter count, rank mix), the uploads (count, GPU
seconds), each graph step kind's launch seconds (host time inside the forward call), GPU wait and wall
seconds, the schedule phase and TTFT p50. Made to test whether mixed steps' launch time follows the uploads
(``upload_launch_probe.py`` tests why on the GPU).

    python benchmarks/scripts/launch_by_uploads.py RUN/serving.json [MORE.json ...]
"""

from __future__ import annotations

import json
import sys


def rows(path: str) -> list[str]:
    with open(path) as f:
        runs = json.load(f)["runs"]
    out = [
        f"{'round':>5} {'adapters':>8} {'ranks':>6} {'uploads':>7} {'up gpu s':>8} | "
        f"{'mixed launch':>12} {'wait':>6} {'wall':>6} | {'decode launch':>13} {'wait':>6} | "
        f"{'schedule':>8} {'TTFT p50':>8}"
    ]
    for r in runs:
        b = r["breakdown"]
        mixed, decode = b["step_kinds"]["mixed_graph"], b["step_kinds"]["decode_graph"]
        up = b["adapter_uploads"]
        ranks = ",".join(map(str, r.get("ranks") or [])) or "-"
        out.append(
            f"{r.get('round', 0) + 1:>5} {r['num_adapters']:>8} {ranks:>6} {up['count']:>7} {up['gpu_s']:>8.3f} | "
            f"{mixed['forward_launch_s']:>12.3f} {mixed['gpu_wait_s']:>6.3f} {mixed['wall_s']:>6.3f} | "
            f"{decode['forward_launch_s']:>13.3f} {decode['gpu_wait_s']:>6.3f} | "
            f"{b['host_phases_s']['schedule']:>8.3f} {r['ttft_p50_s'] * 1e3:>6.0f} ms"
        )
    return out


def main(paths: list[str]) -> int:
    if not paths:
        raise SystemExit(__doc__)
    for path in paths:
        print(f"== {path}")
        print("\n".join(rows(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

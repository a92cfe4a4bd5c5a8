"""Read a ``decode_knobs_ab.py`` JSON and print the knobs of the mode that may become the defaults, as
``triton-sgmv:knob=JSON`` words for ``with_tuning.py`` / ``h200_session28_c.sh`` (nothing when no mode wins).

The rule (issue 13's, since session 28): a mode wins only where its decode-graph replay is faster than the
defaults' in every round at every batch, with the defaults' greedy tokens. Of the winners, the one with the
lowest mean replay over all batches and rounds is printed. A summary of every mode goes to stderr.

    python benchmarks/scripts/pick_knob_winners.py graphs_ab.json
"""

from __future__ import annotations

import json
import sys
from statistics import mean


def winners(result: dict) -> list[tuple[float, str, dict]]:
    """(mean replay ms, mode, its overrides) of every mode that wins, fastest first."""
    rows = result["rows"]
    if not rows:
        return []
    modes = [m for m in result["modes"] if m != "default"]
    found = []
    for mode in modes:
        pairs = [
            (rnd[mode]["replay_ms"], rnd["default"]["replay_ms"]) for row in rows for rnd in row["rounds"]
        ]
        same_tokens = all(row.get("against_default", {}).get(mode, {}).get("same_tokens") for row in rows)
        ok = same_tokens and all(ms < default for ms, default in pairs)
        replays = [ms for ms, _ in pairs]
        ratio = mean(ms / default for ms, default in pairs)
        print(
            f"{mode}: {'wins' if ok else 'does not win'} (replay {ratio:.3f}x the defaults)", file=sys.stderr
        )
        if ok:
            found.append((mean(replays), mode, rows[0]["modes"][mode]))
    return sorted(found, key=lambda t: t[0])


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: pick_knob_winners.py GRAPHS_AB.json")
    with open(sys.argv[1]) as f:
        found = winners(json.load(f))
    if found:
        _, mode, knobs = found[0]
        print(f"picked {mode}", file=sys.stderr)
        print(" ".join(f"triton-sgmv:{k}={json.dumps(v, separators=(',', ':'))}" for k, v in knobs.items()))


if __name__ == "__main__":
    main()

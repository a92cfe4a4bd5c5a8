"""Issue 13: SGMV launch knobs (any of ``triton_sgmv.TUNING``) against the defaults in real decode graphs, in
one process: the A/B of ``shrink_pdl_ab.py`` for any set of modes.

One engine (dummy Mistral-7B, bf16, --adapters rank-16 adapters), decode batches of B rows at context ~512
cycling over the adapters (B >= 2 x adapters: SGMV runs, as serving's decode graphs replay them; serving's
mean decode batch on 32 adapters is 73 rows on about 23 adapters). For each B the decode graph of bucket B
is recaptured in every mode, in a rotating order, --rounds times, and timed as graph replay (median of
5 x 20 replays) and engine steps (20). Before each capture the warm-up compiles every kernel variant the
mode launches, so no compile happens inside a capture or a timed replay. Then each mode's greedy tokens
and logprobs of a short generation against the defaults': equal bits where a knob keeps the sums' order
(the h-plane unroll, the B-first loads, the shrink's dependent launch), else the largest logprob
difference (a different split of in_features sums in another order).

    PYTHONPATH=.:benchmarks/scripts python benchmarks/scripts/decode_knobs_ab.py --batch 72 128 \
        --adapters 24 --mode hu16:run_expand_h_unroll=16 all:run_expand_h_unroll=16,shrink_pdl=true \
        --out FILE.json
"""

from __future__ import annotations

import argparse
import sys

import torch
from lora_overlap_ab import recapture, run_mode_ab

import mmlora
from mmlora.backends import triton_sgmv
from mmlora.backends.tuning import parse_override

DEFAULTS = dict(triton_sgmv.TUNING)


def parse_modes(specs: list[str]) -> dict[str, dict]:
    """``NAME:knob=JSON,knob=JSON`` -> {NAME: overrides}, "default" first; an unknown knob or a value that is
    not JSON is an error."""
    modes: dict[str, dict] = {"default": {}}
    for spec in specs:
        name, _, settings = spec.partition(":")
        if not name or not settings or name in modes:
            raise SystemExit(f"--mode {spec!r}: expected a new NAME:knob=JSON[,knob=JSON...]")
        # parse_override names an unknown knob or a value that is not JSON
        modes[name] = {
            knob: value
            for _, knob, value in (parse_override(f"triton-sgmv:{kv}") for kv in settings.split(","))
        }
    return modes


def main() -> None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--mode", nargs="+", required=True, metavar="NAME:knob=JSON,...")
    args, rest = pre.parse_known_args()
    modes = parse_modes(args.mode)

    def set_mode(engine: mmlora.Engine, bucket: int, mode: str, side: torch.cuda.Stream) -> None:
        triton_sgmv.TUNING.clear()
        triton_sgmv.TUNING.update(DEFAULTS, **modes[mode])  # launch plans are rebuilt at the capture
        engine.lora.warm_up_kernels()  # this mode's variants compiled now, not inside the capture
        recapture(engine, bucket, True, side)

    def compare(row: dict, outs: dict, names: list[str]) -> str:
        row["distinct_adapters"] = len(set(names))
        checks = {}
        for mode, got in outs.items():
            ref = outs["default"]
            diffs = [abs(a - b) for x, y in zip(got, ref) for a, b in zip(x.logprobs, y.logprobs)]
            checks[mode] = {
                "same_tokens": all(x.output_ids == y.output_ids for x, y in zip(got, ref)),
                "same_logprobs": all(x.logprobs == y.logprobs for x, y in zip(got, ref)),
                "max_logprob_diff": max(diffs, default=0.0),
            }
        row["against_default"] = checks
        row["modes"] = modes
        return "; ".join(
            f"{m}: tokens {'=' if c['same_tokens'] else 'DIFFER'}, logprobs "
            + ("bit-equal" if c["same_logprobs"] else f"max diff {c['max_logprob_diff']:.2e}")
            for m, c in checks.items()
            if m != "default"
        )

    sys.argv = [sys.argv[0], *rest]
    run_mode_ab(tuple(modes), set_mode, compare, default_batch=(72, 128))


if __name__ == "__main__":
    main()

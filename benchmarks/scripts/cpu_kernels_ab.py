"""The C kernels of :mod:`mmlora.backends.cpu_kernels` on against off, one SmolLM2 forward at a time,
interleaved call by call (issue 21, session 12).

On: the fused LoRA path adds each row's own slot's expand in one C call, decode attention reads the
paged cache in place (one C call a layer), RMSNorm and rotary are one C call each; expand: the expand
kernel only; no-elementwise: all but RMSNorm and rotary; off: ``cpu_kernels.ENABLED = False``, every caller on its torch path (the shrink masked,
multiplied by the packed expand matrix, added). The step is :mod:`cpu_decode_step`'s (16 rows on four
rank-8 adapters and the base, or ``--prefill``), routed mixed and base-only; the four (routing,
setting) pairs alternate call by call and print per round the median ms of each.

    PYTHONPATH=. python benchmarks/scripts/cpu_kernels_ab.py [--dtype bfloat16] [--prefill] [--out F]
"""

import contextlib
import json
import sys

import torch

sys.path.insert(0, "benchmarks/scripts")
import cpu_decode_step as step  # noqa: E402

from mmlora.backends import cpu_kernels  # noqa: E402
from mmlora.layers.attention import torch_ref  # noqa: E402
from mmlora.layers.norms import RMSNorm  # noqa: E402

IN_PLACE = torch_ref._in_place


NORM_IN_C, ROTARY_LAYOUT_OK = RMSNorm._in_c, cpu_kernels.rotary_layout_ok


def kernels(on: bool, attention: bool = True, elementwise: bool = True):  # noqa: ANN201
    """A context manager factory setting ``cpu_kernels.ENABLED`` to ``on``; ``attention`` False keeps the
    decode attention on its torch path, ``elementwise`` False RMSNorm and rotary, while the others run."""

    @contextlib.contextmanager
    def cm():  # noqa: ANN202
        old, cpu_kernels.ENABLED = cpu_kernels.ENABLED, on
        torch_ref._in_place = IN_PLACE if attention else (lambda *a: False)
        RMSNorm._in_c = NORM_IN_C if elementwise else (lambda *a: False)
        cpu_kernels.rotary_layout_ok = ROTARY_LAYOUT_OK if elementwise else (lambda *a: False)
        try:
            yield
        finally:
            cpu_kernels.ENABLED = old
            torch_ref._in_place = IN_PLACE
            RMSNorm._in_c, cpu_kernels.rotary_layout_ok = NORM_IN_C, ROTARY_LAYOUT_OK

    return cm


def main() -> None:
    args = step.parse()
    if not cpu_kernels.available():
        raise SystemExit("the C kernels are not built here (no compiler?)")
    engine, batch, mixed, base = step.setup(args)
    with torch.inference_mode():
        outs = []
        for on in (False, True):
            with kernels(on)():
                outs.append(engine.runner.run_batch(batch, mixed).clone())
    diff = (outs[1].double() - outs[0].double()).abs().max().item()
    print(f"mixed hidden states, max |on - off|: {diff:.3g}")
    variants = {
        "off": kernels(False),
        "expand": kernels(True, attention=False, elementwise=False),
        "no-elementwise": kernels(True, elementwise=False),
        "on": kernels(True),
    }
    res = step.measure(engine, batch, {"mixed": mixed, "base": base}, args.calls, args.rounds, variants)
    for v in variants:
        ratios = [b / m for b, m in zip(res[f"base-{v}"], res[f"mixed-{v}"])]
        print(f"{v}: base / mixed per round {', '.join(f'{r:.3f}' for r in ratios)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**vars(args), "max_abs_diff_on_off": diff, "median_ms": res}, f, indent=2)


if __name__ == "__main__":
    main()

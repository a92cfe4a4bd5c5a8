"""CPU prefill: the packed matmuls over every row in one call (the C panel GEMM) against 64-row pieces
concatenated (how every prefill ran before ``onednn.packed_matmul_rows``), interleaved call by call on the
prefill step of ``cpu_decode_step.py``.

    PYTHONPATH=. python benchmarks/scripts/cpu_prefill_rows_ab.py --prefill --context 40 --calls 3 --rounds 3 [--dtype bfloat16]
"""

import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_decode_step  # noqa: E402

from mmlora.backends import onednn, torch_gather  # noqa: E402
from mmlora.layers import packed_linear  # noqa: E402


def _pieces(x: torch.Tensor, packed: object, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.shape[0] <= onednn.PACKED_MAX_ROWS:
        return onednn.packed_matmul(x, packed, bias)
    return torch.cat([onednn.packed_matmul(p, packed, bias) for p in x.split(onednn.PACKED_MAX_ROWS)])


@contextlib.contextmanager
def pieces():  # noqa: ANN201
    saved = torch_gather.packed_matmul_rows, packed_linear.packed_matmul_rows
    torch_gather.packed_matmul_rows = packed_linear.packed_matmul_rows = _pieces
    try:
        yield
    finally:
        torch_gather.packed_matmul_rows, packed_linear.packed_matmul_rows = saved


if __name__ == "__main__":
    args = cpu_decode_step.parse()
    engine, batch, mixed, _ = cpu_decode_step.setup(args)
    variants = {"whole": contextlib.nullcontext, "pieces": pieces}
    cpu_decode_step.measure(engine, batch, {"mixed": mixed}, args.calls, args.rounds, variants)

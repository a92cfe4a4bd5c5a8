"""PackedLinear: an ``nn.Linear`` whose weight can be prepacked once on CPU (for the C panel GEMM, else oneDNN).

The packed matmul and when it pays (row counts, dtypes) are :mod:`mmlora.backends.onednn`'s; ``python -m
mmlora.bench cpu`` measures what it gains. The packed copy is kept beside the parameter (not in the state dict): the parameter stays the truth that checkpoints load into, sharding
cuts and tied embeddings share. A packed copy is used only where it gives the same answer as
``F.linear``: CPU inputs of the packed dtype, no autograd, and a parameter unchanged since it was packed
(a later write repacks on the next call). The C panel GEMM takes inputs of any row count in one call;
oneDNN's takes more than ``PACKED_MAX_ROWS`` rows (prefill) in pieces of that many rows, which keeps its
per-row-count primitives few (``onednn.packed_matmul_rows``): on the
2-core AMD EPYC of issue 21, at SmolLM2's shapes and 192-512 rows, the pieces take 0.36-0.47x the time
of ``F.linear`` (MKL). Everywhere else, and where this torch build lacks the ops, the layer is
``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmlora.backends.onednn import (
    PACKED_MAX_ROWS,
    onednn_linear_available,
    pack_weight,
    packed_matmul_available,
    packed_matmul_rows,
)

__all__ = [
    "PACKED_DTYPES",
    "PACKED_MAX_ROWS",
    "PackedLinear",
    "onednn_linear_available",
    "prepack_linears",
    "set_weight_layout",
]

#: Dtypes packed by default. bf16 pays only where the CPU multiplies it natively, which the engine knows
#: (:func:`mmlora.backends.onednn.packable_dtypes`) and passes to :func:`prepack_linears`.
PACKED_DTYPES = (torch.float32,)


class PackedLinear(nn.Linear):
    """``y = x W^T + b``, through a prepacked ``W`` after :meth:`prepack` (CPU, fp32), else ``F.linear``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._packed: torch.Tensor | None = None
        self._packed_version = -1  # the weight's version counter when packed
        self._packed_dtypes = PACKED_DTYPES
        self._released = False  # release() freed the packed copy: the next linear() packs again

    @property
    def is_packed(self) -> bool:
        return self._packed is not None

    def prepack(self, batch_size: int | None = None, dtypes: tuple[torch.dtype, ...] = PACKED_DTYPES) -> bool:
        """Pack the weight (:func:`~mmlora.backends.onednn.pack_weight`; ``batch_size``: the row count to tune the layout for, None: any);
        True when packed, False where not possible (device, a dtype not in ``dtypes``, torch build)."""
        w = self.weight
        self._packed = None
        self._released = False
        self._packed_dtypes = dtypes
        # An inference tensor has no version counter, so a later write to it could not be noticed.
        if w.device.type != "cpu" or w.dtype not in dtypes or w.is_inference():
            return False
        if not packed_matmul_available(w.dtype):
            return False
        self._packed = pack_weight(w, batch_size)
        self._packed_version = w._version
        return True

    def unpack(self) -> None:
        self._packed = None
        self._released = False

    def release(self) -> None:
        """Free the packed copy while another holds the weight packed for this layer's calls (a LoRA
        layer's stacked ``[W; A]``, :mod:`mmlora.backends.cpu_dense`); the next :meth:`linear` call
        packs it again."""
        if self._packed is not None:
            self._packed = None
            self._released = True

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + bias``; the layer's own bias is for :meth:`forward`, a row-parallel partial sum passes
        its own (None on ranks other than 0)."""
        if self._released:
            self._released = False
            self.prepack(dtypes=self._packed_dtypes)
        packed = self._packed
        if (
            packed is None
            or x.dtype != packed.dtype
            or x.device.type != "cpu"
            or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
        ):
            return F.linear(x, self.weight, bias)
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows == 0:
            return F.linear(x, self.weight, bias)
        if self.weight._version != self._packed_version:
            # The parameter was written after packing (e.g. weights reloaded).
            self.prepack(dtypes=self._packed_dtypes)
            packed = self._packed
        out = packed_matmul_rows(x.reshape(rows, x.shape[-1]), packed, bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.bias)


def prepack_linears(
    model: nn.Module, batch_size: int | None = None, dtypes: tuple[torch.dtype, ...] = PACKED_DTYPES
) -> int:
    """Prepack every :class:`PackedLinear` of ``model`` that can be (CPU, one of ``dtypes``); how many
    were packed."""
    return sum(m.prepack(batch_size, dtypes) for m in model.modules() if isinstance(m, PackedLinear))


def set_weight_layout(model: nn.Module, column_major: bool, device_types: tuple[str, ...] = ("cuda",)) -> int:
    """Store every :class:`PackedLinear` weight of ``model`` on one of ``device_types`` column-major (the
    [out, in] parameter a view of its contiguous [in, out] transpose) or, with ``column_major`` False,
    row-major again; the same shape and values. ``F.linear`` then hands cuBLAS a weight already laid out
    as ``x @ W^T`` reads it: on an H100, decode-shape GEMMs of Mistral-7B took 0.93-1.01x as long
    (benchmarks/results/h100-2026-12-05-session31, ``decode_gemm_probe.py``). An experiment: the engine
    calls it at load for ``weight_layout="column-major"`` (off by default); CUDA graphs captured before a
    call hold the old weights (recapture them). A weight that another module shares (tied embeddings,
    read by rows) is left alone. Returns how many changed."""
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    shared = {  # storages other modules read (a tied head's weight is the embedding's parameter itself)
        p.untyped_storage().data_ptr()
        for m in model.modules()
        if not isinstance(m, PackedLinear)
        for p in m.parameters(recurse=False)
    }
    changed = 0
    for m in linears:
        w = m.weight
        if w.device.type not in device_types or w.dim() != 2 or w.untyped_storage().data_ptr() in shared:
            continue
        is_column_major = w.stride() == (1, w.shape[0]) and not w.is_contiguous()
        if is_column_major == column_major:
            continue
        with torch.no_grad():
            w.data = w.data.t().contiguous().t() if column_major else w.data.contiguous()
        m.unpack()  # a CPU packed copy, if any, was made from the old layout
        changed += 1
    return changed

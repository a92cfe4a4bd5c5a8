"""PackedLinear: an ``nn.Linear`` whose weight can be prepacked once for oneDNN on CPU.

A CPU decode step is a few dozen thin GEMMs per layer. ``F.linear`` hands the plain row-major weight to
the BLAS on every call, which re-blocks it each time; oneDNN can take the weight already in its blocked
layout (``torch.ops.mkldnn._reorder_linear_weight``, once) and multiply with it directly
(``torch.ops.mkldnn._linear_pointwise``). ``python -m mmlora.bench cpu`` measures what it gains.

The packed copy is an opaque oneDNN tensor kept beside the parameter (not in the state dict): the
parameter stays the truth that checkpoints load into, sharding cuts and tied embeddings share. A packed
copy is used only where it gives the same answer as ``F.linear``: CPU inputs of the packed dtype, no
autograd, and a parameter unchanged since it was packed (a later write repacks on the next call).
Everywhere else, and where this torch build lacks the ops, the layer is ``F.linear``.

oneDNN builds and caches one primitive per input row count, about 0.5 MB each (measured: 2,048 distinct
row counts through four layers grew RSS by 1 GB). So the packed path takes only decode-sized inputs (at
most :data:`PACKED_MAX_ROWS` rows, where the packed layout pays), padded up to a power of two: a handful
of primitives per layer shape, all built in the first steps. Longer inputs (prefill) use ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

#: Dtypes packed for oneDNN by default. bf16 pays only where the CPU multiplies it natively, which the
#: engine knows (:mod:`mmlora.engine.cpu_decode`) and passes to :func:`prepack_linears`.
PACKED_DTYPES = (torch.float32,)
#: Inputs of more rows take ``F.linear``; fewer are padded to the next power of two (see above).
PACKED_MAX_ROWS = 64


def onednn_linear_available() -> bool:
    """Whether this torch build has the oneDNN prepacked-linear ops."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


class PackedLinear(nn.Linear):
    """``y = x W^T + b``, through a oneDNN-prepacked ``W`` after :meth:`prepack` (CPU, fp32), else
    ``F.linear``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._packed: torch.Tensor | None = None
        self._packed_version = -1  # the weight's version counter when packed
        self._packed_dtypes = PACKED_DTYPES

    @property
    def is_packed(self) -> bool:
        return self._packed is not None

    def prepack(self, batch_size: int | None = None, dtypes: tuple[torch.dtype, ...] = PACKED_DTYPES) -> bool:
        """Pack the weight for oneDNN (``batch_size``: the row count to tune the layout for, None: any);
        True when packed, False where not possible (device, a dtype not in ``dtypes``, torch build)."""
        w = self.weight
        self._packed = None
        self._packed_dtypes = dtypes
        # An inference tensor has no version counter, so a later write to it could not be noticed.
        if w.device.type != "cpu" or w.dtype not in dtypes or w.is_inference():
            return False
        if not onednn_linear_available():
            return False
        with torch.no_grad():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), batch_size)
        self._packed_version = w._version
        return True

    def unpack(self) -> None:
        self._packed = None

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + bias``; the layer's own bias is for :meth:`forward`, a row-parallel partial sum passes
        its own (None on ranks other than 0)."""
        packed = self._packed
        if (
            packed is None
            or x.dtype != packed.dtype
            or x.device.type != "cpu"
            or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
        ):
            return F.linear(x, self.weight, bias)
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if not 0 < rows <= PACKED_MAX_ROWS:
            return F.linear(x, self.weight, bias)
        if self.weight._version != self._packed_version:
            # The parameter was written after packing (e.g. weights reloaded).
            self.prepack(dtypes=self._packed_dtypes)
            packed = self._packed
        flat = x.reshape(rows, x.shape[-1])
        bucket = 1 << (rows - 1).bit_length()
        if bucket != rows:  # zero rows in, their outputs dropped: the same values for the real rows
            flat = torch.cat([flat, flat.new_zeros(bucket - rows, flat.shape[1])])
        out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
        return out[:rows].reshape(*x.shape[:-1], out.shape[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.bias)


def prepack_linears(
    model: nn.Module, batch_size: int | None = None, dtypes: tuple[torch.dtype, ...] = PACKED_DTYPES
) -> int:
    """Prepack every :class:`PackedLinear` of ``model`` that can be (CPU, one of ``dtypes``); how many
    were packed."""
    return sum(m.prepack(batch_size, dtypes) for m in model.modules() if isinstance(m, PackedLinear))

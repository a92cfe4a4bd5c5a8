"""LoRA kernel backends behind one interface (see :mod:`mmlora.backends.base`), chosen by name."""

from mmlora.backends import (
    torch_gather,  # noqa: F401  (registers "torch-gather")
    triton_auto,  # noqa: F401  (registers "triton-auto")
    triton_bgmv,  # noqa: F401  (registers "triton-bgmv")
    triton_fused_decode,  # noqa: F401  (registers "triton-fused")
    triton_sgmv,  # noqa: F401  (registers "triton-sgmv")
)
from mmlora.backends.base import LoRABackend
from mmlora.backends.registry import available_backends, get_backend, register_backend

__all__ = ["LoRABackend", "available_backends", "get_backend", "register_backend"]

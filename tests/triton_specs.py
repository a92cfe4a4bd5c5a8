"""Record the Triton launches of a CPU run, so ``scripts/cuda_compile_check.py`` can compile them for the GPU.

Under ``TRITON_INTERPRET=1`` every ``@triton.jit`` kernel is an ``InterpretedFunction`` and runs in numpy,
which accepts programs the CUDA compiler rejects (an early ``return`` in a jitted helper, a ``tl.dot``
narrower than 16, ...): session 22 lost a device call to one. :func:`install` wraps
``InterpretedFunction.run`` so that every launch also appends one *launch spec* to a JSON-lines file: the
kernel (``module:qualname``), each argument as Triton specializes it (a tensor's dtype and 16-byte
alignment; ints, floats, bools, strings and ``tl.dtype`` constants by value) and the launch options
(``num_warps``, ``num_stages``, ...). Identical specs are written once per process.

With ``execute=False`` the kernels are not run at all (what a real-shape workload needs, where the
interpreter would take minutes a kernel): their floating-point tensor arguments are zeroed instead, so
that what reads their outputs (the sampler and its NaN check) reads zeros, not whatever the buffers held.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch

#: The environment variable that makes tests/conftest.py install the recorder: the file to append to
#: (one file per process: ``<path>.<pid>``).
ENV = "MMLORA_TRITON_SPECS"


def encode(value: Any) -> Any:
    """One launch argument as JSON: what Triton's specialization reads of it."""
    import triton.language as tl

    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch."), "aligned": value.data_ptr() % 16 == 0}
    if isinstance(value, tl.constexpr):
        return encode(value.value)
    if isinstance(value, tl.dtype):
        return {"tl_dtype": value.name}
    if isinstance(value, (tuple, list)):
        return {"tuple": [encode(v) for v in value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a Triton launch argument of type {type(value).__name__} cannot be recorded")


def decode(value: Any) -> Any:
    """The inverse of :func:`encode`: a CPU tensor of the recorded dtype and alignment stands for a tensor
    (Triton's specialization reads only its dtype and pointer)."""
    if isinstance(value, dict):
        if "tensor" in value:
            storage = torch.empty(64, dtype=getattr(torch, value["tensor"]))
            return storage if value["aligned"] else storage[1:]
        if "tl_dtype" in value:
            return _tl_dtype(value["tl_dtype"])
        if "tuple" in value:
            return tuple(decode(v) for v in value["tuple"])
    return value


def _tl_dtype(name: str) -> Any:
    import triton.language as tl

    for candidate in vars(tl).values():
        if isinstance(candidate, tl.dtype) and candidate.name == name:
            return candidate
    raise ValueError(f"no triton.language dtype named {name!r}")


def install(path: str, execute: bool = True) -> Callable[[], None]:
    """Append every interpreted launch of this process to ``path`` (see the module docstring); returns
    the function that removes this recorder again (one installed before it keeps recording)."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run
    seen: set[str] = set()

    def recording_run(self: InterpretedFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        spec = {
            "kernel": f"{self.fn.__module__}:{self.fn.__qualname__}",
            "args": [encode(a) for a in args],
            "kwargs": {k: encode(v) for k, v in sorted(kwargs.items())},
        }
        line = json.dumps(spec, sort_keys=True)
        if line not in seen:
            seen.add(line)
            with open(path, "a") as f:
                f.write(line + "\n")
        if not execute:
            for a in args:  # what reads the outputs (sampling, the NaN check) then reads zeros, not garbage
                if isinstance(a, torch.Tensor) and a.is_floating_point():
                    a.zero_()
            return None
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    def uninstall() -> None:
        InterpretedFunction.run = run  # type: ignore[method-assign]

    InterpretedFunction.run = recording_run  # type: ignore[method-assign]
    return uninstall


def install_from_env() -> None:
    """:func:`install` to ``$MMLORA_TRITON_SPECS.<pid>`` when that variable is set."""
    path = os.environ.get(ENV)
    if path:
        install(f"{path}.{os.getpid()}")


def read(paths: list[str]) -> list[dict[str, Any]]:
    """The distinct launch specs of these files."""
    lines: dict[str, None] = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.strip():
                    lines.setdefault(line.strip())
    return [json.loads(line) for line in lines]

"""Cheap launches of compiled Triton kernels: what an eager forward pays per kernel on the host.

``kernel[grid](*args)`` goes through ``JITFunction.run`` on every call: it binds the arguments, computes
each one's specialization (dtype, 16-byte alignment, ``== 1``, divisibility by 16), builds the cache
key from them and the options, checks the kernel's globals, then launches. On the H200's host that cost
about 45-80 us a launch (``benchmarks/scripts/lora_host_overhead.py``, 2026-12-01), three to five times a
``torch.mm`` launch: an eager mixed step of Mistral-7B launches about 14 Triton kernels a layer, so
its forward was host-bound (issue 13).

:class:`FastKernel` wraps a ``@triton.jit`` function with the same call syntax. The first call for a
*launch key* goes through Triton (which compiles or finds the kernel, and launches it); later calls with
that key call the compiled kernel's launcher directly. The key holds everything Triton specializes on,
computed the way Triton does (``triton.backends.compiler.BaseBackend`` and ``specialize_impl``): each
tensor's dtype and whether its pointer is 16-byte aligned; each integer's type range and, unless the
kernel marks it ``do_not_specialize``, whether it is 1 or a multiple of 16; floats and bools by type;
constexprs by value; plus the launch options and the device. So two calls share a compiled kernel here
only where Triton would give them the same one.

Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``), with a launch enter hook set (a
profiler), or in a version whose launch convention this module does not know: then every call goes
through Triton unchanged. ``MMLORA_TRITON_FAST_LAUNCH=0`` turns the direct path off (an A/B switch).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

try:
    import triton
    from triton import knobs
    from triton.runtime.jit import JITFunction
except ImportError:  # pragma: no cover - triton is a dependency; kept importable for tooling
    triton = knobs = JITFunction = None  # type: ignore[assignment]

#: ``JITFunction.run``'s launch call in the Triton versions this module follows (3.2 to 3.9): the
#: direct path passes the compiled kernel exactly these arguments.
_RUN_CALL = "kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata"


def _convention_known() -> bool:
    if JITFunction is None:
        return False
    try:
        return _RUN_CALL in inspect.getsource(JITFunction.run).replace("\n", " ").replace("  ", " ")
    except (OSError, TypeError):
        return False


def fast_launch_enabled() -> bool:
    """Whether :class:`FastKernel` may launch compiled kernels directly in this process."""
    return (
        os.environ.get("MMLORA_TRITON_FAST_LAUNCH", "1") != "0"
        and os.environ.get("TRITON_INTERPRET", "0") != "1"
        and _CONVENTION_KNOWN
    )


_CONVENTION_KNOWN = _convention_known()
_I32_MIN, _I32_MAX, _I64_MAX = -(2**31), 2**31 - 1, 2**63 - 1


def _hooked(hook: Any) -> bool:
    """Whether a Triton launch hook is set: None (before 3.9) or an empty ``HookChain`` (3.9) is not."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _int_spec(v: int, specialize: bool) -> tuple[int, ...]:
    kind = 0 if _I32_MIN <= v <= _I32_MAX else (1 if v <= _I64_MAX else 2)
    if not specialize:
        return (kind,)
    return (kind, v == 1, v % 16 == 0)


def arg_spec(value: Any, specialize: bool) -> Any:
    """What Triton specializes a runtime argument on (see the module doc): equal for two values exactly
    where Triton's specialization of them is equal. Raises TypeError for a kind it does not cover."""
    cls = type(value)
    if cls is int:
        return _int_spec(value, specialize)
    if cls is bool:
        return "i1"
    if cls is float:
        return "fp32"
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    raise TypeError(f"no launch key for an argument of type {cls.__name__}")


class FastKernel:
    """A ``@triton.jit`` function launched as ``FastKernel(fn)[grid](*args, **constexprs_and_options)``
    with the same results as ``fn[grid](...)`` and, after the first call of each launch key, a fraction
    of its host time. Arguments are passed positionally up to the first constexpr, then by keyword (the
    way this package's kernels are called); launch options (``num_warps``, ``num_stages``, ...) by
    keyword."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.__doc__ = getattr(fn, "__doc__", None)
        params = list(getattr(fn, "params", []))
        self.names = [p.name for p in params]
        self.constexpr = [p.is_constexpr for p in params]
        self.specialize = [not p.do_not_specialize for p in params]
        self._index = {name: i for i, name in enumerate(self.names)}
        self._compiled: dict[tuple[Any, ...], Any] = {}
        self.direct_launches = 0  # calls that skipped JITFunction.run (tests, benchmarks)

    def __getitem__(self, grid: Sequence[int]) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def _bound(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], tuple[Any, ...]]:
        """(every parameter's value in signature order, the launch options as a sorted tuple)."""
        values = list(args)
        names = self.names
        n = len(names)
        for name in names[len(args) :]:
            if name not in kwargs:
                raise TypeError(f"{self.fn}: missing argument {name!r}")
            values.append(kwargs[name])
        if len(values) != n:
            raise TypeError(f"{self.fn}: {len(values)} arguments for {n} parameters")
        options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in self._index))
        return values, options

    def launch_key(self, values: list[Any], options: tuple[Any, ...], device: int) -> tuple[Any, ...]:
        """The cache key of a launch (see the module doc)."""
        spec = self.specialize
        return (
            device,
            options,
            *(v if c else arg_spec(v, spec[i]) for i, (v, c) in enumerate(zip(values, self.constexpr))),
        )

    def launch(self, grid: Sequence[int], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        runtime = knobs.runtime if _FAST else None
        if runtime is None or _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook):
            self.fn[grid](*args, **kwargs)
            return
        values, options = self._bound(args, kwargs)
        device = torch.cuda.current_device()
        try:
            key = self.launch_key(values, options, device)
        except TypeError:  # an argument kind the key does not cover: Triton decides
            self.fn[grid](*args, **kwargs)
            return
        g = tuple(grid)
        grid3 = (g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1)
        self._run_keyed(key, grid3, values, dict(options), device)

    def plan(
        self, grid: Sequence[int], args: tuple[Any, ...], kwargs: dict[str, Any], tensor_pos: tuple[int, ...]
    ) -> LaunchPlan:
        """A :class:`LaunchPlan` of ``args`` / ``kwargs`` (as for ``self[grid](...)``) whose arguments at
        positions ``tensor_pos`` are given at each launch instead (those in ``args`` are ignored)."""
        g = tuple(grid)
        grid3 = (g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1)
        if not self.names:  # Triton's interpreter: no parameter list; every launch goes through it
            return LaunchPlan(grid3, list(args), tuple(tensor_pos), (), dict(kwargs))
        values, options = self._bound(args, kwargs)
        return LaunchPlan(grid3, values, tuple(tensor_pos), options, dict(options))

    def launch_plan(self, plan: LaunchPlan, tensors: Sequence[torch.Tensor]) -> None:
        """Launch ``plan`` with ``tensors`` at its ``tensor_pos``: the same launch as ``self[grid](...)``
        with those arguments."""
        values = plan.values
        for i, t in zip(plan.tensor_pos, tensors):
            values[i] = t
        runtime = knobs.runtime if _FAST and self.names else None
        if runtime is None or _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook):
            self.fn[plan.grid](*values, **plan.kwargs)
            return
        if plan.static_key is None:  # the first direct launch of this plan keys its fixed arguments
            fixed = list(values)
            for i in plan.tensor_pos:
                fixed[i] = None  # keyed per launch
            try:
                plan.static_key = self.launch_key(fixed, plan.options, torch.cuda.current_device())
            except TypeError:  # an argument kind the key does not cover: Triton decides, every time
                plan.static_key = _UNKEYABLE
        if plan.static_key is _UNKEYABLE:
            self.fn[plan.grid](*values, **plan.kwargs)
            return
        key = (plan.static_key, *[(t.dtype, t.data_ptr() % 16 == 0) for t in tensors])
        self._run_keyed(key, plan.grid, values, plan.kwargs, torch.cuda.current_device())

    def _run_keyed(
        self, key: tuple, grid3: tuple[int, int, int], values: list[Any], options: dict, device: int
    ) -> None:
        """Launch the compiled kernel of ``key`` directly; without one yet, through Triton (which compiles
        or finds it, and launches), remembering what it returns."""
        kernel = self._compiled.get(key)
        if kernel is None:
            kernel = self.fn[grid3](*values, **options)
            if kernel is not None and getattr(kernel, "function", None) is not None:
                self._compiled[key] = kernel
            return
        kernel.run(
            *grid3,
            _current_stream(device),
            kernel.function,
            kernel.packed_metadata,
            None,
            None,
            None,
            *values,
        )
        self.direct_launches += 1


_UNKEYABLE = ("unkeyable",)


class LaunchPlan:
    """One launch site's arguments for a forward, all but the tensors at ``tensor_pos`` (given per call):
    built once by :meth:`FastKernel.plan` and launched by :meth:`FastKernel.launch_plan` from every layer
    (the layers of a model share module shapes and the forward's batch). Its key part of the fixed
    arguments is computed once; a launch adds only its tensors' dtypes and alignments."""

    __slots__ = ("grid", "values", "tensor_pos", "options", "kwargs", "static_key")

    def __init__(
        self,
        grid: tuple[int, int, int],
        values: list[Any],
        tensor_pos: tuple[int, ...],
        options: tuple,
        kwargs: dict,
    ) -> None:
        self.grid, self.values, self.tensor_pos, self.options, self.kwargs = (
            grid,
            values,
            tensor_pos,
            options,
            kwargs,
        )
        self.static_key: tuple[Any, ...] | None = None


_FAST = fast_launch_enabled()
# What Triton's CUDA driver itself asks for the current stream (a raw handle, no Stream object built).
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda device: torch.cuda.current_stream(device).cuda_stream
)


_WRAPPED: dict[Any, FastKernel] = {}


def fast(fn: Any) -> FastKernel:
    """The one :class:`FastKernel` of a ``@triton.jit`` function: ``fast(kernel)[grid](*args, **kw)``."""
    wrapped = _WRAPPED.get(fn)
    if wrapped is None:
        wrapped = _WRAPPED[fn] = FastKernel(fn)
    return wrapped

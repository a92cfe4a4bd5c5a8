"""CPU plans: a decode forward recorded once as the chain of C kernel calls it makes, then replayed in one
C call, as a CUDA graph replays a GPU step.

A CPU decode step of a thin model (SmolLM2: 30 layers, 16 rows) calls the C kernels of
:mod:`mmlora.backends.cpu_kernels` about 400 times. Each call from Python (the module forwards, the wrapper
that allocates and checks, ctypes) costs several times the kernel's own work: about 6 of a 24 ms bf16 forward
went outside the kernels, and much of what was timed inside them was the call. :func:`capture` runs a
forward once while writing down every kernel call with its arguments (:class:`Kernel`);
:meth:`CpuPlan.replay` then runs the same calls on the same buffers from C (``plan_run`` in
``cpu_plan.c``), with no Python between them.

What makes a replay right, as for CUDA graphs:

- Every tensor the forward allocates is kept by the plan, so each recorded pointer stays valid, and a
  replay writes the same buffers the capture did.
- Whatever changes from step to step must be in buffers written before the replay: the caller's static
  inputs (``mmlora.engine.cpu_graph``), and host data a layer turns into a tensor, which it declares with
  :func:`host_input` (the plan re-runs that fill before every replay).
- Everything else a recorded call reads must not change while the plan lives: weights, the KV cache
  (addressed through the static block tables), the LoRA pool's stacked copies (the caller drops its plans
  when the pool is written).

A torch dispatch mode watches the capture for the torch ops between the kernel calls. Views and
allocations need nothing. Other ops of the ``aten`` namespace are recorded and re-run in their place in a
replay (the embedding lookup, a dtype cast, a torch op a family needs). A capture is refused (:func:`capture`
returns its reason and no plan) where a replay could not be right: a tensor made from Python data inside
the forward (``torch.tensor``, not declared as a host input), a value read back to Python (``.item()``,
``.tolist()``), an op whose output shape depends on data, a random op, an op outside ``aten`` (a
collective). The capture's own forward ran for real either way, so its result stands.
"""

from __future__ import annotations

import contextlib
import ctypes
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mmlora.backends import cpu_kernels

_ALLOCATIONS = frozenset(
    {
        torch.ops.aten.empty.memory_format,
        torch.ops.aten.empty_strided.default,
        torch.ops.aten.empty_like.default,
        torch.ops.aten.new_empty.default,
        torch.ops.aten.new_empty_strided.default,
    }
)
_REFUSED_TAGS = (
    torch.Tag.data_dependent_output,
    torch.Tag.dynamic_output_shape,
    torch.Tag.nondeterministic_seeded,
)


def _aliases_input(out: Any, args: tuple) -> bool:
    """Whether every tensor ``out`` holds shares storage with a tensor among ``args`` (a view made)."""
    inputs = {t.untyped_storage().data_ptr() for t in tree_flatten(args)[0] if torch.is_tensor(t)}
    outs = [t for t in tree_flatten(out)[0] if torch.is_tensor(t)]
    return all(t.untyped_storage().data_ptr() in inputs for t in outs)


def _integer_index(func: torch._ops.OpOverload, args: tuple) -> bool:
    """``aten.index`` with integer indices only (a gather, as ``table[positions]``): tagged with a dynamic
    output shape for boolean masks, but its shape follows the indices' here."""
    if func is not torch.ops.aten.index.Tensor:
        return False
    return all(i is None or not (i.dtype == torch.bool or i.dtype == torch.uint8) for i in args[1])


_ACTIVE: _Recording | None = None  # the capture in progress, if any
_TIMED: dict[str, list[float]] | None = None  # while timed() is on


def host_input(fill: Callable[[], None]) -> None:
    """Run ``fill`` (it writes host data into a tensor the forward then reads) now, and, while a plan is
    being captured, again before each of that plan's replays: the data a forward derives from the step's
    host state (``LoRABatchInfo``'s host lists) is part of a replay's inputs. ``fill`` must read only state
    the caller refreshes before each replay."""
    rec = _ACTIVE
    if rec is None or not rec.owns_thread():
        fill()
        return
    rec.host_inputs.append(fill)
    with rec.paused():
        fill()


class Kernel:
    """A compiled kernel as its callers call it (``lib.<name>(...)``, set up by
    :func:`mmlora.backends.cpu_kernels._library`): the ctypes function, and while a plan is being captured,
    the call written down first (``index``: the kernel's place in ``cpu_plan.c``'s PLAN_KERNELS)."""

    __slots__ = ("fn", "index")

    def __init__(self, fn: Callable, index: int) -> None:
        self.fn, self.index = fn, index

    def __call__(self, *args: object) -> object:
        rec = _ACTIVE
        if rec is not None:
            rec.kernel_call(self.index, args)
        return self.fn(*args)


class CpuPlan:
    """A captured forward (see the module docstring): :meth:`replay` re-runs its host-input fills, then its
    steps (runs of C kernel calls, and the torch ops between them) in order."""

    def __init__(
        self, steps: list[Callable[[], None]], keep: list[Any], host_inputs: list, kernel_calls: int
    ):
        self._steps = steps
        self._keep = keep  # every tensor the capture made (the kernel runs hold their own argument words)
        self._host_inputs = host_inputs
        self.kernel_calls = kernel_calls
        self.torch_ops = sum(not isinstance(s, _KernelRun) for s in steps)

    def replay(self) -> None:
        for fill in self._host_inputs:
            fill()
        for step in self._steps:
            step()


@contextlib.contextmanager
def timed() -> Iterator[dict[str, list[float]]]:
    """Within it, every kernel call a replay makes is timed (in C): yields {kernel name: [calls, seconds]},
    summed over the replays inside (a profile of a replayed step, whose kernels Python does not see)."""
    global _TIMED
    if _TIMED is not None:
        raise RuntimeError("CPU plan: timed() is already on")
    _TIMED = {}
    try:
        yield _TIMED
    finally:
        _TIMED = None


class _KernelRun:
    """Consecutive recorded kernel calls, run in one ``plan_run`` call."""

    __slots__ = ("_run", "_words", "_ptr", "_count", "_kinds")

    def __init__(self, calls: list[list[int]]) -> None:
        flat = [w for call in calls for w in call]
        self._words = (ctypes.c_int64 * len(flat))(*flat)
        self._ptr = ctypes.addressof(self._words)
        self._count = len(calls)
        self._kinds = [call[0] for call in calls]
        self._run = cpu_kernels._library().plan_run

    def __call__(self) -> None:
        if _TIMED is None:
            status = self._run(self._ptr, self._count, None)
        else:
            ns = (ctypes.c_int64 * self._count)()
            status = self._run(self._ptr, self._count, ns)
            name_of = cpu_kernels._library().plan_kernel_name
            for kind, t in zip(self._kinds, ns):
                entry = _TIMED.setdefault(name_of(kind).decode(), [0, 0.0])
                entry[0] += 1
                entry[1] += t * 1e-9
        if status > 0:
            raise MemoryError(f"CPU plan: kernel call {status - 1} ran out of memory (its GEMM row buffer)")
        if status < 0:
            raise RuntimeError(f"CPU plan: kernel call {-status - 1} is not in this build of the C kernels")


class _TorchOp:
    """One recorded torch op, re-run in a replay: in place for a mutating op, else into the tensors the
    capture's call returned (which later steps read)."""

    __slots__ = ("_func", "_args", "_kwargs", "_outs")

    def __init__(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: Any) -> None:
        self._func, self._args, self._kwargs = func, args, kwargs
        self._outs = (
            None if func._schema.is_mutable else [t for t in tree_flatten(out)[0] if torch.is_tensor(t)]
        )

    def __call__(self) -> None:
        result = self._func(*self._args, **self._kwargs)
        if self._outs is not None:
            for dst, src in zip(self._outs, (t for t in tree_flatten(result)[0] if torch.is_tensor(t))):
                dst.copy_(src)


class _Recording(TorchDispatchMode):
    """The capture in progress: kernel calls (:class:`Kernel`) and torch ops (this dispatch mode)
    in the order they ran."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[Callable[[], None]] = []
        self.calls: list[list[int]] = []  # the kernel calls since the last torch op
        self.kernel_calls = 0
        self.keep: list[Any] = []
        self.host_inputs: list[Callable[[], None]] = []
        self.refused: str | None = None
        self._paused = 0
        # Only the capturing thread's calls belong to the plan (another engine in this process may run a
        # forward meanwhile; the dispatch mode is per thread already, the kernel hook is not).
        self._thread = threading.get_ident()

    def owns_thread(self) -> bool:
        return threading.get_ident() == self._thread

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def kernel_call(self, index: int, args: tuple) -> None:
        if self._paused or not self.owns_thread():
            return
        words = [index]
        for a in args:
            if a is None:
                words.append(0)
            elif isinstance(a, float):
                words.append(struct.unpack("<q", struct.pack("<d", a))[0])
            else:
                words.append(int(a))
        self.calls.append(words)
        self.kernel_calls += 1

    def _flush(self) -> None:
        if self.calls:
            self.steps.append(_KernelRun(self.calls))
            self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._paused or self.refused is not None:
            return out
        self.keep.append(out)
        lift = func is torch.ops.aten.lift_fresh.default
        # ``to`` and ``reshape`` are alias-annotated but copy where they convert: those are recorded below.
        if func in _ALLOCATIONS or (func.is_view and not lift and _aliases_input(out, args)):
            return out
        reason = None
        if func.namespace != "aten":
            reason = "an op outside aten"
        elif lift:
            reason = "a tensor made from Python data (torch.tensor) inside the forward"
        elif any(tag in func.tags for tag in _REFUSED_TAGS) and not _integer_index(func, args):
            reason = "an op whose result depends on data or on a random generator"
        if reason is not None:
            self.refused = f"{reason}: {func}"
            return out
        self._flush()
        self.steps.append(_TorchOp(func, args, kwargs, out))
        return out

    def plan(self) -> CpuPlan:
        self._flush()
        return CpuPlan(self.steps, self.keep, self.host_inputs, self.kernel_calls)


def capture(forward: Callable[[], Any]) -> tuple[Any, CpuPlan | None, str | None]:
    """Run ``forward()`` once, recording it. Returns its result, and the plan that replays it (every
    tensor it allocated, its result's included, is rewritten in place by each replay), or None and why it
    cannot be replayed. Needs the C kernels (:func:`cpu_kernels.available`); not reentrant."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("CPU plan: a capture is already in progress")
    if not cpu_kernels.available():
        raise RuntimeError("CPU plan: the CPU kernels are off or could not be built here")
    rec = _Recording()
    _ACTIVE = rec
    try:
        with rec:
            result = forward()
    finally:
        _ACTIVE = None
    if rec.refused is not None:
        return result, None, rec.refused
    return result, rec.plan(), None

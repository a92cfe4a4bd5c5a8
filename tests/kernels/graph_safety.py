"""What a CUDA graph cannot follow, checked on any device (CPU under the Triton interpreter): a graph
replays the launches of its capture with the addresses it captured, so every step a graph runner serves
must make exactly the launches and torch ops of a capture of its graph key, and read no tensor made
before the forward that is not one of the runner's static buffers. Used by the mixed-step and decode
graph tests, with the helpers they share (:class:`KeyLog`, :func:`assert_same_outputs`)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable

import torch


class LaunchLog:
    """Every kernel launch (FastKernel: grid, scalars, tensors) and every torch op (shapes, scalars) of the
    forwards run while recording. A tensor stands for the persistent buffer it lives in (weights, KV
    cache, adapter pool, the runner's and the routing's static buffers) or for "a temporary": a graph
    replays the addresses it captured, so a step's launches must be its capture's, tensor for tensor."""

    def __init__(self, persistent: dict[int, str]) -> None:
        self.persistent = persistent
        self.calls: list[tuple] = []
        self.created: set[int] = set()  # storages the recorded forward allocated
        self.on = False

    def start(self) -> None:
        self.calls, self.created, self.on = [], set(), True

    def arg(self, v):  # noqa: ANN001, ANN201
        if isinstance(v, torch.Tensor):
            ptr = v.untyped_storage().data_ptr()
            # Neither a persistent buffer nor made by this forward: a graph would keep reading what it
            # captured, not this step's tensor.
            where = self.persistent.get(
                ptr, "temporary" if ptr in self.created or v.numel() == 0 else "outside"
            )
            offset = v.storage_offset() if where != "temporary" else None
            return ("tensor", where, offset, v.dtype, tuple(v.shape), tuple(v.stride()))
        if isinstance(v, (list, tuple)):
            return tuple(self.arg(x) for x in v)
        if isinstance(v, dict):
            return tuple(sorted((k, self.arg(x)) for k, x in v.items()))
        return v


def record_launches(monkeypatch, log: LaunchLog) -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    from mmlora.triton_launch import FastKernel

    launch, launch_plan = FastKernel.launch, FastKernel.launch_plan

    def quiet(call, *args):  # noqa: ANN001, ANN002, ANN202
        # The launch's own torch ops (the interpreter copies its arguments) are not the step's.
        on, log.on = log.on, False
        try:
            return call(*args)
        finally:
            log.on = on

    def logged_launch(self, grid, args, kwargs):  # noqa: ANN001, ANN202
        if log.on:
            log.calls.append(
                (getattr(self.fn, "__name__", str(self.fn)), tuple(grid), log.arg(args), log.arg(kwargs))
            )
        return quiet(launch, self, grid, args, kwargs)

    def logged_plan(self, plan, tensors):  # noqa: ANN001, ANN202
        if log.on:
            values = list(plan.values)
            for i, t in zip(plan.tensor_pos, tensors):
                values[i] = t
            log.calls.append(
                (getattr(self.fn, "__name__", str(self.fn)), plan.grid, log.arg(values), log.arg(plan.kwargs))
            )
        return quiet(launch_plan, self, plan, tensors)

    monkeypatch.setattr(FastKernel, "launch", logged_launch)
    monkeypatch.setattr(FastKernel, "launch_plan", logged_plan)

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            kwargs = kwargs or {}
            if log.on and func.namespace == "aten":
                log.calls.append((str(func), log.arg(args), log.arg(kwargs)))
            out = func(*args, **kwargs)
            if log.on:
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor):
                        log.created.add(t.untyped_storage().data_ptr())
            return out

    log.mode = Ops()


def persistent_storages(engine, extra: Iterable[tuple[str, torch.Tensor]]) -> dict[int, str]:  # noqa: ANN001
    """Storage pointer -> name of every buffer that outlives a forward: weights, the KV cache, the adapter
    pool, the routing's buffers, RoPE tables, and ``extra`` (a runner's static inputs)."""
    runner, info = engine.runner, engine.runner.lora.info
    named = [
        *((f"param {n}", t) for n, t in runner.model.named_parameters()),
        *((f"buffer {n}", t) for n, t in runner.model.named_buffers()),
        ("kv cache", engine.kv_cache.data),
        *(
            (f"routing {n}", getattr(info, n))
            for n in ("seg_indptr", "seg_lens", "weight_indices", "token_slots", "ranks")
        ),
        *extra,
    ]
    for m in runner.model.modules():
        w = getattr(m, "weights", None)
        if w is not None and hasattr(w, "A"):
            named += [("pool A", w.A), ("pool B", w.B), ("pool scalings", w.scalings)]
        for t in getattr(m, "_cache", None) or ():  # RoPE tables (built by a first forward)
            named.append(("rope table", t))
    out: dict[int, str] = {}
    for name, t in named:
        out.setdefault(t.untyped_storage().data_ptr(), name)
    return out


#: aten ops that copy a device value to the host (so wait for the device): a stream being captured into a
#: CUDA graph refuses them. ``.item()`` and ``.tolist()`` reach ``item`` or ``_local_scalar_dense``; the
#: others size their outputs by the data.
HOST_SYNC_OPS = frozenset(
    f"aten.{op}.default"
    for op in (
        "item",
        "_local_scalar_dense",
        "nonzero",
        "masked_select",
        "is_nonzero",
        "equal",
        "_unique2",
        "unique_dim",
    )
)


def assert_steps_replay_their_captures(
    log: LaunchLog,
    steps: list[tuple[Hashable, list]],
    capture: Callable[[Hashable], None],
) -> dict[Hashable, list]:
    """``steps``: (graph key, the logged calls of the step's forward) per step; ``capture(key)`` prepares
    and runs the forward a capture of ``key`` runs (logged here). Asserts each step's calls equal its
    key's capture's, and that no step read a tensor from outside; returns the captures' calls."""
    captured: dict[Hashable, list] = {}
    for key, calls in steps:
        if key not in captured:
            with torch.inference_mode(), log.mode:
                capture(key)
            log.on = False
            captured[key] = log.calls
        ref = captured[key]
        for k, (got, want) in enumerate(zip(calls, ref)):
            assert got == want, (key, [str(c)[:200] for c in calls[max(0, k - 2) : k + 1]])
        assert len(calls) == len(ref), key
    outside = {str(c)[:300] for _, calls in steps for c in calls if "'outside'" in str(c)}
    assert not outside, outside  # a forward read a tensor made before it that is no static buffer
    syncs = {str(c[0]) for calls in captured.values() for c in calls if str(c[0]) in HOST_SYNC_OPS}
    assert not syncs, syncs  # fine on CPU, but a CUDA capture fails on them (they wait for the device)
    return captured


class KeyLog(dict):
    """A graph runner's graphs dict, logging every key a replay looks up."""

    def __init__(self, graphs: dict) -> None:
        super().__init__(graphs)
        self.used: list[tuple] = []

    def __getitem__(self, key):  # noqa: ANN001, ANN204
        self.used.append(key)
        return super().__getitem__(key)


def assert_same_outputs(ref: list, got: list, atol: float) -> None:
    """The same greedy tokens, and sampled-token logprobs within ``atol``, request by request."""
    for r, g in zip(ref, got):
        assert g.output_ids == r.output_ids, (r.output_ids, g.output_ids)
        assert max(abs(a - b) for a, b in zip(r.logprobs, g.logprobs)) < atol

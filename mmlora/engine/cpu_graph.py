"""CPU decode steps replayed from recorded plans: the CUDA-graph runner's static buffers and LoRA routing
(:mod:`mmlora.engine.cuda_graph`), with a :class:`~mmlora.backends.cpu_plan.CpuPlan` in place of each graph,
and a bucket per batch size (a CPU step's cost grows with its rows, so none are padded, and no KV page is
set aside for padding).

A CPU decode forward is a few hundred C kernel calls, each cheaper than the Python that makes it; a plan
replays them in one C call. Plans are made on demand, not at start-up: a key (batch bucket, LoRA rank bound,
layout) runs eagerly the first time it comes (layers build their caches then: rotary tables, the LoRA
modules' stacked weights), is captured the second time (the capture's forward is that step's forward), and
replays after that. What a plan reads stays fixed while it lives; the adapter pool does not, so every write
into it (a load, an eviction) drops the plans, and they are made again the same way. At most
``max_plans`` are kept (least recently used first out): each holds the activations of its bucket.

Where a capture is refused (:func:`mmlora.backends.cpu_plan.capture` says why: a torch fallback that makes
tensors from Python data, say) the key runs eagerly until the pool changes, with one warning per reason.
Used where the C kernels are built, on one process (no tensor parallelism); ``disable_cpu_graph`` turns it
off.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from mmlora.backends import cpu_kernels, cpu_plan
from mmlora.distributed.state import tp_group
from mmlora.engine.cuda_graph import CudaGraphRunner

logger = logging.getLogger(__name__)


def cpu_decode_graphs(runner, max_batch_size: int, max_model_len: int) -> CpuGraphRunner | None:  # noqa: ANN001
    """A CpuGraphRunner, or None (with the reason logged) where this engine cannot replay CPU plans."""
    reason = None
    if runner.device.type != "cpu":
        reason = f"the engine runs on {runner.device}"
    elif not cpu_kernels.available():
        reason = "the CPU kernels are off or could not be built here"
    elif tp_group().is_parallel:
        reason = "tensor parallelism"
    elif runner.lora.backend_name != "torch-gather":
        # Triton kernels on CPU run in its interpreter, whose writes no capture sees.
        reason = f"LoRA backend {runner.lora.backend_name!r} (plans record torch-gather's CPU kernels)"
    elif getattr(runner.attention, "name", "") != "torch":
        reason = f"attention backend {runner.attention.name!r} (plans record the torch backend's CPU kernels)"
    if reason:
        logger.info("CPU decode plans off: %s", reason)
        return None
    return CpuGraphRunner(runner, max_batch_size, max_model_len)


class _Entry:
    __slots__ = ("plan", "logits")

    def __init__(self, plan: cpu_plan.CpuPlan, logits: torch.Tensor) -> None:
        self.plan, self.logits = plan, logits


class CpuGraphRunner(CudaGraphRunner):
    """Decode steps of a CPU :class:`~mmlora.engine.model_runner.ModelRunner` over static buffers, replayed
    from plans (see the module docstring)."""

    pads_rows = False  # a CPU step costs per row: one bucket per batch size

    def __init__(self, runner, max_batch_size: int, max_model_len: int, max_plans: int = 8) -> None:  # noqa: ANN001
        self.max_plans = max_plans
        self.plans: OrderedDict[tuple[int, int, str, int], _Entry] = OrderedDict()
        self._generation = runner.lora.pool_generation
        self._ran: set[tuple[int, int, str, int]] = set()  # keys run eagerly in this pool generation
        self._refused: dict[tuple[int, int, str, int], str] = {}
        self._warned: set[str] = set()
        self.num_captures = 0
        self.num_plan_replays = 0
        super().__init__(runner, max_batch_size, max_model_len, capture=False)

    def _replay(self, bs: int, bound: int, layout: str) -> torch.Tensor:
        self.num_replays += 1
        self.last_key = (bs, bound, layout)
        generation = self.lora.pool_generation
        if generation != self._generation:
            self._generation = generation
            self.plans.clear()
            self._ran.clear()
            self._refused.clear()
        key = (bs, bound, layout, torch.get_num_threads())
        entry = self.plans.get(key)
        if entry is not None:
            self.plans.move_to_end(key)
            entry.plan.replay()
            self.num_plan_replays += 1
            return entry.logits
        if key not in self._ran or key in self._refused:
            self._ran.add(key)
            return self._forward(bs)
        logits, plan, reason = cpu_plan.capture(lambda: self._forward(bs))
        if plan is None:
            self._refused[key] = reason
            log = logger.debug if reason in self._warned else logger.warning  # once per reason
            self._warned.add(reason)
            log("CPU decode plan for batch bucket %d (LoRA rank bound %d) refused: %s", bs, bound, reason)
            return logits
        self.num_captures += 1
        self.plans[key] = _Entry(plan, logits)
        if len(self.plans) > self.max_plans:
            self.plans.popitem(last=False)
        logger.debug(
            "CPU decode plan for batch bucket %d (LoRA rank bound %d): %d kernel calls, %d torch ops",
            bs, bound, plan.kernel_calls, plan.torch_ops,
        )  # fmt: skip
        return logits

    def close(self) -> None:
        self.plans.clear()
        super().close()

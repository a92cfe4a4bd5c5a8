"""Continuous batching with chunked prefill, preemption by recompute, and LoRA-aware admission.

Each step takes, under a token budget: first every running request's next tokens (one decode token,
or the next prefill chunk), preempting the newest running requests when KV pages run out; then
waiting requests in arrival order. A waiting request with an adapter is admitted only if its adapter
holds, or can take, a device slot without evicting an adapter of the running batch. When the head of
the queue waits for a slot, only base-only requests may pass it, so slots drain and the head gets one:
adapters are served in arrival order.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field

from mmlora.config import SchedulerConfig
from mmlora.engine.request import Request, Status
from mmlora.kvcache.allocator import BlockAllocator
from mmlora.lora.manager import LoRAManager

logger = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    """Requests of one forward, in batch order, with the number of new tokens each contributes."""

    requests: list[Request] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)

    def add(self, req: Request, n: int) -> None:
        self.requests.append(req)
        self.num_new.append(n)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, lora: LoRAManager) -> None:
        self.config = config
        self.allocator = allocator
        self.lora = lora
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def _busy_adapters(self) -> set[int]:
        return {r.lora.uid for r in self.running if r.lora is not None}

    def _grow(self, req: Request, n: int) -> bool:
        need = self.allocator.blocks_needed(req.num_computed + n, len(req.blocks))
        if not self.allocator.can_allocate(need):
            return False
        req.blocks.extend(self.allocator.allocate(need))
        return True

    def release(self, req: Request) -> None:
        """Give back a request's pages (its adapter reference is the engine's to release)."""
        if req.blocks:
            self.allocator.free(req.blocks)
            req.blocks = []
        req.slot = -1

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.release(req)
        req.num_computed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        logger.info("preempted %s (KV cache full); it will be recomputed", req.rid)

    def schedule(self) -> tuple[ScheduledBatch, list[Request]]:
        """The next batch, and requests that failed to schedule (``req.error`` says why)."""
        batch = ScheduledBatch()
        failed: list[Request] = []
        budget = self.config.max_num_batched_tokens
        for req in list(self.running):
            if req.status is not Status.RUNNING or budget <= 0:
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            if self.allocator.blocks_needed(req.num_computed + n, 0) > self.allocator.num_blocks:
                req.error = (
                    f"request needs more KV cache than the engine has ({self.allocator.num_blocks} pages)"
                )
                self.running.remove(req)
                self.release(req)
                failed.append(req)
                continue
            while not self._grow(req, n):
                victim = next(
                    (r for r in reversed(self.running) if r is not req and r not in batch.requests), None
                )
                self._preempt(victim or req)
                if victim is None:
                    break
            else:
                batch.add(req, n)
                budget -= n
        self._admit(batch, budget, failed)
        return batch, failed

    def _admit(self, batch: ScheduledBatch, budget: int, failed: list[Request]) -> None:
        head_blocked = False
        busy = self._busy_adapters()  # kept up to date as requests join below
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                break
            if req.lora is not None and (head_blocked or not self.lora.can_admit(req.lora, busy)):
                head_blocked = True
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            if not self._grow(req, n):
                break  # out of pages: wait for running requests to finish
            if req.lora is not None:
                try:
                    req.slot = self.lora.admit(req.lora, busy)
                except ValueError as e:  # the adapter's files changed since it was validated
                    self.waiting.remove(req)
                    self.release(req)
                    req.error = str(e)
                    failed.append(req)
                    continue
                busy.add(req.lora.uid)
            self.waiting.remove(req)
            req.status = Status.RUNNING
            self.running.append(req)
            batch.add(req, n)
            budget -= n

    def remove(self, req: Request) -> None:
        """Drop a finished or aborted request from the queues and free its pages."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.release(req)

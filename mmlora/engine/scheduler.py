"""Continuous batching with chunked prefill, preemption by recompute, and LoRA-aware admission.

Each step takes, under a token budget: first every running request's next tokens (one decode token,
or the next prefill chunk), preempting the newest running requests when KV pages run out; then
waiting requests in arrival order. A waiting request with an adapter is admitted only if its adapter
holds, or can take, a device slot without evicting an adapter of the running batch. When the head of
the queue waits for a slot, only base-only requests may pass it, so slots drain and the head gets one:
adapters are served in arrival order. On CUDA, slot loads run on a stream of their own beside the
forwards: a request whose adapter is still loading waits (others pass it; its slot is held), and the
adapters of the first waiting requests start loading before their turn (``PREFETCH_WINDOW``).

Which waiting request goes first is the policy's choice (``schedule_policy``): ``fcfs`` takes them in
arrival order; ``vtc`` takes the head of the least-served backlogged client first (see fairness.py), and a
client at its running cap is skipped without losing its place. Besides the one waiting queue, each client
has its own (same order), so finding the next client costs O(backlogged clients), not O(waiting requests).

Prefix cache (mmlora.kvcache.prefix_cache): an admitted request first takes the cached pages of its
prefix and starts prefill at its first uncached token. A request whose next page a running request is
about to compute (a sibling of ``n > 1``, or a turn on the same system prompt) waits a step for it
instead of computing it again. Preemption and finishing release references; pages stay cached.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from mmlora.config import SchedulerConfig
from mmlora.engine.fairness import BASE_CLIENT, VirtualTokenCounter, load_client_limits
from mmlora.engine.prompt_logprobs import cacheable_prefix
from mmlora.engine.request import Request, Status
from mmlora.kvcache.allocator import BlockAllocator
from mmlora.kvcache.prefix_cache import PrefixCache
from mmlora.lora.manager import LoRAManager

logger = logging.getLogger(__name__)

#: Waiting requests, from the head, whose adapters are loaded into slots ahead of their admission each
#: step when slot loads run beside the forwards (a few: each load costs ~2 ms of host time on an H200).
PREFETCH_WINDOW = 4


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
    def __init__(
        self,
        config: SchedulerConfig,
        allocator: BlockAllocator,
        lora: LoRAManager,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.config = config
        self.allocator = allocator
        self.lora = lora
        self.prefix_cache = prefix_cache or PrefixCache(allocator, enabled=False)
        self.waiting: collections.deque[Request] = collections.deque()
        # Per client, its waiting requests in the order of ``waiting``; a key only while non-empty.
        self._client_queues: dict[str, collections.deque[Request]] = {}
        self._seq = itertools.count(1)  # queue_seq of requests joining at the tail (and, negated, the head)
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_prefill_tokens = 0  # tokens scheduled that were not a decode step (prompt, recompute)
        self.vtc = VirtualTokenCounter(config.vtc_prefill_weight, config.vtc_decode_weight)
        self.client_limits = load_client_limits(
            config.client_limits_file, config.max_running_per_client, config.max_queued_per_client
        )

    @staticmethod
    def client_of(req: Request) -> str:
        """Who a request is billed to: its client id, else its adapter, else the base model."""
        return req.client_id or req.lora_name or BASE_CLIENT

    def client_stats(self) -> dict[str, dict[str, float]]:
        """Per client: weighted service (the VTC counter), tokens served, waiting and running requests,
        and its caps (0: none). Kept under either policy, so fcfs servers show it too."""
        limits = self.client_limits
        return {
            client: {
                **dataclasses.asdict(stats),
                "max_running": limits.running_cap(client),
                "max_queued": limits.queued_cap(client),
            }
            for client, stats in self.vtc.clients.items()
        }

    def check_client_queue(self, client: str) -> None:
        """Raise OverflowError when ``client`` already has its cap of waiting requests."""
        cap = self.client_limits.queued_cap(client)
        if cap and self.vtc.clients[client].waiting >= cap:
            raise OverflowError(f"client {client!r} has {cap} waiting requests, its limit")

    def add(self, req: Request) -> None:
        self._enqueue(req, front=False)
        self.vtc.on_arrival(self.client_of(req))

    def _enqueue(self, req: Request, front: bool) -> None:
        queue = self._client_queues.setdefault(self.client_of(req), collections.deque())
        req.queue_seq = -next(self._seq) if front else next(self._seq)  # keeps ``waiting``'s order
        if front:
            self.waiting.appendleft(req)
            queue.appendleft(req)
        else:
            self.waiting.append(req)
            queue.append(req)

    def _dequeue(self, req: Request) -> None:
        """Take ``req`` out of the waiting queues (the caller settles its client's counters)."""
        self.waiting.remove(req)
        client = self.client_of(req)
        queue = self._client_queues[client]
        if queue[0] is req:  # the usual case: a client's head is admitted
            queue.popleft()
        else:
            queue.remove(req)
        if not queue:
            del self._client_queues[client]

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
        req.num_registered_blocks = 0
        req.slot = -1

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.release(req)
        req.num_computed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req, front=True)
        self.vtc.on_preempt(self.client_of(req))
        logger.info("preempted %s (KV cache full); it will be recomputed", req.rid)

    def schedule(self) -> tuple[ScheduledBatch, list[Request]]:
        """The next batch, and requests that failed to schedule (``req.error`` says why)."""
        batch = ScheduledBatch()
        failed: list[Request] = []
        budget = self.config.max_num_batched_tokens
        for req in list(self.running):
            if req.status is not Status.RUNNING or budget <= 0:
                continue
            if req.pending and req.num_generated >= req.sampling.max_new_tokens:
                continue  # its last token is being sampled (overlap): it finishes once that is read
            n = min(req.num_tokens - req.num_computed, budget)
            if self.allocator.blocks_needed(req.num_computed + n, 0) > self.allocator.num_blocks:
                req.error = (
                    f"request needs more KV cache than the engine has ({self.allocator.num_blocks} pages)"
                )
                self.running.remove(req)
                self.vtc.on_finish(self.client_of(req))
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
        for req, n in zip(batch.requests, batch.num_new):
            if req.num_computed + n == req.num_tokens:  # this forward samples a token for it
                self.vtc.on_decode(self.client_of(req))
        self.num_prefill_tokens += sum(
            n for r, n in zip(batch.requests, batch.num_new) if not (r.num_generated and n == 1)
        )
        return batch, failed

    def _admission_order(self):
        """Waiting requests in the order the policy admits them, decided lazily: under ``vtc`` the order
        after each admission depends on what was just charged. A request still waiting after it was
        offered was skipped, and its client is not offered again in this pass."""
        if self.config.schedule_policy == "fcfs":
            yield from list(self.waiting)
            return
        passed: set[str] = set()
        stats = self.vtc.clients
        while True:
            # The least-served client; ties go to the one whose head waited longest (its place in ``waiting``).
            client, counter, seq = None, 0.0, 0
            for name, queue in self._client_queues.items():
                c = stats[name].counter
                if (client is None or c < counter or (c == counter and queue[0].queue_seq < seq)) and (
                    name not in passed
                ):
                    client, counter, seq = name, c, queue[0].queue_seq
            if client is None:
                return
            cap = self.client_limits.running_cap(client)
            if cap and self.vtc.clients[client].running >= cap:
                passed.add(client)
                continue
            head = self._client_queues[client][0]
            yield head
            queue = self._client_queues.get(client)
            if queue and queue[0] is head:  # still waiting: skipped, so its client is not offered again
                passed.add(client)

    def after_forward(self, requests: Iterable[Request]) -> None:
        """Register the pages a forward filled (``num_computed`` already advanced) in the prefix cache.
        Only pages of tokens the host holds are keyed: a pending token's page waits for its id."""
        for req in requests:
            if req.status is not Status.FINISHED:
                self.prefix_cache.insert(req)

    def _pending_prefixes(self) -> set[bytes]:
        """Keys of the prompt pages running requests are still computing."""
        prefilling = (r for r in self.running if r.num_computed < len(r.prompt_ids))
        return {k for r in prefilling for k in self.prefix_cache.pending_keys(r)}

    def _take_cached_prefix(self, req: Request, pending: set[bytes]) -> bool:
        """Take the request's cached prefix; False (nothing taken) if a running request is computing the
        page after it: then the request waits a step and finds that page cached."""
        pages, next_key = self.prefix_cache.lookup(req)
        limit = cacheable_prefix(req)  # prompt logprobs need their positions run
        if limit is not None and len(pages) >= limit // self.prefix_cache.block_size:
            pages, next_key = pages[: limit // self.prefix_cache.block_size], None
        if next_key is not None and next_key in pending:
            return False
        self.prefix_cache.take(req, pages)
        return True

    def _admit(self, batch: ScheduledBatch, budget: int, failed: list[Request]) -> None:
        head_blocked = False
        busy = self._busy_adapters()  # kept up to date as requests join below
        pending = self._pending_prefixes()  # kept up to date as requests join below
        for req in self._admission_order():
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                break
            if req.lora is not None and (head_blocked or not self.lora.can_admit(req.lora, busy)):
                head_blocked = True
                continue
            slot = -1
            if req.lora is not None:
                try:
                    slot = self.lora.admit(req.lora, busy)
                except ValueError as e:  # the adapter's files changed since it was validated
                    self._dequeue(req)
                    self.vtc.on_leave_queue(self.client_of(req))
                    req.error = str(e)
                    failed.append(req)
                    continue
                if slot is None:  # its slot is loading beside this step: admitted once the copy is done
                    # Its adapter is claimed: the requests after it must not take that slot back once the
                    # copy is done (each would start a load evicting the one before: a cascade of loads).
                    busy.add(req.lora.uid)
                    continue
            if not self._take_cached_prefix(req, pending):
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            if not self._grow(req, n):
                self.release(req)
                req.num_computed = 0
                break  # out of pages: wait for running requests to finish
            self._count_prefix_hit(req)
            pending.update(self.prefix_cache.pending_keys(req))
            if req.lora is not None:
                req.slot = slot
                busy.add(req.lora.uid)
            self._dequeue(req)
            self.vtc.on_admit(self.client_of(req), len(req.prompt_ids), charge=req.num_preemptions == 0)
            req.status = Status.RUNNING
            self.running.append(req)
            batch.add(req, n)
            budget -= n

        if self.lora.loads_async:
            self._prefetch(busy)

    def _prefetch(self, busy: set[int]) -> None:
        """Start loading the adapters of the first waiting requests into slots now, beside this step, so
        that their admission does not wait for the copies; adapters in use and those of the window
        itself are kept."""
        ahead = list(itertools.islice((r for r in self.waiting if r.lora is not None), PREFETCH_WINDOW))
        keep = busy | {r.lora.uid for r in ahead}
        for req in ahead:
            self.lora.prefetch(req.lora, keep)

    def _count_prefix_hit(self, req: Request) -> None:
        self.prefix_cache.record(req.num_tokens, req.num_computed)
        if req.num_preemptions == 0:
            req.cached_tokens = req.num_computed

    def remove(self, req: Request) -> None:
        """Drop a finished or aborted request from the queues and free its pages."""
        if req in self.running:
            self.running.remove(req)
            self.vtc.on_finish(self.client_of(req))
        elif req in self._client_queues.get(self.client_of(req), ()):
            self._dequeue(req)
            self.vtc.on_leave_queue(self.client_of(req))
        self.release(req)

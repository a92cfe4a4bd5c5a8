"""Per-client waiting queues in the scheduler: the same admissions, step for step, as the scan of the whole
waiting queue they replaced, on random workloads (arrivals, aborts, preemption, slot limits, client caps)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from mmlora.config import SchedulerConfig
from mmlora.engine.request import Request, Status
from mmlora.engine.sampling_params import SamplingParams
from mmlora.engine.scheduler import Scheduler
from mmlora.kvcache.allocator import BlockAllocator


class ScanScheduler(Scheduler):
    def _admission_order(self):
        """The implementation before per-client queues, verbatim: heads found by scanning ``waiting``."""
        if self.config.schedule_policy == "fcfs":
            yield from list(self.waiting)
            return
        passed: set[str] = set()
        while True:
            heads: dict[str, Request] = {}
            for req in self.waiting:
                client = self.client_of(req)
                if client not in passed and client not in heads:
                    heads[client] = req
            if not heads:
                return
            client = self.vtc.order(heads)[0]
            cap = self.client_limits.running_cap(client)
            if cap and self.vtc.clients[client].running >= cap:
                passed.add(client)
                continue
            yield heads[client]
            if heads[client] in self.waiting:
                passed.add(client)


class LRUSlots:
    """The calls the scheduler makes of the LoRA manager, over ``n`` LRU slots (loaded at once)."""

    loads_async = False

    def __init__(self, n: int) -> None:
        self.n = n
        self.resident: list[int] = []  # least recently used first

    def _victim(self, busy: set[int]) -> int | None:
        return next((uid for uid in self.resident if uid not in busy), None)

    def can_admit(self, entry, busy: set[int]) -> bool:
        return entry.uid in self.resident or len(self.resident) < self.n or self._victim(busy) is not None

    def admit(self, entry, busy: set[int]) -> int:
        if entry.uid in self.resident:
            self.resident.remove(entry.uid)
        elif len(self.resident) >= self.n:
            self.resident.remove(self._victim(busy))
        self.resident.append(entry.uid)
        return 0


def _trace(cls: type[Scheduler], seed: int, policy: str, cap: int) -> tuple[list, int]:
    """Every step's batch (request, tokens) and failures on one random workload; and the preemptions."""
    rng = random.Random(seed)
    config = SchedulerConfig(
        schedule_policy=policy, max_running_requests=6, max_num_batched_tokens=40, max_running_per_client=cap
    )
    sched = cls(config, BlockAllocator(num_blocks=14, block_size=4), LRUSlots(3))
    adapters = [SimpleNamespace(uid=i, name=f"a{i}") for i in range(5)] + [None]
    steps, n = [], 0
    for _ in range(300):
        for _ in range(rng.choice([0, 0, 0, 1, 1, 2, 4])):  # bursts, so queues form
            lora = rng.choices(adapters, weights=[8, 1, 1, 1, 1, 2])[0]  # one heavy client
            req = Request(
                f"r{n}",
                [rng.randrange(1000) for _ in range(rng.randint(1, 14))],
                SamplingParams(max_new_tokens=rng.randint(1, 8), ignore_eos=True),
                lora,
                client_id=rng.choice([None, None, None, "u1", "u2"]),
            )
            sched.add(req)
            n += 1
        if sched.waiting and rng.random() < 0.05:  # an abort while waiting
            sched.remove(sched.waiting[rng.randrange(len(sched.waiting))])
        batch, failed = sched.schedule()
        steps.append([(r.rid, k) for r, k in zip(batch.requests, batch.num_new)] + [r.rid for r in failed])
        _check_client_queues(sched)
        for req, k in zip(batch.requests, batch.num_new):
            req.num_computed += k
            if req.num_computed == req.num_tokens:
                req.output_ids.append(7)
                if len(req.output_ids) >= req.sampling.max_new_tokens:
                    sched.remove(req)
                    req.status = Status.FINISHED
        sched.after_forward(batch.requests)
    return steps, sched.num_preemptions


def _check_client_queues(sched: Scheduler) -> None:
    """Each client's queue is ``waiting`` filtered to that client, and only backlogged clients have one."""
    queues = getattr(sched, "_client_queues", None)
    if queues is None or isinstance(sched, ScanScheduler):
        return
    clients = {sched.client_of(r) for r in sched.waiting}
    assert set(queues) == clients
    for client, queue in queues.items():
        assert list(queue) == [r for r in sched.waiting if sched.client_of(r) == client]


@pytest.mark.parametrize("policy", ["vtc", "fcfs"])
@pytest.mark.parametrize("cap", [0, 2])
@pytest.mark.parametrize("seed", range(4))
def test_admission_order_matches_the_full_scan(policy: str, cap: int, seed: int) -> None:
    new, preempted = _trace(Scheduler, seed, policy, cap)
    old, _ = _trace(ScanScheduler, seed, policy, cap)
    assert new == old
    assert preempted > 0  # the workload reached preemption, where requests re-enter at the head
    assert sum(len(s) for s in new) > 300  # and it kept the engine busy

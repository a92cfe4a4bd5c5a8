"""Overlap scheduling: the host schedules and launches step N+1 while the device still runs step N.

Without it a step is serial: schedule, build the inputs, launch the forward, wait for the sampled
tokens, append them, detokenize; the device idles during all the host work (4.5 ms of a 13.3 ms decode
step at B=128 on an H200, issue 13). With it (mini-sglang's and SGLang's overlap scheduler), each
``Engine.step`` schedules and launches step N+1 first, then reads back step N's tokens, which the device
finished meanwhile or finishes while N+1 is queued behind it, so the device always has work queued.

Step N+1 is built before the host knows step N's tokens. A request whose token is still on the device
carries a *placeholder* for it (``Request.pending``: ``-1 - k`` for row ``k`` of step N's sampled
tokens); the model runner resolves placeholders on the device from step N's token tensor
(:func:`resolve_placeholders`), in stream order after step N's sampling. The host learns the token when
it reads step N back, one step later. A request that step N finished (a stop token, its last token) was
already launched in step N+1: that row's result is dropped (one wasted row, as in SGLang; a request
whose token count will reach ``max_new_tokens`` is not scheduled again). Pages it held are freed while
step N+1 may still write them; any later use of those pages is a later launch on the same stream.

What steps synchronously (the engine finishes step N, then runs the batch as before): batches with a
request whose sampling needs the host's copy of its output (repetition / frequency / presence penalties,
a grammar), and any batch whose launch raised, so the step guard can isolate the faulty request.
``overlap_schedule="auto"`` turns it on for CUDA with ``tp_size`` 1; on a CPU nothing runs beside
the host, so it would only cost the dropped rows.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mmlora.config import EngineConfig
from mmlora.distributed.state import WorkerFailure
from mmlora.engine.request import Request
from mmlora.engine.sampler import sample_on_device
from mmlora.engine.scheduler import ScheduledBatch

if TYPE_CHECKING:
    from mmlora.engine.fault_isolation import StepGuard

logger = logging.getLogger(__name__)


def overlap_enabled(config: EngineConfig, device: torch.device) -> bool:
    """Whether the engine overlaps its steps (``SchedulerConfig.overlap_schedule``)."""
    mode = config.scheduler.overlap_schedule
    if mode == "off" or config.parallel.tp_size > 1:
        return False
    return mode == "on" or device.type == "cuda"


def overlap_eligible(requests: Sequence[Request]) -> bool:
    """False when a request's sampling reads its output ids on the host (penalties, a grammar)."""
    return not any(r.grammar is not None or r.sampling.penalised for r in requests)


def placeholder(row: int) -> int:
    """The id that stands for row ``row`` of the last launched step's sampled tokens."""
    return -1 - row


def resolve_placeholders(ids: torch.Tensor, future: torch.Tensor) -> torch.Tensor:
    """``ids`` (int64 [T], on the device) with each placeholder ``-1 - k`` replaced by ``future[k]``
    (int64 [K], the last launched step's tokens). A token the sampler marked bad (< 0) reads as 0: its
    request fails when the step is read back, and whatever its row computes is dropped."""
    if future.numel() == 0:
        return ids
    index = (-1 - ids).clamp(min=0, max=future.numel() - 1)
    return torch.where(ids < 0, future[index].clamp(min=0), ids)


@dataclass
class InFlightStep:
    """A launched step whose sampled tokens the host has not read yet."""

    batch: ScheduledBatch
    requests: list[Request]  # the requests that sampled, in the order of ``tokens``
    prompt_only: list[Request]  # prompt-logprob requests (max_new_tokens=0): done once this step ran
    tokens: torch.Tensor  # int64 [len(requests)] on the device (sampler codes < 0 for bad rows)
    host_tokens: torch.Tensor  # the same, copied to the host (page-locked on CUDA) once ``done`` fires
    done: torch.cuda.Event | None  # None on a CPU, where the copy finished when it returned
    logprobs: torch.Tensor  # [len(requests), V] on the device, or [len(requests), 0] when nobody asked

    def read(self) -> list[int]:
        """The sampled tokens (waits for the device to finish this step)."""
        if self.done is not None:
            self.done.synchronize()
        return self.host_tokens.tolist()


def launch_step(guard: StepGuard, batch: ScheduledBatch, future: torch.Tensor | None) -> InFlightStep | None:
    """Launch ``batch``'s forward and sampling without waiting for them; ``future`` is the previous
    launched step's token tensor, which the batch's placeholders refer to. Advances ``num_computed``
    and gives each sampling request a placeholder for its new token.

    Returns None, with nothing advanced, when the launch raised: the engine then runs the batch through
    the step guard, which finds the request at fault."""
    runner = guard.runner
    try:
        if guard.faults is not None:
            guard.faults.check_forward(batch.requests)
        runner.future = future
        try:
            logits, sampling = runner.forward(batch)
        finally:
            runner.future = None
        requests = [batch.requests[i] for i in sampling]
        keep = [k for k, req in enumerate(requests) if req.sampling.max_new_tokens > 0]
        prompt_only = [req for req in requests if req.sampling.max_new_tokens == 0]
        if len(keep) < len(requests):
            index = torch.tensor(keep, dtype=torch.long, device=logits.device)
            logits, requests = logits[index], [requests[k] for k in keep]
        if guard.faults is not None:
            guard.faults.check_sampling(requests)
        if requests:
            tokens, logprobs = sample_on_device(logits, requests, guard.generator, guard.eos_ids)
        else:
            tokens = torch.empty(0, dtype=torch.long, device=logits.device)
            logprobs = tokens.new_empty(0, 0, dtype=torch.float32)
    except WorkerFailure:
        raise
    except Exception as e:
        logger.info(
            "an overlapped launch of %d requests raised (%r); stepping it synchronously", len(batch), e
        )
        return None
    for req, n in zip(batch.requests, batch.num_new):
        req.num_computed += n
    for k, req in enumerate(requests):
        req.pending.append(placeholder(k))
    done = None
    if tokens.is_cuda:
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
    else:
        host = tokens
    return InFlightStep(batch, requests, prompt_only, tokens, host, done, logprobs)

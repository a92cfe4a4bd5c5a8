"""One bad request must never fail its neighbours: the engine step's forward and sampling, guarded.

``StepGuard.run`` runs a scheduled batch's forward and samples its next tokens. When something raises,
it finds the request to blame instead of failing the whole batch:

* sampling (with each constrained request's grammar mask applied to its row first): ``sample`` names the rows whose logits or probabilities are NaN/Inf (``BadSamplingRows``),
  and those rows fail alone; any other sampling error is retried row by row, so each request's own
  sampling setup (its grammar mask included) runs outside the batched call and only the one that raises
  fails;
* forward: a forward that raises is retried on each half of the batch, down to single requests (a
  bisection, the last resort: it costs about two forwards per request in the worst case). Rewriting a
  request's KV entries on retry is harmless: the same tokens write the same pages.

A failed request gets a message: a ``ValueError`` is the request's own fault (answered 400), anything
else starts with "internal error" (answered 500). ``FaultInjector`` is the test hook that makes one
request's sampling, or every forward holding one adapter, raise on purpose.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mmlora.distributed.state import WorkerFailure
from mmlora.engine.grammar import GrammarMasks, apply_grammar_masks
from mmlora.engine.request import Request
from mmlora.engine.sampler import BadSamplingRows, sample
from mmlora.engine.scheduler import ScheduledBatch

if TYPE_CHECKING:
    from mmlora.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)

Sampled = tuple[Request, int, torch.Tensor]  # (request, next token, its log-probability row)
Failed = tuple[Request, str]  # (request, why it failed)


class InjectedFault(RuntimeError):
    """Raised by ``FaultInjector``: a fault made on purpose by a test."""


@dataclass
class FaultInjector:
    """Test hook: fail the sampling of the named request ids, or every forward holding a named adapter."""

    sampling_rids: set[str] = field(default_factory=set)
    adapters: set[str] = field(default_factory=set)

    def check_forward(self, requests: list[Request]) -> None:
        for req in requests:
            if req.lora_name in self.adapters:
                raise InjectedFault(f"injected fault in the forward of adapter {req.lora_name!r}")

    def check_sampling(self, requests: list[Request]) -> None:
        for req in requests:
            if req.rid in self.sampling_rids:
                raise InjectedFault(f"injected fault in the sampling of {req.rid}")


def describe_fault(error: BaseException) -> str:
    """The message a request fails with: its own fault (ValueError) as is, else an internal error."""
    if isinstance(error, ValueError):
        return str(error)
    return f"internal error: {type(error).__name__}: {error}"


class StepGuard:
    """Forward and sample one scheduled batch; a request that raises fails alone."""

    def __init__(
        self, runner: ModelRunner, generator: torch.Generator, vocab_size: int, eos_ids: frozenset[int]
    ) -> None:
        self.runner = runner
        self.eos_ids = eos_ids
        self.generator = generator
        self.grammar_masks = GrammarMasks(vocab_size)
        self.faults: FaultInjector | None = None

    def run(self, batch: ScheduledBatch) -> tuple[list[Sampled], list[Request], list[Failed]]:
        """-> (the requests that sampled a token, the requests whose prompt ran and that sample nothing
        (``max_new_tokens=0``: prompt logprobs only), the requests that failed and why).

        Advances ``num_computed`` of every request whose forward succeeded.
        """
        failed: list[Failed] = []
        requests, logits = self._forward(batch, failed)
        keep = [k for k, req in enumerate(requests) if req.sampling.max_new_tokens > 0]
        prompt_only = [req for req in requests if req.sampling.max_new_tokens == 0]
        if len(keep) < len(requests):
            logits, requests = _rows(logits, keep), [requests[k] for k in keep]
        return self._sample(requests, logits, failed), prompt_only, failed

    def _forward(self, batch: ScheduledBatch, failed: list[Failed]) -> tuple[list[Request], torch.Tensor]:
        """(the requests that sample, their logits [len, V] row by row): the forward's own logits tensor,
        never copied row by row (a [B, V] copy each step: 7 ms of a 34 ms tiny-model CPU step at B=128)."""
        try:
            if self.faults is not None:
                self.faults.check_forward(batch.requests)
            logits, sampling = self.runner.forward(batch)
        except WorkerFailure:  # a lost tensor-parallel rank is no request's fault: the engine stops
            raise
        except Exception as e:
            if len(batch) == 1:
                logger.warning("request %s failed in the forward: %r", batch.requests[0].rid, e)
                failed.append((batch.requests[0], describe_fault(e)))
                return [], torch.empty(0, 0)
            logger.warning("a forward of %d requests failed (%r); retrying each half", len(batch), e)
            mid = len(batch) // 2
            halves = [self._forward(_part(batch, a, b), failed) for a, b in ((0, mid), (mid, len(batch)))]
            parts = [logits for reqs, logits in halves if reqs]
            return [r for reqs, _ in halves for r in reqs], torch.cat(parts) if parts else torch.empty(0, 0)
        for req, n in zip(batch.requests, batch.num_new):
            req.num_computed += n
        return [batch.requests[i] for i in sampling], logits

    def _sample(self, requests: list[Request], logits: torch.Tensor, failed: list[Failed]) -> list[Sampled]:
        """Sample a token for each of ``requests`` from its row of ``logits`` (grammar masks are applied
        in place)."""
        if not requests:
            return []
        try:
            if self.faults is not None:
                self.faults.check_sampling(requests)
            apply_grammar_masks(logits, requests, self.grammar_masks)
            tokens, logprobs = sample(logits, requests, self.generator, self.eos_ids)
        except BadSamplingRows as e:
            for i, why in e.rows.items():
                logger.warning("request %s failed in sampling: %s", requests[i].rid, why)
                failed.append(
                    (requests[i], why if "sampling parameters" in why else f"internal error: {why}")
                )
            keep = [i for i in range(len(requests)) if i not in e.rows]
            return self._sample([requests[i] for i in keep], _rows(logits, keep), failed)
        except Exception as e:
            if len(requests) == 1:
                logger.warning("request %s failed in sampling: %r", requests[0].rid, e)
                failed.append((requests[0], describe_fault(e)))
                return []
            logger.warning("sampling %d requests failed (%r); sampling each alone", len(requests), e)
            return [
                s for i, req in enumerate(requests) for s in self._sample([req], logits[i : i + 1], failed)
            ]
        return [(req, tok, logprobs[i]) for i, (req, tok) in enumerate(zip(requests, tokens))]


def _rows(logits: torch.Tensor, keep: list[int]) -> torch.Tensor:
    """The rows ``keep`` of ``logits`` (one indexed copy)."""
    return logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]


def _part(batch: ScheduledBatch, start: int, stop: int) -> ScheduledBatch:
    return ScheduledBatch(batch.requests[start:stop], batch.num_new[start:stop])

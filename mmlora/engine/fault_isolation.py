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

    def __init__(self, runner: ModelRunner, generator: torch.Generator, vocab_size: int) -> None:
        self.runner = runner
        self.generator = generator
        self.grammar_masks = GrammarMasks(vocab_size)
        self.faults: FaultInjector | None = None

    def run(self, batch: ScheduledBatch) -> tuple[list[Sampled], list[Request], list[Failed]]:
        """-> (the requests that sampled a token, the requests whose prompt ran and that sample nothing
        (``max_new_tokens=0``: prompt logprobs only), the requests that failed and why).

        Advances ``num_computed`` of every request whose forward succeeded.
        """
        failed: list[Failed] = []
        rows = self._forward(batch, failed)
        prompt_only = [req for req, _ in rows if req.sampling.max_new_tokens == 0]
        rows = [(req, row) for req, row in rows if req.sampling.max_new_tokens > 0]
        return self._sample(rows, failed), prompt_only, failed

    def _forward(self, batch: ScheduledBatch, failed: list[Failed]) -> list[tuple[Request, torch.Tensor]]:
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
                return []
            logger.warning("a forward of %d requests failed (%r); retrying each half", len(batch), e)
            mid = len(batch) // 2
            return self._forward(_part(batch, 0, mid), failed) + self._forward(
                _part(batch, mid, len(batch)), failed
            )
        for req, n in zip(batch.requests, batch.num_new):
            req.num_computed += n
        return [(batch.requests[i], logits[k]) for k, i in enumerate(sampling)]

    def _sample(self, rows: list[tuple[Request, torch.Tensor]], failed: list[Failed]) -> list[Sampled]:
        if not rows:
            return []
        requests = [req for req, _ in rows]
        try:
            if self.faults is not None:
                self.faults.check_sampling(requests)
            logits = torch.stack([row for _, row in rows])
            apply_grammar_masks(logits, requests, self.grammar_masks)
            tokens, logprobs = sample(logits, requests, self.generator)
        except BadSamplingRows as e:
            for i, why in e.rows.items():
                logger.warning("request %s failed in sampling: %s", requests[i].rid, why)
                failed.append(
                    (requests[i], why if "sampling parameters" in why else f"internal error: {why}")
                )
            return self._sample([r for i, r in enumerate(rows) if i not in e.rows], failed)
        except Exception as e:
            if len(rows) == 1:
                logger.warning("request %s failed in sampling: %r", requests[0].rid, e)
                failed.append((requests[0], describe_fault(e)))
                return []
            logger.warning("sampling %d requests failed (%r); sampling each alone", len(rows), e)
            return [s for row in rows for s in self._sample([row], failed)]
        return [(req, tok, logprobs[i]) for i, (req, tok) in enumerate(zip(requests, tokens))]


def _part(batch: ScheduledBatch, start: int, stop: int) -> ScheduledBatch:
    return ScheduledBatch(batch.requests[start:stop], batch.num_new[start:stop])

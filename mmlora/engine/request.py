"""Request: one sequence's state from arrival to finish."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from mmlora.engine.sampling_params import SamplingParams
from mmlora.lora.registry import AdapterEntry
from mmlora.multimodal.inputs import ImageInputs


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: queue searches compare requests, and a field-by-field compare costs
class Request:
    """Tokens ``all_ids[:num_computed]`` have their K/V in the request's pages; the rest run next.

    A request samples when a forward brings ``num_computed`` up to ``len(all_ids)``. Preemption frees
    its pages and sets ``num_computed`` to 0: the prompt and the output so far are recomputed.
    """

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    lora: AdapterEntry | None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    client_id: str | None = None  # who the request is billed to for fair scheduling (OpenAI's `user`)
    mm_inputs: ImageInputs | None = None  # its images (mmlora.multimodal), prepared at add_request
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # Prompt logprobs (mmlora.engine.prompt_logprobs): entries for prompt tokens from
    # ``input_logprob_start`` on (-1: none asked); token 0 has no logprob and gets None.
    input_logprob_start: int = -1
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    grammar: Any = None  # a mmlora.engine.grammar.GrammarState when the output is constrained
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    slot: int = -1
    status: Status = Status.WAITING
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    error: str | None = None
    text: str = ""
    prefix_offset: int = 0  # detokenizer window: output ids [prefix_offset, read_offset) are context
    read_offset: int = 0
    sent_text_len: int = 0
    sent_ids_len: int = 0
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    queue_seq: int = 0  # the scheduler's key for its place in the waiting queue (smaller: nearer the head)
    # Prefix cache (mmlora.kvcache.prefix_cache): keys of the full pages, how many leading pages are in
    # the cache, and the prompt tokens the first admission found cached.
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    cached_tokens: int = 0
    # Overlap scheduling (mmlora.engine.overlap): placeholders of the tokens sampled by launched steps
    # whose results the host has not read yet, oldest first; each stands right after ``output_ids``.
    pending: list[int] = field(default_factory=list)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_at(self, p: int) -> int:
        """``all_ids[p]`` without building the joined list (a decode step asks this of every row); past
        the known tokens, a pending token's placeholder."""
        n = len(self.prompt_ids)
        if p < n:
            return self.prompt_ids[p]
        k = p - n
        out = self.output_ids
        return out[k] if k < len(out) else self.pending[k - len(out)]

    def token_slice(self, start: int, stop: int) -> list[int]:
        """``all_ids[start:stop]`` without building the joined list (every eager step asks this of every
        row: a decode row's one new token, a prefill chunk's tokens); past the known tokens, the pending
        tokens' placeholders."""
        n = len(self.prompt_ids)
        known = n + len(self.output_ids)
        if stop > known and self.pending:
            return self.token_slice(start, known) + self.pending[max(start - known, 0) : stop - known]
        if start >= n:
            return self.output_ids[start - n : stop - n]
        if stop <= n:
            return self.prompt_ids[start:stop]
        return self.prompt_ids[start:] + self.output_ids[: stop - n]

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence, pending ones included (what the next forward extends)."""
        return len(self.prompt_ids) + len(self.output_ids) + len(self.pending)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host holds: the prompt and the output read back so far."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_generated(self) -> int:
        """Tokens sampled so far, pending ones included."""
        return len(self.output_ids) + len(self.pending)

    @property
    def adapter_uid(self) -> int:
        """The adapter's registry uid (never reused, unlike its name); 0 for base-only requests."""
        return self.lora.uid if self.lora is not None else 0

    @property
    def lora_name(self) -> str | None:
        return self.lora.name if self.lora is not None else None

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

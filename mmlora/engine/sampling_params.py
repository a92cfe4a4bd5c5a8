"""SamplingParams with SGLang's field names, validated on construction."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are treated as 0 (greedy), as SGLang and vLLM do: dividing logits by a tinier
temperature overflows to Inf/NaN probabilities."""
MAX_REPETITION_PENALTY = 10.0
INT64_LIMIT = 2**63


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. Field names follow SGLang's ``sampling_params``."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    n: int = 1
    min_new_tokens: int = 0
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False  # keep the matched stop string (or stop_regex match) in the text
    stop_regex: tuple[str, ...] = ()
    # Structured output (mmlora.engine.grammar): at most one of these; json_schema is a JSON string
    # (a dict is serialised), regex and ebnf are grammars in xgrammar's syntax.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        regexes = self.stop_regex
        object.__setattr__(
            self, "stop_regex", (regexes,) if isinstance(regexes, str) else tuple(regexes or ())
        )
        if isinstance(self.json_schema, dict):
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
        self._check_constraints()
        _require(_int(self.max_new_tokens, 0), "max_new_tokens", f"must be an integer in [0, {INT64_LIMIT})")
        _require(
            _num(self.temperature) and self.temperature >= 0, "temperature", "must be a finite number >= 0"
        )
        _require(_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _require(
            _int(self.top_k, -1) and (self.top_k == -1 or self.top_k >= 1),
            "top_k",
            "must be -1 (off) or an integer >= 1",
        )
        _require(_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        _require(
            _num(self.repetition_penalty) and 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
            "repetition_penalty",
            f"must be in (0, {MAX_REPETITION_PENALTY:g}]",
        )
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _require(_num(value) and -2 <= value <= 2, name, "must be in [-2, 2]")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _require(
            all(_int(t, 0) for t in self.stop_token_ids),
            "stop_token_ids",
            "must be token ids (integers >= 0)",
        )
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            _require(isinstance(getattr(self, name), bool), name, "must be true or false")
        _require(
            self.seed is None or _int(self.seed, 0),
            "seed",
            f"must be an integer in [0, {INT64_LIMIT}) or null",
        )
        _require(_int(self.n, 1) and self.n <= 128, "n", "must be an integer in [1, 128]")
        _require(_int(self.min_new_tokens, 0), "min_new_tokens", f"must be an integer in [0, {INT64_LIMIT})")
        _require(
            self.min_new_tokens <= self.max_new_tokens,
            "min_new_tokens",
            f"must be <= max_new_tokens ({self.max_new_tokens})",
        )

    def _check_constraints(self) -> None:
        for name in ("json_schema", "regex", "ebnf"):
            value = getattr(self, name)
            _require(value is None or (isinstance(value, str) and value), name, "must be a non-empty string")
        given = [n for n in ("json_schema", "regex", "ebnf") if getattr(self, n) is not None]
        _require(len(given) <= 1, given[-1] if given else "regex", f"give at most one of {', '.join(given)}")
        for pattern in self.stop_regex:
            _require(isinstance(pattern, str) and pattern, "stop_regex", "must be non-empty strings")
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"sampling_params.stop_regex: invalid regex {pattern!r}: {e}") from None

    @property
    def constraint(self) -> tuple[str, str] | None:
        """``(kind, spec)`` of the structured-output constraint, or None for free generation."""
        for kind in ("json_schema", "regex", "ebnf"):
            if getattr(self, kind) is not None:
                return kind, getattr(self, kind)
        return None

    @property
    def greedy(self) -> bool:
        """Temperature below ``GREEDY_TEMPERATURE`` (1e-5) or top_k 1: the most likely token, no sampling."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def penalised(self) -> bool:
        """A repetition, frequency or presence penalty: sampling reads the request's token ids."""
        return self.repetition_penalty != 1.0 or bool(self.frequency_penalty) or bool(self.presence_penalty)

    def samples(self) -> list[SamplingParams]:
        """``n`` samples as ``n`` requests of n=1 (the engine takes n == 1); with a seed, sample i uses
        ``seed + i`` so that the samples differ yet the whole answer is reproducible."""
        if self.n == 1:
            return [self]
        seeds = [None if self.seed is None else self.seed + i for i in range(self.n)]
        return [dataclasses.replace(self, n=1, seed=seed) for seed in seeds]

    @classmethod
    def from_any(cls, value: SamplingParams | dict[str, Any] | None) -> SamplingParams:
        """Accept a SamplingParams, a dict with SGLang's field names, or None (defaults)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                f"sampling_params: expected a dict or SamplingParams, got {type(value).__name__}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"sampling_params: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        kwargs = {k: v for k, v in value.items() if v is not None or k == "seed"}
        try:
            return cls(**kwargs)
        except TypeError as e:  # wrong type for a comparison inside validation
            raise ValueError(f"sampling_params: {e}") from None


def _num(x: Any) -> bool:
    """A finite int or float (bool, NaN and +-Inf are not numbers here)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _int(x: Any, low: int) -> bool:
    """An int (not a bool) in [low, 2**63): what fits the engine's int64 tensors."""
    return isinstance(x, int) and not isinstance(x, bool) and low <= x < INT64_LIMIT


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"sampling_params.{name}: {message}")


@dataclass
class RequestOutput:
    """The state of one request (cumulative), or an increment when streaming.

    ``text``/``output_ids``/``logprobs`` hold everything generated so far; when streaming, ``delta_text``
    and ``delta_ids`` hold what this step added. ``finish_reason`` is None while running, else
    ``"stop"`` (EOS, a stop string or stop token), ``"length"`` or ``"abort"``; ``matched_stop`` names
    the stop string or token id that ended it; ``error`` explains an abort caused by bad input.
    """

    request_id: str
    prompt_tokens: int
    lora_name: str | None
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # With prompt logprobs: the prompt's ids, and entries for its tokens from the start asked for.
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[int, float]]] | None = None
    input_ids: list[int] | None = None
    delta_text: str = ""
    delta_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    error: str | None = None
    first_token_time: float | None = None
    arrival_time: float = 0.0
    finish_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

"""Structured output with xgrammar: a JSON schema, a regex or an EBNF grammar per request.

Each constrained request owns a :class:`GrammarState` (an xgrammar matcher). Every step, before sampling,
:func:`apply_grammar_masks` fills one bitmask row per constrained request and applies the rows to their
logits only, so constrained and free requests (on any adapters) share the step. Compiling is the
expensive part: :class:`GrammarCompiler` caches compiled grammars, and the server compiles on a worker
thread before submitting (``mmlora.server.structured``), so the engine thread only finds them cached.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from mmlora.engine.request import Request

# JSON whitespace is free, as SGLang's and vLLM's defaults allow, but runs are bounded so that a weak
# model cannot spend its whole budget on blanks between tokens.
MAX_JSON_WHITESPACE = 16


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise ValueError(
            "structured output (json_schema, regex, ebnf) needs xgrammar: pip install 'mmlora[structured]'"
        ) from None
    return xgrammar


class GrammarCompiler:
    """Compiles (kind, spec) to an xgrammar CompiledGrammar, with an LRU cache; thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], cache_size: int = 256):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.cache_size = cache_size
        self._compiler: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_tokenizer_info(cls, info: Any, vocab_size: int) -> GrammarCompiler:
        """A compiler over an xgrammar TokenizerInfo built by the caller (benchmarks without a tokenizer)."""
        compiler = cls(None, vocab_size, [])
        compiler._compiler = _xgrammar().GrammarCompiler(info, max_threads=2)
        return compiler

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            if self.tokenizer is None:
                raise ValueError("structured output needs a tokenizer; this model has none")
            xgr = _xgrammar()
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        return self._compiler

    def compile(self, kind: str, spec: str) -> Any:
        """The compiled grammar of ``kind`` (json_schema, regex, ebnf); ValueError naming the problem."""
        key = (kind, spec)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            compiler = self._get_compiler()
        compiled = _compile(compiler, kind, spec)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def state_for(self, constraint: tuple[str, str] | None) -> GrammarState | None:
        """A fresh matcher for a request's constraint (None when it has none)."""
        if constraint is None:
            return None
        return GrammarState(_xgrammar().GrammarMatcher(self.compile(*constraint)))


def _compile(compiler: Any, kind: str, spec: str) -> Any:
    where = f"sampling_params.{kind}"
    try:
        if kind == "json_schema":
            try:
                json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON: {e}") from None
            return compiler.compile_json_schema(
                spec, any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE
            )
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "ebnf":
            return compiler.compile_grammar(spec)
    except ValueError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError (and its own types) for bad specs
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{where}: cannot be compiled: {message}") from None
    raise ValueError(f"structured output: unknown kind {kind!r}")


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        """Advance by the sampled token; True once the grammar is complete (nothing more may follow)."""
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"grammar rejected token {token} that its own mask allowed")
        return self.matcher.is_terminated()


class GrammarMasks:
    """The bitmask buffer (host, int32 [rows, ceil(V / 32)]), grown on demand and reused every step."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.buffer: torch.Tensor | None = None

    def rows(self, n: int) -> torch.Tensor:
        if self.buffer is None or self.buffer.shape[0] < n:
            size = max(n, 2 * self.buffer.shape[0] if self.buffer is not None else 8)
            self.buffer = _xgrammar().allocate_token_bitmask(size, self.vocab_size)
        return self.buffer[:n]


def apply_grammar_masks(logits: torch.Tensor, requests: Sequence[Request], masks: GrammarMasks) -> None:
    """Forbid, in place, the tokens each constrained request's grammar disallows next.

    ``logits`` [B, V] fp32, one row per request; rows of unconstrained requests are untouched.
    """
    constrained = [i for i, req in enumerate(requests) if req.grammar is not None]
    if not constrained:
        return
    bitmask = masks.rows(len(requests))
    for i in constrained:
        requests[i].grammar.matcher.fill_next_token_bitmask(bitmask, i)
    _xgrammar().apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device, non_blocking=True), vocab_size=masks.vocab_size, indices=constrained
    )

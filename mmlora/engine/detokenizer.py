"""Incremental detokenization with stop strings: what a request has said so far, and what is new."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from mmlora.engine.request import Request

#: ``decode(ids, skip_special_tokens, spaces_between_special_tokens) -> text``
Decode = Callable[[list[int], bool, bool], str]


def ids_decoder(tokenizer: Any) -> Decode | None:
    """The tokenizer's ``decode`` of a list of ids (None without a tokenizer). For a fast tokenizer that
    cleans up no spaces, that decode is its Rust backend's (``_decode`` calls nothing else; fast tokenizers
    ignore ``spaces_between_special_tokens``), so it is called directly: ``decode`` first converts its
    input id by id, which at 128 decoding requests (two decodes each per step) is a large share of the
    step's host time. Any other tokenizer keeps its own ``decode``."""
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    fast = getattr(tokenizer, "is_fast", False) and callable(getattr(backend, "decode", None))
    if fast and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return lambda ids, skip, _spaces: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip, spaces: tokenizer.decode(
        ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces
    )


def update_text(req: Request, decode: Decode | None) -> None:
    """Extend ``req.text`` with the newly decodable output (``decode``: :func:`ids_decoder`'s); finish the
    request at the first stop string.

    Only a short window is decoded each step (the tokens since the last emitted ones, plus the tokens
    just before them as context, so that merges and leading spaces come out as a full decode would):
    the cost per step does not grow with the output. Text ending in an incomplete character waits for
    the next token, unless the request is finishing.
    """
    if decode is None:
        return
    ids, sp = req.output_ids, req.sampling
    opts = (sp.skip_special_tokens, sp.spaces_between_special_tokens)
    prefix = decode(ids[req.prefix_offset : req.read_offset], *opts)
    window = decode(ids[req.prefix_offset :], *opts)
    ready = len(window) > len(prefix) and not window.endswith("\ufffd")
    if not (ready or req.finish_reason is not None):
        return
    old_len = len(req.text)
    text = req.text + window[len(prefix) :]
    req.prefix_offset, req.read_offset = req.read_offset, len(ids)
    # Stop strings count from min_new_tokens on, as vLLM's min_tokens and SGLang's min_new_tokens do.
    if (sp.stop or sp.stop_regex) and req.finish_reason in (None, "length") and len(ids) >= sp.min_new_tokens:
        hit = _first_stop(text, old_len, sp.stop, sp.stop_regex)
        if hit is not None:
            start, end, matched = hit
            text = text[:end] if sp.no_stop_trim else text[:start]
            req.finish_reason, req.matched_stop = "stop", matched
    req.text = text


def _first_stop(
    text: str, old_len: int, stops: tuple[str, ...], regexes: tuple[str, ...]
) -> tuple[int, int, str] | None:
    """The earliest stop in ``text`` that involves new text: ``(start, end, what matched)``.

    A stop string can only newly appear within its length of the old end; a regex match may start
    anywhere, so it counts when it ends in the new text.
    """
    hits: list[tuple[int, int, str]] = []
    if stops:
        window_start = max(0, old_len - max(len(s) for s in stops))
        for s in stops:
            i = text.find(s, window_start)
            if i >= 0:
                hits.append((i, i + len(s), s))
    for pattern in regexes:
        for m in re.finditer(pattern, text):
            if m.end() > old_len and m.end() > m.start():
                hits.append((m.start(), m.end(), pattern))
                break
    return min(hits) if hits else None


def take_delta(req: Request) -> str:
    """The text not yet sent; holds back a trailing partial character or a possible stop-string prefix."""
    end = len(req.text)
    if not req.finished:
        if req.text.endswith("\ufffd"):
            end = len(req.text.rstrip("\ufffd"))
        for s in req.sampling.stop:
            for k in range(min(len(s) - 1, end), 0, -1):
                if req.text[:end].endswith(s[:k]):
                    end -= k
                    break
    end = max(end, req.sent_text_len)
    delta = req.text[req.sent_text_len : end]
    req.sent_text_len = end
    return delta

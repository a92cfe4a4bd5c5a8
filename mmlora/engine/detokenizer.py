"""Incremental detokenization with stop strings: what a request has said so far, and what is new."""

from __future__ import annotations

import re
from typing import Any

from mmlora.engine.request import Request


def update_text(req: Request, tokenizer: Any) -> None:
    """Extend ``req.text`` with the newly decodable output; finish the request at the first stop string.

    Only a short window is decoded each step (the tokens since the last emitted ones, plus the tokens
    just before them as context, so that merges and leading spaces come out as a full decode would):
    the cost per step does not grow with the output. Text ending in an incomplete character waits for
    the next token, unless the request is finishing.
    """
    if tokenizer is None:
        return
    ids, sp = req.output_ids, req.sampling
    opts = {
        "skip_special_tokens": sp.skip_special_tokens,
        "spaces_between_special_tokens": sp.spaces_between_special_tokens,
    }
    prefix = tokenizer.decode(ids[req.prefix_offset : req.read_offset], **opts)
    window = tokenizer.decode(ids[req.prefix_offset :], **opts)
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

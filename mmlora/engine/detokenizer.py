"""Incremental detokenization with stop strings: what a request has said so far, and what is new."""

from __future__ import annotations

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
    ids, skip = req.output_ids, req.sampling.skip_special_tokens
    prefix = tokenizer.decode(ids[req.prefix_offset : req.read_offset], skip_special_tokens=skip)
    window = tokenizer.decode(ids[req.prefix_offset :], skip_special_tokens=skip)
    ready = len(window) > len(prefix) and not window.endswith("\ufffd")
    if not (ready or req.finish_reason is not None):
        return
    old_len = len(req.text)
    text = req.text + window[len(prefix) :]
    req.prefix_offset, req.read_offset = req.read_offset, len(ids)
    stops = req.sampling.stop
    if stops and req.finish_reason in (None, "length"):
        window_start = max(0, old_len - max(len(s) for s in stops))
        hits = [(text.find(s, window_start), s) for s in stops]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            i, s = min(hits)
            text = text[:i]
            req.finish_reason, req.matched_stop = "stop", s
    req.text = text


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

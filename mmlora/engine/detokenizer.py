"""Incremental detokenization with stop strings: what a request has said so far, and what is new."""

from __future__ import annotations

from typing import Any

from mmlora.engine.request import Request


def update_text(req: Request, tokenizer: Any) -> None:
    """Recompute ``req.text`` from its output ids; finish it at the first stop string."""
    if tokenizer is None:
        return
    text = tokenizer.decode(req.output_ids, skip_special_tokens=req.sampling.skip_special_tokens)
    stops = req.sampling.stop
    if stops and req.finish_reason in (None, "length"):
        window_start = max(0, len(req.text) - max(len(s) for s in stops))
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

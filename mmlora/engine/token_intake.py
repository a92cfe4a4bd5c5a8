"""A sampled token's effect on its request, and what a request reports.

:func:`append_token` takes one token in: its logprobs, the stop conditions it meets (EOS, stop tokens, a
grammar's end, ``max_new_tokens``, the model's context) and the new text. :func:`request_output` is the
:class:`RequestOutput` a request reports after a step: everything so far, plus what this step added.
The engine keeps the counters and ends finished requests; these functions only read and write the
request.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from mmlora.engine.detokenizer import Decode, take_delta, update_text
from mmlora.engine.request import Request
from mmlora.engine.sampling_params import RequestOutput


def append_token(
    req: Request,
    token: int,
    logprobs: torch.Tensor,
    now: float,
    eos_ids: Collection[int],
    max_model_len: int,
    decode_ids: Decode | None,
) -> None:
    """Append ``token`` (with its logprob and top logprobs where asked) and its text (``decode_ids``: the
    engine's :func:`~mmlora.engine.detokenizer.ids_decoder`, None without a tokenizer) to ``req``, and set
    ``req.finish_reason`` when the token ends the request ("stop" or "length"; the caller finishes it).
    A stop token before ``min_new_tokens`` does not stop it."""
    if req.first_token_time is None:
        req.first_token_time = now
    req.output_ids.append(token)
    if req.return_logprob:
        req.logprobs.append(float(logprobs[token]))
        if req.top_logprobs_num:
            vals, idx = logprobs.topk(req.top_logprobs_num)
            req.top_logprobs.append(list(zip(idx.tolist(), vals.tolist())))
    sp = req.sampling
    n_out = len(req.output_ids)
    grammar_done = req.grammar is not None and req.grammar.accept(token)
    is_stop = (not sp.ignore_eos and token in eos_ids) or token in sp.stop_token_ids or grammar_done
    if is_stop and n_out >= sp.min_new_tokens:
        req.finish_reason, req.matched_stop = "stop", token
    if req.finish_reason is None and (n_out >= sp.max_new_tokens or req.num_known_tokens >= max_model_len):
        req.finish_reason = "length"
    update_text(req, decode_ids)


def request_output(req: Request) -> RequestOutput:
    """``req``'s state as a RequestOutput: cumulative fields, and the ids and text added since the last
    one (which this marks as sent)."""
    delta_ids = req.output_ids[req.sent_ids_len :]
    req.sent_ids_len = len(req.output_ids)
    return RequestOutput(
        request_id=req.rid,
        prompt_tokens=len(req.prompt_ids),
        cached_tokens=req.cached_tokens,
        lora_name=req.lora_name,
        text=req.text,
        output_ids=list(req.output_ids),
        logprobs=list(req.logprobs) if req.return_logprob else None,
        top_logprobs=list(req.top_logprobs) if req.top_logprobs_num else None,
        input_logprobs=list(req.input_logprobs) if req.input_logprob_start >= 0 else None,
        input_top_logprobs=list(req.input_top_logprobs) if req.input_logprob_start >= 0 else None,
        input_ids=req.prompt_ids if req.input_logprob_start >= 0 else None,
        delta_text=take_delta(req),
        delta_ids=delta_ids,
        finish_reason=req.finish_reason if req.finished else None,
        matched_stop=req.matched_stop,
        error=req.error,
        first_token_time=req.first_token_time,
        arrival_time=req.arrival_time,
        finish_time=req.finish_time,
    )

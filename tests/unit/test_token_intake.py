"""A sampled token's intake (``engine/token_intake.py``) against the stop rules written out by hand: EOS
and stop tokens (held off by ``min_new_tokens``, EOS ignored with ``ignore_eos``), ``max_new_tokens``,
the model's context length; logprobs and top logprobs; and each RequestOutput's deltas adding up."""

from __future__ import annotations

import torch

from mmlora.engine.request import Request, Status
from mmlora.engine.sampling_params import SamplingParams
from mmlora.engine.token_intake import append_token, request_output

EOS = 2


def _decode(ids: list[int], *options: bool) -> str:
    return "".join(chr(ord("a") + i % 26) for i in ids)


def _take(req: Request, tokens: list[int], max_model_len: int = 1000) -> list[str | None]:
    """Append ``tokens`` until the request has a finish reason; each step's reason (None while running)."""
    logprobs = torch.log_softmax(torch.arange(30, dtype=torch.float32), 0)
    reasons = []
    for t in tokens:
        append_token(req, t, logprobs, 1.0, {EOS}, max_model_len, _decode)
        reasons.append(req.finish_reason)
        if req.finish_reason is not None:
            break
    return reasons


def _request(**sampling) -> Request:
    return Request("r", [5, 6, 7], SamplingParams(**sampling), None)


def test_eos_stops_only_after_min_new_tokens_and_never_with_ignore_eos():
    req = _request(min_new_tokens=2)
    assert _take(req, [EOS, 4, EOS, 4]) == [None, None, "stop"]
    assert req.matched_stop == EOS and req.output_ids == [EOS, 4, EOS]
    req = _request(ignore_eos=True, max_new_tokens=3)
    assert _take(req, [EOS, EOS, EOS, EOS]) == [None, None, "length"]
    req = _request(stop_token_ids=(9,))
    assert _take(req, [4, 9, 4]) == [None, "stop"] and req.matched_stop == 9


def test_length_at_max_new_tokens_or_the_context():
    assert _take(_request(max_new_tokens=2), [4, 4, 4]) == [None, "length"]
    # 3 prompt tokens: the fifth known token fills a 5-token context.
    assert _take(_request(max_new_tokens=10), [4, 4, 4], max_model_len=5) == [None, "length"]


def test_logprobs_and_outputs_add_up():
    req = Request("r", [5], SamplingParams(max_new_tokens=3), None, return_logprob=True, top_logprobs_num=2)
    logprobs = torch.log_softmax(torch.arange(30, dtype=torch.float32), 0)
    ids, text = [], ""
    for t in (3, 4, 5):
        append_token(req, t, logprobs, 7.0, {EOS}, 100, _decode)
        if req.finish_reason is not None:
            req.status = Status.FINISHED  # what the engine's _finish does
        out = request_output(req)
        ids += out.delta_ids
        text += out.delta_text
    assert req.logprobs == [float(logprobs[t]) for t in (3, 4, 5)]
    assert req.top_logprobs[0] == [(29, float(logprobs[29])), (28, float(logprobs[28]))]
    assert ids == out.output_ids == [3, 4, 5] and text == out.text == "def"
    assert out.finish_reason == "length" and out.first_token_time == 7.0

"""Pieces shared by ``/v1/completions`` and ``/v1/chat/completions``: sampling, model, usage, streaming."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from mmlora.engine.request_handle import RequestHandle
from mmlora.engine.sampling_params import RequestOutput, SamplingParams
from mmlora.lora.refs import AdapterRef
from mmlora.server.engine_io import SSE_DONE, failure_error, merge, parse_sampling, sse
from mmlora.server.errors import APIError
from mmlora.server.schemas import ChatCompletionRequest, CompletionRequest
from mmlora.server.state import ServerState
from mmlora.server.structured import openai_constraint

_RENAMED = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sampling_from_openai(req: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> SamplingParams:
    """OpenAI (and vLLM extra) sampling fields -> SamplingParams; refuse what is not supported."""
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    values: dict[str, Any] = {
        "max_new_tokens": max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "seed": req.seed,
        "n": req.n,
        "ignore_eos": req.ignore_eos,
        "min_new_tokens": req.min_tokens,
        "skip_special_tokens": req.skip_special_tokens,
    }
    constraint, _ = openai_constraint(req)
    values.update(constraint)
    values = {k: v for k, v in values.items() if v is not None}
    try:
        return parse_sampling(values)
    except APIError as e:
        # Name the OpenAI field the client sent, not our internal one.
        message = e.message.replace("sampling_params.", "")
        field = message.partition(":")[0]
        field = _RENAMED.get(field, field)
        message = field + message[len(message.partition(":")[0]) :]
        raise APIError(400, message, param=field) from None


def adapter_of(state: ServerState, req: CompletionRequest | ChatCompletionRequest) -> AdapterRef | None:
    """The adapter a request selects through ``model`` (the served name: none; ``<served>:<adapter>``
    or an adapter) and optionally the ``lora_path`` extra, which must then name the same one."""
    by_model = None
    if req.model not in (None, "", state.served_name):
        prefix = state.served_name + ":"
        by_model = req.model[len(prefix) :] if req.model.startswith(prefix) else req.model
    if req.lora_path:
        return state.adapter(req.lora_path, same_as=("model", by_model) if by_model else None)
    return state.adapter(by_model, param="model")


def max_tokens_for(state: ServerState, prompt_tokens: int, requested: int | None, *, param: str) -> int:
    """The requested budget, or what is left of the context window when none was given."""
    limit = int(getattr(state.engine, "max_model_len", 0) or 0)
    if requested is None:
        if limit and prompt_tokens >= limit:
            raise APIError(
                400, f"prompt has {prompt_tokens} tokens; the context is {limit}", param="messages"
            )
        return max(1, limit - prompt_tokens) if limit else 128
    if requested < 0:
        raise APIError(400, f"{param}: must be >= 0", param=param)
    if limit and requested > limit:
        raise APIError(400, f"{param}: {requested} is more than max_model_len={limit}", param=param)
    return requested


def finish_reason(out: RequestOutput) -> str | None:
    return out.finish_reason if out.finish_reason in ("stop", "length") else None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def usage_of(outputs: list[RequestOutput], n: int) -> dict[str, Any]:
    """Each prompt counts once however many choices (n) it has (its first choice's cache hit)."""
    firsts = outputs[::n]
    prompt = sum(out.prompt_tokens for out in firsts)
    cached = sum(out.cached_tokens for out in firsts)
    return usage(prompt, sum(len(out.output_ids) for out in outputs), cached)


async def stream_chunks(
    handles: list[RequestHandle],
    *,
    make_chunk: Callable[[int, RequestOutput, int], dict[str, Any] | None],
    base: dict[str, Any],
    n: int,
    include_usage: bool,
    continuous_usage: bool,
    head: list[dict[str, Any]] | None = None,
) -> AsyncIterator[str]:
    """SSE stream of OpenAI chunks, a final usage chunk if asked, and ``data: [DONE]``.

    ``make_chunk(index, increment, first_new_token)`` builds one choice delta (or None to skip).
    """
    for chunk in head or []:
        yield sse({**base, **chunk, **({"usage": None} if include_usage else {})})
    done: dict[int, RequestOutput] = {}
    async for i, out in merge(handles):
        if out.finish_reason == "abort":
            yield sse(failure_error(out).body())
            done[i] = out
            continue
        choice = make_chunk(i, out, len(out.output_ids) - len(out.delta_ids))
        if out.finished:
            done[i] = out
        if choice is None:
            continue
        chunk = {**base, "choices": [choice]}
        if continuous_usage:
            chunk["usage"] = usage(out.prompt_tokens, len(out.output_ids), out.cached_tokens)
        elif include_usage:
            chunk["usage"] = None
        yield sse(chunk)
    if include_usage:
        outs = [done[i] for i in sorted(done)]
        yield sse({**base, "choices": [], "usage": usage_of(outs, n)})
    yield SSE_DONE


def base_fields(kind: str, model: str) -> dict[str, Any]:
    return {
        "id": new_id("cmpl" if kind == "text_completion" else "chatcmpl"),
        "object": kind,
        "created": int(time.time()),
        "model": model,
    }


def sse_response(
    handles: list[RequestHandle],
    *,
    make_chunk: Callable[[int, RequestOutput, int], dict[str, Any] | None],
    base: dict[str, Any],
    n: int,
    stream_options: Any,
    head: list[dict[str, Any]] | None = None,
) -> StreamingResponse:
    """The ``text/event-stream`` response of :func:`stream_chunks`, usage flags read from the request's
    ``stream_options`` (``include_usage``, ``continuous_usage_stats``; None: neither)."""
    usage = bool(stream_options and stream_options.include_usage)
    return StreamingResponse(
        stream_chunks(
            handles,
            make_chunk=make_chunk,
            base=base,
            n=n,
            head=head,
            include_usage=usage,
            continuous_usage=usage and bool(stream_options.continuous_usage_stats),
        ),
        media_type="text/event-stream",
    )

"""OpenAI-compatible ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``.

``model`` selects the base (the served name), an adapter (its name), or ``<served-name>:<adapter>``.
Choices are ordered prompt by prompt, ``n`` per prompt; usage counts each prompt once.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from mmlora.engine.sampling_params import RequestOutput
from mmlora.server.engine_io import check_failures, collect, submit
from mmlora.server.errors import APIError
from mmlora.server.media import load_image_bytes
from mmlora.server.openai_common import (
    adapter_of,
    base_fields,
    finish_reason,
    max_tokens_for,
    sampling_from_openai,
    sse_response,
    usage_of,
)
from mmlora.server.schemas import ChatCompletionRequest, CompletionRequest
from mmlora.server.state import ServerState
from mmlora.server.structured import openai_constraint

router = APIRouter()

_MAX_TOP_LOGPROBS = 20


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.mmlora
    loras = [info for info in await state.loras() if not info["unloading"]]
    created = int(state.started)
    root = str(getattr(state.engine, "model_root", state.served_name))
    data = [_model_card(state.served_name, root, None, created, state)]
    data += [
        _model_card(info["name"], info.get("root") or info["name"], state.served_name, created, state)
        for info in loras
    ]
    return {"object": "list", "data": data}


def _model_card(name: str, root: str, parent: str | None, created: int, state: ServerState) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "mmlora",
        "root": root,
        "parent": parent,
        "max_model_len": getattr(state.engine, "max_model_len", None),
    }


# ---- /v1/completions ----------------------------------------------------------------------------


def _completion_prompts(prompt: Any) -> list[dict[str, Any]]:
    """OpenAI's prompt forms -> one engine input per prompt."""
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if not prompt:
        raise APIError(400, "prompt: must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [{"input_ids": list(prompt)}]
    if all(isinstance(p, str) for p in prompt):
        return [{"prompt": p} for p in prompt]
    if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
        return [{"input_ids": list(p)} for p in prompt]
    raise APIError(400, "prompt: expected a string, a list of strings, or token id lists", param="prompt")


def _completion_logprobs(
    state: ServerState, out: RequestOutput, start: int, offset: int, top_n: int, echo: bool
) -> dict[str, Any]:
    """OpenAI's ``logprobs`` of a choice: its output tokens from ``start``, after the prompt's when
    ``echo``. Like vLLM, each ``top_logprobs`` entry holds the chosen token and the ``top_n`` most
    likely ones (``logprobs: 0``: the chosen token only; where two tokens decode to the same text, the
    chosen one's value wins); the first prompt token's entries are null."""
    tok = state.token_text
    ids = list(out.output_ids[start:])
    lps: list[float | None] = list((out.logprobs or [])[start:])
    tops = list((out.top_logprobs or [])[start:]) or [[] for _ in ids]
    if echo:
        ids = list(out.input_ids or []) + ids
        lps = list(out.input_logprobs or []) + lps
        tops = list(out.input_top_logprobs or [[] for _ in out.input_logprobs or []]) + tops
    tokens = [tok(t) for t in ids]
    offsets, pos = [], offset
    for text in tokens:
        offsets.append(pos)
        pos += len(text)
    top_logprobs = [
        None if lp is None else {**{tok(t): v for t, v in row[:top_n]}, tok(tid): lp}
        for tid, lp, row in zip(ids, lps, tops)
    ]
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top_logprobs, "text_offset": offsets}


def _prompt_logprobs(state: ServerState, out: RequestOutput, top_n: int) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} with the token itself and the ``top_n`` most likely; rank is known within the top."""
    tok = state.token_text
    rows = out.input_top_logprobs or [[] for _ in out.input_logprobs or []]
    result: list[dict[str, Any] | None] = []
    for tid, lp, row in zip(out.input_ids or [], out.input_logprobs or [], rows):
        if lp is None:
            result.append(None)
            continue
        ranked = row[:top_n]
        rank = next((r + 1 for r, (t, _) in enumerate(ranked) if t == tid), None)
        entry = {str(tid): {"logprob": lp, "rank": rank, "decoded_token": tok(tid)}}
        for r, (t, v) in enumerate(ranked):
            entry.setdefault(str(t), {"logprob": v, "rank": r + 1, "decoded_token": tok(t)})
        result.append(entry)
    return result


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request) -> Any:
    state: ServerState = request.app.state.mmlora
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.best_of not in (None, req.n):
        raise APIError(400, "best_of must equal n (or be omitted)", param="best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= _MAX_TOP_LOGPROBS:
        raise APIError(400, f"logprobs: must be in [0, {_MAX_TOP_LOGPROBS}]", param="logprobs")
    if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= _MAX_TOP_LOGPROBS:
        raise APIError(400, f"prompt_logprobs: must be in [0, {_MAX_TOP_LOGPROBS}]", param="prompt_logprobs")
    prompts = _completion_prompts(req.prompt)
    sp = sampling_from_openai(req, max_tokens_for(state, 0, req.max_tokens, param="max_tokens"))
    await state.preprocess.compile_grammars([sp], param=openai_constraint(req)[1])
    lora = adapter_of(state, req)
    want_logprobs = req.logprobs is not None
    # Prompt logprobs for echo (lm-eval-harness's loglikelihood requests) and vLLM's prompt_logprobs.
    echo_logprobs = req.echo and want_logprobs
    with_prompt = echo_logprobs or req.prompt_logprobs is not None
    top_n = max(req.logprobs or 0, req.prompt_logprobs or 0)
    items = []
    for p in prompts:
        for one in sp.samples():
            items.append(
                {
                    **p,
                    "sampling_params": one,
                    "lora": lora,
                    "return_logprob": want_logprobs or with_prompt,
                    "top_logprobs_num": top_n,
                    "logprob_start_len": 0 if with_prompt else -1,
                    "client_id": req.user or None,
                }
            )
    echo = [_echo_text(state, items[i]) if req.echo else "" for i in range(len(items))]
    await state.preprocess.prepare(items, param="prompt")
    handles = await submit(state.bg, items)
    model = req.model or state.served_name
    base = base_fields("text_completion", model)

    if req.stream:
        opts = req.stream_options

        def chunk(i: int, out: RequestOutput, start: int) -> dict[str, Any] | None:
            text = (echo[i] if start == 0 and echo[i] else "") + out.delta_text
            if not text and not out.finished and not out.delta_ids:
                return None
            return {
                "index": i,
                "text": text,
                "finish_reason": finish_reason(out),
                "stop_reason": out.matched_stop if out.finished else None,
                "logprobs": (
                    _completion_logprobs(
                        state, out, start, 0, req.logprobs or 0, echo_logprobs and start == 0
                    )
                    if want_logprobs
                    else None
                ),
            }

        return sse_response(handles, make_chunk=chunk, base=base, n=sp.n, stream_options=opts)

    outputs = await collect(request, handles)
    check_failures(outputs)
    choices = [
        {
            "index": i,
            "text": echo[i] + out.text,
            "finish_reason": finish_reason(out),
            "stop_reason": out.matched_stop,
            "logprobs": (
                _completion_logprobs(
                    state, out, 0, 0 if echo_logprobs else len(echo[i]), req.logprobs or 0, echo_logprobs
                )
                if want_logprobs
                else None
            ),
            **(
                {"prompt_logprobs": _prompt_logprobs(state, out, req.prompt_logprobs)}
                if req.prompt_logprobs is not None
                else {}
            ),
        }
        for i, out in enumerate(outputs)
    ]
    return {**base, "choices": choices, "usage": usage_of(outputs, sp.n)}


def _echo_text(state: ServerState, item: dict[str, Any]) -> str:
    if "prompt" in item:
        return item["prompt"]
    return state.engine.tokenizer.decode(item["input_ids"])


# ---- /v1/chat/completions -----------------------------------------------------------------------

_ROLES = {"system", "user", "assistant", "tool", "developer"}


def _chat_messages(
    state: ServerState, req: ChatCompletionRequest
) -> tuple[list[dict[str, Any]], list[bytes]]:
    """OpenAI messages -> template messages (image parts become {"type": "image"}) and the images."""
    messages: list[dict[str, Any]] = []
    images: list[bytes] = []
    for i, msg in enumerate(req.messages):
        if msg.role not in _ROLES:
            raise APIError(400, f"messages[{i}].role: unknown role {msg.role!r}", param=f"messages[{i}].role")
        role = "system" if msg.role == "developer" else msg.role
        if msg.content is None or isinstance(msg.content, str):
            messages.append({"role": role, "content": msg.content or ""})
            continue
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(msg.content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type")
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise APIError(400, f"{where}.text: expected a string", param=where)
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url":
                if not state.engine.is_multimodal:
                    raise APIError(
                        400, f"{where}: the model {state.served_name!r} takes no images", param=where
                    )
                ref = part.get("image_url")
                url = ref.get("url") if isinstance(ref, dict) else ref
                images.append(load_image_bytes(url, state.config, param=f"{where}.image_url"))
                parts.append({"type": "image"})
            else:
                raise APIError(400, f"{where}.type: unsupported content part {kind!r}", param=where)
        if any(p["type"] == "image" for p in parts):
            messages.append({"role": role, "content": parts})
        else:  # text-only templates expect a string
            messages.append({"role": role, "content": "\n".join(p["text"] for p in parts)})
    return messages, images


def _chat_logprobs(state: ServerState, out: RequestOutput, start: int) -> dict[str, Any]:
    tok = state.token_text

    def item(tid: int, lp: float) -> dict[str, Any]:
        text = tok(tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    tops = out.top_logprobs or []
    content = []
    for k, (tid, lp) in enumerate(zip(out.output_ids[start:], (out.logprobs or [])[start:])):
        row = tops[start + k] if start + k < len(tops) else []
        content.append({**item(tid, lp), "top_logprobs": [item(t, v) for t, v in row]})
    return {"content": content}


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
    state: ServerState = request.app.state.mmlora
    if req.tools and req.tool_choice != "none":
        raise APIError(400, "tools are not supported", param="tools")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if not 0 <= req.top_logprobs <= _MAX_TOP_LOGPROBS:
            raise APIError(400, f"top_logprobs: must be in [0, {_MAX_TOP_LOGPROBS}]", param="top_logprobs")
    if (
        req.max_tokens is not None
        and req.max_completion_tokens is not None
        and (req.max_tokens != req.max_completion_tokens)
    ):
        raise APIError(400, "max_tokens and max_completion_tokens differ", param="max_completion_tokens")
    lora = adapter_of(state, req)
    messages, images = _chat_messages(state, req)
    pre = state.preprocess
    for i, msg in enumerate(messages):
        if isinstance(msg["content"], str):
            pre.check_text(msg["content"], f"messages[{i}].content")
    try:
        prompt = await pre.run(state.engine.apply_chat_template, messages)
    except Exception as e:  # template errors (e.g. roles that must alternate) are the client's to fix
        raise APIError(400, f"messages: the chat template failed: {e}", param="messages") from None
    first = {"prompt": prompt, "images": images or None}
    await pre.prepare([first], param="messages")
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    sp = sampling_from_openai(req, max_tokens_for(state, len(first["prepared"][0]), requested, param=param))
    await state.preprocess.compile_grammars([sp], param=openai_constraint(req)[1])
    items = [
        {
            "prepared": (list(first["prepared"][0]), first["prepared"][1]),
            "sampling_params": one,
            "lora": lora,
            "return_logprob": req.logprobs,
            "top_logprobs_num": req.top_logprobs or 0,
            "client_id": req.user or None,
        }
        for one in sp.samples()
    ]
    handles = await submit(state.bg, items)
    model = req.model or state.served_name
    base = base_fields("chat.completion.chunk" if req.stream else "chat.completion", model)

    if req.stream:
        opts = req.stream_options
        head = [
            {
                "choices": [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            }
            for i in range(len(items))
        ]

        def chunk(i: int, out: RequestOutput, start: int) -> dict[str, Any] | None:
            if not out.delta_text and not out.finished and not out.delta_ids:
                return None
            delta = {"content": out.delta_text} if out.delta_text or not out.finished else {}
            return {
                "index": i,
                "delta": delta,
                "finish_reason": finish_reason(out),
                "stop_reason": out.matched_stop if out.finished else None,
                "logprobs": _chat_logprobs(state, out, start) if req.logprobs else None,
            }

        return sse_response(handles, make_chunk=chunk, base=base, n=sp.n, stream_options=opts, head=head)

    outputs = await collect(request, handles)
    check_failures(outputs)
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": out.text},
            "logprobs": _chat_logprobs(state, out, 0) if req.logprobs else None,
            "finish_reason": finish_reason(out),
            "stop_reason": out.matched_stop,
        }
        for i, out in enumerate(outputs)
    ]
    return {**base, "choices": choices, "usage": usage_of(outputs, sp.n)}

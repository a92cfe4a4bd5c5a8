"""SGLang's native ``POST /generate``: one prompt or a batch, each with its own adapter and sampling.

Shapes follow SGLang: a single ``text`` (or one ``input_ids`` list) answers one object, a list answers a
list (``n`` > 1 answers n consecutive objects per prompt); each object is
``{"text", "output_ids", "meta_info": {"id", "prompt_tokens", "completion_tokens", "cached_tokens",
"finish_reason": {"type", ...}, "lora_path", "e2e_latency"}}``; with ``return_logprob`` also
``input_token_logprobs`` (prompt tokens from ``logprob_start_len`` on; -1: the last one),
``output_token_logprobs`` (entries ``[logprob, token_id, text or None]``) and, with
``top_logprobs_num``, ``input_top_logprobs`` / ``output_top_logprobs``. With ``stream`` the answer is server-sent
events carrying the cumulative state (``"index"`` tells which prompt) and ending with ``data: [DONE]``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from mmlora.engine.batch_api import per_prompt
from mmlora.engine.sampling_params import RequestOutput
from mmlora.server.engine_io import (
    SSE_DONE,
    check_failures,
    collect,
    failure_error,
    merge,
    parse_sampling,
    sse,
    submit,
)
from mmlora.server.errors import APIError
from mmlora.server.media import load_image_bytes
from mmlora.server.schemas import GenerateRequest
from mmlora.server.state import ServerState

router = APIRouter()


def _aligned(value: Any, n: int, name: str, batch: bool) -> list[Any]:
    """A per-prompt list of ``value``: a scalar is repeated; a list must have one entry per prompt."""
    if isinstance(value, list) and not batch:
        raise APIError(400, f"{name}: a list is only allowed when text/input_ids is a list", param=name)
    try:
        return per_prompt(value, n, name)
    except ValueError as e:
        raise APIError(400, str(e), param=name) from None


def _or(value: Any, default: Any) -> Any:
    """null (whole, or per prompt) means the default."""
    if isinstance(value, list):
        return [default if v is None else v for v in value]
    return default if value is None else value


def _images(value: Any, n: int, batch: bool, state: ServerState) -> list[list[bytes] | None]:
    if value is None:
        return [None] * n
    if not state.engine.is_multimodal:
        raise APIError(
            400, f"image_data: the model {state.served_name!r} takes no images", param="image_data"
        )
    if not batch:
        refs = [value] if isinstance(value, str) else value
        return [[load_image_bytes(r, state.config, param="image_data") for r in refs]]
    if not isinstance(value, list) or len(value) != n:
        raise APIError(
            400, f"image_data: for a batch give a list with one entry per prompt ({n})", param="image_data"
        )
    out: list[list[bytes] | None] = []
    for entry in value:
        if entry is None:
            out.append(None)
        else:
            refs = [entry] if isinstance(entry, str) else entry
            out.append([load_image_bytes(r, state.config, param="image_data") for r in refs])
    return out


async def _build(body: GenerateRequest, state: ServerState) -> tuple[list[dict[str, Any]], list[Any], bool]:
    """-> (engine request kwargs, the lora_path each one named, answer-is-a-list)."""
    if body.text is not None and body.input_ids is not None:
        raise APIError(400, "give either text or input_ids, not both", param="text")
    if body.text is None and body.input_ids is None:
        raise APIError(400, "one of text or input_ids is required", param="text")
    if body.text is not None:
        batch = isinstance(body.text, list)
        prompts: list[Any] = body.text if batch else [body.text]
        key = "prompt"
    else:
        batch = bool(body.input_ids) and isinstance(body.input_ids[0], list)
        prompts = body.input_ids if batch else [body.input_ids]
        key = "input_ids"
    if not prompts or (key == "input_ids" and any(len(p) == 0 for p in prompts)):
        raise APIError(400, f"{'text' if key == 'prompt' else 'input_ids'}: must not be empty", param=key)
    if body.session_id is not None:
        raise APIError(400, "session_id: sessions are not supported", param="session_id")
    n = len(prompts)
    sampling = _aligned(body.sampling_params, n, "sampling_params", batch)
    loras = _aligned(body.lora_path, n, "lora_path", batch)
    logprob = _aligned(_or(body.return_logprob, False), n, "return_logprob", batch)
    top_n = _aligned(_or(body.top_logprobs_num, 0), n, "top_logprobs_num", batch)
    starts = _aligned(_or(body.logprob_start_len, -1), n, "logprob_start_len", batch)
    rids = _aligned(body.rid, n, "rid", batch)
    if batch and isinstance(body.rid, str):
        raise APIError(400, "rid: for a batch give a list with one id per prompt", param="rid")
    images = _images(body.image_data, n, batch, state)
    items, named = [], []
    for i in range(n):
        sp = parse_sampling(
            sampling[i].as_dict() if sampling[i] is not None else None, param="sampling_params"
        )
        if top_n[i] < 0:
            raise APIError(400, "top_logprobs_num: must be >= 0", param="top_logprobs_num")
        copies = sp.samples()
        for j, one in enumerate(copies):
            rid = rids[i] if len(copies) == 1 or rids[i] is None else f"{rids[i]}-{j}"
            items.append(
                {
                    key: prompts[i],
                    "sampling_params": one,
                    "lora": state.adapter(loras[i]),
                    "images": images[i],
                    "request_id": rid,
                    "return_logprob": bool(logprob[i]),
                    "top_logprobs_num": int(top_n[i]) if logprob[i] else 0,
                    "logprob_start_len": int(starts[i]),
                    "client_id": body.client_id,
                }
            )
            named.append(loras[i])
    await state.preprocess.compile_grammars(
        [item["sampling_params"] for item in items], param="sampling_params"
    )
    await state.preprocess.prepare(items, param="text" if key == "prompt" else "input_ids")
    return items, named, batch or len(items) > 1


def _finish_reason(out: RequestOutput) -> dict[str, Any] | None:
    if out.finish_reason is None:
        return None
    if out.finish_reason == "length":
        return {"type": "length", "length": len(out.output_ids)}
    if out.finish_reason == "stop":
        return {"type": "stop", "matched": out.matched_stop}
    return {"type": "abort", "message": out.error or "aborted"}


def _format(out: RequestOutput, lora_path: Any, state: ServerState, with_text: bool, logprob: bool) -> dict:
    end = out.finish_time or time.monotonic()  # the engine's timestamps are time.monotonic()
    meta: dict[str, Any] = {
        "id": out.request_id,
        "finish_reason": _finish_reason(out),
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": len(out.output_ids),
        "cached_tokens": out.cached_tokens,
        "lora_path": lora_path,
        "e2e_latency": max(0.0, end - out.arrival_time) if out.arrival_time else None,
    }
    if logprob:
        tok = state.token_text

        def entry(tid: int, lp: float) -> list[Any]:
            return [lp, tid, tok(tid) if with_text else None]

        meta["output_token_logprobs"] = [entry(t, lp) for t, lp in zip(out.output_ids, out.logprobs or [])]
        meta["output_top_logprobs"] = [[entry(t, lp) for t, lp in row] for row in (out.top_logprobs or [])]
        prompt_lps = out.input_logprobs or []
        prompt_ids = (out.input_ids or [])[len(out.input_ids or []) - len(prompt_lps) :]
        meta["input_token_logprobs"] = [entry(t, lp) for t, lp in zip(prompt_ids, prompt_lps)]
        if out.input_top_logprobs:
            meta["input_top_logprobs"] = [
                [entry(t, lp) for t, lp in row] if row else None for row in out.input_top_logprobs
            ]
    return {"text": out.text, "output_ids": list(out.output_ids), "meta_info": meta}


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request) -> Any:
    state: ServerState = request.app.state.mmlora
    items, named, as_list = await _build(body, state)
    handles = await submit(state.bg, items)
    with_text = body.return_text_in_logprobs

    if body.stream:

        async def events() -> Any:
            async for i, out in merge(handles):
                if out.finish_reason == "abort":
                    err = failure_error(out)
                    yield sse({**err.body(), "index": i})
                    continue
                chunk = _format(out, named[i], state, with_text, items[i]["return_logprob"])
                chunk["index"] = i
                yield sse(chunk)
            yield SSE_DONE

        return StreamingResponse(events(), media_type="text/event-stream")

    outputs = await collect(request, handles)
    check_failures(outputs)
    results = [
        _format(out, named[i], state, with_text, items[i]["return_logprob"]) for i, out in enumerate(outputs)
    ]
    return results if as_list else results[0]


async def _server_info(request: Request) -> dict[str, Any]:
    """SGLang's ``/get_server_info``: the flat server arguments (engine and server config) and version."""
    state: ServerState = request.app.state.mmlora
    config = getattr(state.engine, "config", None)
    info: dict[str, Any] = {}
    for section in dataclasses.fields(config) if dataclasses.is_dataclass(config) else ():
        info.update(dataclasses.asdict(getattr(config, section.name)))
    info.update({k: v for k, v in dataclasses.asdict(state.config).items() if k != "api_key"})
    info.update(
        {
            "model_path": info.get("model", state.served_name),
            "served_model_name": state.served_name,
            "max_model_len": getattr(state.engine, "max_model_len", None),
            "version": _version(),
        }
    )
    return info


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mmlora")
    except PackageNotFoundError:
        return "unknown"


router.add_api_route("/get_server_info", _server_info, methods=["GET"])
router.add_api_route("/server_info", _server_info, methods=["GET"])

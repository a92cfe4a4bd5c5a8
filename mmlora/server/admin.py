"""Adapter administration and operations: load/unload, health, model info, metrics, flush_cache.

Run-time load/unload is off unless ``--enable-lora-runtime-update``; paths are confined to
``--lora-root`` and fully validated by the engine before any device memory is touched. A Hugging Face
Hub id is refused unless ``--allow-hub-adapters``; then it is downloaded on a worker thread (the engine
keeps stepping) and the engine is handed the cached folder. Unload refuses
new requests for the adapter at once and frees its slot and host copy when its in-flight requests end.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from mmlora.engine.sampling_params import SamplingParams
from mmlora.hub import HubError, parse_hub_ref, resolve_adapter
from mmlora.lora.paths import AdapterFolderMissing, AdapterPathError, confine_adapter_path
from mmlora.server.errors import APIError, to_api_error
from mmlora.server.metrics import CONTENT_TYPE, HEALTH_REQUEST_PREFIX
from mmlora.server.schemas import LoadLoRARequest, UnloadLoRARequest
from mmlora.server.state import ServerState

router = APIRouter()

_UNLOAD_WAIT_S = 30.0


def _require_runtime_update(state: ServerState) -> None:
    if not state.config.enable_lora_runtime_update:
        raise APIError(
            403,
            "run-time adapter loading is disabled; start the server with --enable-lora-runtime-update "
            "and --lora-root",
            code="lora_runtime_update_disabled",
        )


@router.post("/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRARequest, request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.mmlora
    _require_runtime_update(state)
    name = body.lora_name
    if name == state.served_name or name.startswith(state.served_name + ":"):
        raise APIError(400, f"lora_name: {name!r} clashes with the served model name", param="lora_name")
    real = await _runtime_adapter_folder(state, body.lora_path)
    await _wait_unloaded(state, name)
    if name in await state.adapter_names():
        raise APIError(400, f"lora_name: an adapter named {name!r} is already loaded", param="lora_name")
    try:
        await state.bg.run_async(lambda eng: eng.load_lora(name, real, pinned=body.pinned))
    except Exception as e:
        raise to_api_error(e) from None
    return {"success": True, "message": f"loaded adapter {name!r}", "lora_name": name}


async def _runtime_adapter_folder(state: ServerState, path: str) -> str:
    """A folder under --lora-root, or a hub id (with --allow-hub-adapters) fetched off the engine thread."""
    root = state.config.lora_root
    ref = parse_hub_ref(path)
    if ref is None or (root and os.path.lexists(os.path.join(os.path.realpath(root), path))):
        try:
            return confine_adapter_path(path, root)
        except AdapterFolderMissing as e:
            raise APIError(404, str(e), param="lora_path", code="lora_not_found") from None
        except AdapterPathError as e:
            raise APIError(400, str(e), param="lora_path") from None
    config = state.engine.config
    if not config.lora.allow_hub_adapters:
        raise APIError(
            403,
            f"lora_path: {path!r} is a Hugging Face Hub id and this server does not download adapters at run "
            "time; start it with --allow-hub-adapters, or put the adapter under --lora-root",
            param="lora_path",
            code="hub_adapters_disabled",
        )
    try:
        return await asyncio.to_thread(
            resolve_adapter,
            path,
            download_dir=config.model.download_dir,
            allow_pickled=config.lora.allow_pickled_adapters,
            what="lora_path",
        )
    except HubError as e:
        raise APIError(400, str(e), param="lora_path") from None


async def _wait_unloaded(state: ServerState, name: str) -> None:
    """A name being unloaded is free again once its in-flight requests end: wait for that (bounded)."""
    deadline = asyncio.get_running_loop().time() + _UNLOAD_WAIT_S
    while True:
        loras = await state.loras()
        busy = [info for info in loras if info["name"] == name and info.get("unloading")]
        if not busy:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise APIError(
                409,
                f"lora_name: {name!r} is still being unloaded ({busy[0]['active_requests']} requests in flight); "
                "retry later",
                param="lora_name",
            )
        await asyncio.sleep(0.05)


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRARequest, request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.mmlora
    _require_runtime_update(state)
    name = body.lora_name
    names = await state.adapter_names()
    if name not in names:
        raise APIError(
            404,
            f"lora_name: no adapter named {name!r}; loaded: {names}",
            param="lora_name",
            code="lora_not_found",
        )
    try:
        await state.bg.run_async(lambda eng: eng.unload_lora(name))
    except Exception as e:
        raise to_api_error(e) from None
    # New requests for it are refused from now on; answer once its in-flight requests have finished
    # and its slot and host copy are freed (bounded: a long request must not hold the caller forever).
    try:
        await _wait_unloaded(state, name)
        freed = True
    except APIError:
        freed = False
    message = (
        f"unloaded adapter {name!r}" if freed else f"adapter {name!r} is unloading; requests still in flight"
    )
    return {"success": True, "message": message, "lora_name": name, "freed": freed}


async def _health(request: Request) -> Response:
    """A real one-token generation through the whole engine."""
    state: ServerState = request.app.state.mmlora
    if not state.bg.accepting:
        raise APIError(503, "the server is shutting down", code="unavailable")
    try:
        handle = await state.bg.submit_async(
            input_ids=[_probe_token(state)],
            request_id=f"{HEALTH_REQUEST_PREFIX}{uuid.uuid4().hex}",
            sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True),
        )
        out = await asyncio.wait_for(handle.result_async(), state.config.health_timeout)
    except asyncio.TimeoutError:
        raise APIError(503, f"health check: no token within {state.config.health_timeout} s") from None
    except Exception as e:
        err = to_api_error(e)
        raise APIError(503, f"health check failed: {err.message}") from None
    if out.finish_reason == "abort" or len(out.output_ids) != 1:
        raise APIError(503, f"health check failed: {out.error or out.finish_reason}")
    return Response(status_code=200)


def _probe_token(state: ServerState) -> int:
    tok = state.engine.tokenizer
    for candidate in (getattr(tok, "bos_token_id", None), getattr(tok, "eos_token_id", None)):
        if isinstance(candidate, int):
            return candidate
    return 0


router.add_api_route("/health", _health, methods=["GET"])
router.add_api_route("/health_generate", _health, methods=["GET"])


@router.get("/get_model_info")
async def get_model_info(request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.mmlora
    eng = state.engine
    cfg = getattr(eng, "config", None)
    model_cfg = getattr(cfg, "model", None)
    lora_cfg = getattr(cfg, "lora", None)
    return {
        "model_path": getattr(model_cfg, "model", state.served_name),
        "tokenizer_path": getattr(model_cfg, "tokenizer", None) or getattr(model_cfg, "model", None),
        "served_model_name": state.served_name,
        "is_generation": True,
        "is_multimodal": bool(eng.is_multimodal),
        "max_model_len": getattr(eng, "max_model_len", None),
        "max_loras_per_batch": getattr(lora_cfg, "max_loras_per_batch", None),
        "max_lora_rank": getattr(lora_cfg, "max_lora_rank", None),
        "lora_page_rank": getattr(eng, "lora_page_rank", None),
        "lora_backend": getattr(eng, "lora_backend", None) or getattr(lora_cfg, "lora_backend", None),
        "loras": await state.loras(),
    }


async def _flush_cache(request: Request) -> dict[str, Any]:
    """SGLang's ``/flush_cache``: empty the prefix cache, refused while requests run or wait."""
    state: ServerState = request.app.state.mmlora
    if not await state.bg.run_async(lambda eng: eng.flush_cache()):
        raise APIError(400, "cache not flushed: requests are running or waiting; retry when idle")
    return {"success": True, "message": "Cache flushed."}


router.add_api_route("/flush_cache", _flush_cache, methods=["GET", "POST"])


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.mmlora
    return Response(content=await state.metrics.render(), media_type=CONTENT_TYPE)

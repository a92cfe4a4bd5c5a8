"""The HTTP front of a Ray Serve deployment of mmlora: route each request to a replica by its adapter.

The ingress does not parse or answer API requests itself: it reads which adapter a request names (SGLang's
``lora_path``, OpenAI's ``model``), asks Ray Serve for a replica by that multiplexed model id, and relays
the replica's own answer (the single-process server's code, run in the replica). Base-model requests carry
no model id and go to any replica. ``routing="default"`` leaves the choice to Ray's default router (for
comparison in ``python -m mmlora.bench cluster``).

A replica that dies is restarted by Ray. A request that it had not yet answered (no byte sent to the
client) is retried once on another replica; otherwise the client gets a 503 that says what happened.
"""

# No `from __future__ import annotations`, and every helper defined above the class: `serve.ingress`
# snapshots the class with what the module holds at that point, and FastAPI must see the real `Request`.
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import RayError

from mmlora.serve.asgi_bridge import HTTPCall, ResponseStart

logger = logging.getLogger(__name__)

ROUTES = ("adapter", "default")
_RETRYABLE = (RayError, ConnectionError)


def adapters_of(path: str, body: bytes, served_name: str) -> list[str]:
    """The adapters a request names, first the one it is routed by; [] for the base model or no body."""
    if not body or path not in ("/generate", "/v1/completions", "/v1/chat/completions"):
        return []
    try:
        data = json.loads(body)
    except ValueError:
        return []  # the replica's app answers the parse error
    if not isinstance(data, dict):
        return []
    if path == "/generate":
        value = data.get("lora_path")
        names = value if isinstance(value, list) else [value]
    else:
        model = data.get("model")
        if isinstance(model, str) and model.startswith(served_name + ":"):
            model = model[len(served_name) + 1 :]
        names = [None if model == served_name else model]
    seen: list[str] = []
    for name in names:
        if isinstance(name, str) and name and name not in seen:
            seen.append(name)
    return seen


def _unavailable(message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "service_unavailable", "param": None, "code": "unavailable"}},
        status_code=503,
    )


async def _next_or_none(stream: Any) -> bytes | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


async def _relay_rest(first: bytes | None, stream: Any, path: str) -> AsyncIterator[bytes]:
    if first is not None:
        yield first
    try:
        async for chunk in stream:
            yield chunk
    except _RETRYABLE as e:  # the client already has part of the answer: end it with an error event
        logger.warning("replica failed while streaming %s: %s", path, e)
        message = "the replica serving this request failed mid-answer; the answer is incomplete"
        yield f"data: {json.dumps({'error': {'message': message, 'code': 'unavailable'}})}\n\n".encode()


api = FastAPI(title="mmlora (Ray Serve)", docs_url=None, redoc_url=None, openapi_url=None)


@serve.ingress(api)
class Ingress:
    def __init__(self, replica: Any, routing: str = "adapter") -> None:
        if routing not in ROUTES:
            raise ValueError(f"routing: must be one of {', '.join(ROUTES)}")
        self.replica = replica
        self.routing = routing
        self.served_name: str | None = None  # asked of a replica on the first request

    async def _served_name(self) -> str:
        if self.served_name is None:
            self.served_name = await self.replica.served_name.remote()
        return self.served_name

    def _call(self, call: HTTPCall, adapters: list[str]) -> Any:
        model_id = adapters[0] if adapters and self.routing == "adapter" else ""
        return self.replica.options(stream=True, multiplexed_model_id=model_id).handle.remote(call, adapters)

    @api.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def relay(self, request: Request, path: str) -> Any:
        body = await request.body()
        call = HTTPCall(
            method=request.method,
            path="/" + path,
            query=request.url.query.encode(),
            headers=tuple((k.lower(), v) for k, v in request.headers.raw),
            body=body,
        )
        try:
            adapters = adapters_of(call.path, body, await self._served_name())
        except _RETRYABLE as e:
            logger.warning("no replica answered: %s", e)
            return _unavailable("no replica is available yet; try again")
        for attempt in (1, 2):
            stream = self._call(call, adapters)
            try:
                start = await stream.__anext__()
                first = await _next_or_none(stream)
            except _RETRYABLE as e:
                logger.warning("replica failed before answering %s (attempt %d): %s", call.path, attempt, e)
                continue
            assert isinstance(start, ResponseStart)
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.headers}
            headers.pop("content-length", None)  # the relay re-chunks the body
            return StreamingResponse(
                _relay_rest(first, stream, call.path), status_code=start.status, headers=headers
            )
        return _unavailable("the replica serving this request failed twice before answering; try again")

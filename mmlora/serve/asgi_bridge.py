"""Run one HTTP request against an in-process ASGI app and stream its answer back message by message.

This is how a Ray Serve replica answers with the very same FastAPI app as ``launch_server``: the ingress
ships the request (method, path, headers, body) to the replica, and the replica drives its app directly,
without a socket. The answer comes back as a ``ResponseStart`` and then body chunks, as they are sent, so
streaming (SSE) stays streaming. If the consumer stops reading (its client went away), the app sees an
``http.disconnect``, exactly as under uvicorn, and aborts the engine request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp


@dataclass(frozen=True)
class HTTPCall:
    """One HTTP request, as plain data that crosses process boundaries."""

    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes


@dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: tuple[tuple[bytes, bytes], ...]


async def call_asgi(app: ASGIApp, call: HTTPCall) -> AsyncIterator[ResponseStart | bytes]:
    """Yield the response start, then each non-empty body chunk, until the app finishes."""
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": call.method,
        "scheme": "http",
        "path": call.path,
        "raw_path": call.path.encode(),
        "query_string": call.query,
        "root_path": "",
        "headers": list(call.headers),
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
    }
    messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await messages.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await messages.put(None)

    task = asyncio.create_task(run())
    try:
        while True:
            message = await messages.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], tuple(message.get("headers", ())))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        await task
    finally:
        disconnected.set()  # the reader is gone (or done): a streaming handler sees its client leave
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(task, timeout=10.0)

"""``--max-request-bytes``: a body larger than the limit is answered 413 before it is parsed.

A pure ASGI middleware: it buffers the body (FastAPI reads it whole anyway) while counting, so a client
that sends no ``Content-Length`` (chunked) is held to the same limit, then replays it to the app; after
the body, messages (such as ``http.disconnect``) pass through untouched.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mmlora.server.errors import error_response


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(int(declared), scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([], message, receive), send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(size, scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(chunks, None, receive), send)

    async def _refuse(self, size: int, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(
            413,
            f"the request body has {size} bytes or more, more than --max-request-bytes={self.max_bytes}",
            code="request_too_large",
        )
        await response(scope, receive, send)


def _replay(chunks: list[bytes], pending: Message | None, receive: Receive) -> Receive:
    """A receive() that first gives the buffered body as one message, then defers to ``receive``."""
    first: list[Message] = (
        [pending]
        if pending is not None
        else [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
    )

    async def replayed() -> Message:
        if first:
            return first.pop()
        return await receive()

    return replayed

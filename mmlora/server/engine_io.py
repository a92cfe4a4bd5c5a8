"""From HTTP handlers to the background engine and back: submit, await or stream, abort on disconnect.

Shared by the native and the OpenAI endpoints. A request is aborted in the engine as soon as its client
goes away (the watcher below for plain answers; Starlette cancels streaming generators itself).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from mmlora.engine.background import BackgroundEngine
from mmlora.engine.request_handle import RequestHandle
from mmlora.engine.sampling_params import RequestOutput, SamplingParams
from mmlora.server.errors import APIError, to_api_error


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready."""


def parse_sampling(value: dict[str, Any] | None, *, param: str = "sampling_params") -> SamplingParams:
    try:
        return SamplingParams.from_any(value)
    except ValueError as e:
        message = str(e)
        field = message.partition(":")[0]  # "sampling_params.top_p: must be ..." names the field
        raise APIError(400, message, param=field if field.startswith(param + ".") else param) from None


async def submit(bg: BackgroundEngine, items: list[dict[str, Any]]) -> list[RequestHandle]:
    """Submit all or none; engine errors become API errors (ValueError -> 400, full -> 429, ...)."""
    try:
        return await bg.submit_many_async(items)
    except Exception as e:
        raise to_api_error(e) from None


async def _wait_disconnect(request: Request) -> None:
    # After the body was read, the next ASGI message is http.disconnect when the client goes away.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(request: Request, handles: list[RequestHandle]) -> list[RequestOutput]:
    """Await every handle's final output; abort them all if the client disconnects first."""
    results = asyncio.ensure_future(asyncio.gather(*(h.result_async() for h in handles)))
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({results, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if results in done:
            return results.result()
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        if not results.done():
            results.cancel()
        # Read the outcome even when nobody waits for it any more: else asyncio logs
        # "_GatheringFuture exception was never retrieved" when a client goes away.
        results.add_done_callback(_retrieve)
        abort_unfinished(handles)


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


def abort_unfinished(handles: list[RequestHandle]) -> None:
    for handle in handles:
        if not handle.finished:
            handle.abort()


async def merge(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield ``(index, increment)`` from several handles as they arrive, until all have finished.

    Unfinished requests are aborted when the consumer stops early (client gone, generator closed).
    """
    try:
        if len(handles) == 1:
            async for out in handles[0]:
                yield 0, out
            return
        queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

        async def pump(i: int, handle: RequestHandle) -> None:
            async for out in handle:
                await queue.put((i, out))

        tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
        try:
            remaining = len(handles)
            while remaining:
                i, out = await queue.get()
                yield i, out
                if out.finished:
                    remaining -= 1
        finally:
            for task in tasks:
                task.cancel()
    finally:
        abort_unfinished(handles)


def check_failures(outputs: list[RequestOutput]) -> None:
    """An aborted request is answered with an error, never passed off as a normal completion."""
    for out in outputs:
        if out.finish_reason == "abort":
            raise failure_error(out)


def failure_error(out: RequestOutput) -> APIError:
    if out.error:
        status = 500 if out.error.startswith("internal error") else 400
        return APIError(status, f"request {out.request_id}: {out.error}")
    return APIError(503, f"request {out.request_id} was aborted (server shutting down or cancelled)")


def sse(payload: Any) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class TokenText:
    """Token id -> its text, for logprob answers (cached; the tokenizer's decode is read-only)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            if len(self._cache) < 200_000:
                self._cache[token_id] = text
        return text

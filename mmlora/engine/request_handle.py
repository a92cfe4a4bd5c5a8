"""The stream of one request's outputs, between the engine thread that fills it and any thread or asyncio
loop that reads it.

Iterate a ``RequestHandle`` synchronously (``for out in handle``) or from an asyncio loop (``async for out
in handle``); each item is a ``RequestOutput`` snapshot whose ``delta_text``/``delta_ids`` hold what
arrived since the previous item (increments that pile up before the consumer reads them are merged into
one), and the last item has ``finish_reason`` set.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

from mmlora.engine.sampling_params import RequestOutput

if TYPE_CHECKING:
    from mmlora.engine.background import BackgroundEngine


class RequestHandle:
    """The stream of one request's outputs, filled by the engine thread, read by any thread or loop."""

    def __init__(self, request_id: str, owner: BackgroundEngine) -> None:
        self.request_id = request_id
        self.submit_time = time.monotonic()  # the engine's clock
        self._owner = owner
        self._cond = threading.Condition()
        self._items: collections.deque[RequestOutput] = collections.deque()
        self._final: RequestOutput | None = None
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._sent_text = 0  # text characters already delivered (engine thread only)

    # -- producer side (engine thread) --
    def _fix_delta(self, out: RequestOutput) -> None:
        """Guarantee that the text deltas a consumer reads add up exactly to the final text.

        (Ids need nothing here: every output of a request reaches its handle, in order, so the engine's
        ``delta_ids`` already add up.) Text may be held back while running (a partial character, a
        possible stop-string prefix): the engine's text delta is used then, and the final output
        carries whatever was not yet delivered.
        """
        if out.finished:
            out.delta_text = out.text[self._sent_text :]
        self._sent_text += len(out.delta_text)

    def _push(self, out: RequestOutput) -> None:
        with self._cond:
            if self._final is not None:
                return
            if self._items and not self._items[-1].finished:
                # Merge with the unread previous increment: the queue never holds more than one
                # unread snapshot, so a slow (or absent) consumer costs no memory per step.
                prev = self._items.pop()
                out.delta_text = prev.delta_text + out.delta_text
                out.delta_ids = prev.delta_ids + out.delta_ids
            self._items.append(out)
            if out.finished:
                self._final = out
            self._cond.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits there any more
                loop.call_soon_threadsafe(_resolve, fut)

    # -- consumer side --
    @property
    def finished(self) -> bool:
        return self._final is not None

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            with self._cond:
                while not self._items:
                    self._cond.wait()
                out = self._items.popleft()
            yield out
            if out.finished:
                return

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                out = self._items.popleft() if self._items else None
                if out is None:
                    fut = loop.create_future()
                    self._waiters.append((loop, fut))
            if out is None:
                await fut
                continue
            yield out
            if out.finished:
                return

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Block until the request finishes and return its final (cumulative) output."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._final is not None, timeout):
                raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
            assert self._final is not None
            return self._final

    async def result_async(self) -> RequestOutput:
        """Await the final output from an asyncio loop."""
        last = None
        async for out in self:
            last = out
        assert last is not None
        return last

    def abort(self) -> None:
        self._owner.abort(self.request_id)


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def snapshot(out: RequestOutput) -> RequestOutput:
    """A copy the consumer may keep: the engine may mutate its own object and lists on later steps."""
    snap = copy.copy(out)
    snap.output_ids = list(out.output_ids)
    snap.delta_ids = list(out.delta_ids)
    if out.logprobs is not None:
        snap.logprobs = list(out.logprobs)
    if out.top_logprobs is not None:
        snap.top_logprobs = list(out.top_logprobs)
    return snap

"""Run an ``Engine`` on one background thread and share it safely between threads and asyncio loops.

The ``Engine`` is single-threaded by contract. ``BackgroundEngine`` owns it on one thread that runs the
step loop (sleeping on a condition variable while idle) and executes every other engine call sent to it
(``submit``, ``abort``, ``run``), so callers on any thread or event loop never touch the engine directly.
It knows nothing about HTTP or a UI: the server and the Gradio app both build on it.

A :class:`~mmlora.engine.request_handle.RequestHandle` receives each request's increments.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import inspect
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from mmlora.engine.request_handle import RequestHandle, snapshot
from mmlora.engine.sampling_params import RequestOutput

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineUnavailableError(RuntimeError):
    """The engine takes no new requests: it is draining for shutdown or stopped."""


class QueueFullError(RuntimeError):
    """More requests are in flight than the configured limit allows; retry later."""


class BackgroundEngine:
    """Own ``engine`` on a daemon thread; every public method is thread-safe.

    ``max_in_flight`` bounds requests submitted and not yet finished (None: no bound); beyond it
    ``submit`` raises ``QueueFullError`` at once instead of letting callers stall.
    """

    def __init__(self, engine: Any, *, max_in_flight: int | None = None, name: str = "mmlora-engine") -> None:
        self.engine = engine
        # What submit accepts: exactly the engine's add_request keywords.
        self._add_request_keys = frozenset(inspect.signature(engine.add_request).parameters)
        self.max_in_flight = max_in_flight
        self._cond = threading.Condition()
        self._commands: collections.deque[tuple[Callable[[Any], Any], concurrent.futures.Future]] = (
            collections.deque()
        )
        self._handles: dict[str, RequestHandle] = {}  # touched only on the engine thread
        self._in_flight = 0  # submitted (maybe not yet added) and not finished; guarded by _cond
        self._accepting = True
        self._stop = False
        self._listeners: list[Callable[[RequestOutput, float], None]] = []
        self._consecutive_step_failures = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # ---- public API -----------------------------------------------------------------------------
    @property
    def accepting(self) -> bool:
        """False once ``stop_intake`` or ``shutdown`` was called."""
        return self._accepting

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    def add_listener(self, fn: Callable[[RequestOutput, float], None]) -> None:
        """Call ``fn(output, time.monotonic())`` on the engine thread for every output (metrics, logs).

        ``fn`` must be quick and must not call back into this object; its exceptions are logged.
        """
        self._listeners.append(fn)

    def submit(self, prompt: str | None = None, **kwargs: Any) -> RequestHandle:
        """Add one request (``Engine.add_request``'s arguments); its validation errors raise here."""
        return self.submit_many([{"prompt": prompt, **kwargs}])[0]

    def submit_many(self, requests: list[dict[str, Any]]) -> list[RequestHandle]:
        """Add several requests atomically: if one is refused, none is started, and the error raises."""
        return self._reserve_and_call(requests).result()

    async def submit_async(self, prompt: str | None = None, **kwargs: Any) -> RequestHandle:
        return (await self.submit_many_async([{"prompt": prompt, **kwargs}]))[0]

    async def submit_many_async(self, requests: list[dict[str, Any]]) -> list[RequestHandle]:
        """``submit_many`` for asyncio: the loop is not blocked while the engine thread is busy."""
        cf = self._reserve_and_call(requests)
        try:
            return await asyncio.shield(asyncio.wrap_future(cf))
        except asyncio.CancelledError:
            # The caller went away while waiting: whatever was added must not run unobserved.
            cf.add_done_callback(self._abort_result)
            raise

    def abort(self, request_id: str) -> None:
        """Finish the request with ``finish_reason="abort"`` at the engine's next step (no-op if unknown)."""
        self._call(lambda eng: self._abort_now(request_id))

    def run(self, fn: Callable[[Any], T], timeout: float | None = None) -> T:
        """Execute ``fn(engine)`` on the engine thread between steps and return its result (or raise)."""
        return self._call(fn).result(timeout)

    async def run_async(self, fn: Callable[[Any], T]) -> T:
        return await asyncio.wrap_future(self._call(fn))

    def stop_intake(self) -> None:
        """Refuse new requests (``EngineUnavailableError``); running ones continue."""
        with self._cond:
            self._accepting = False

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no request is in flight; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._in_flight == 0, timeout)

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop intake; with ``drain`` let in-flight requests finish, else abort them; stop the thread."""
        self.stop_intake()
        if not self._thread.is_alive():
            return
        if not drain:
            self._call(lambda eng: [self._abort_now(rid) for rid in list(self._handles)])
        if not self.wait_idle(timeout):
            logger.warning(
                "shutdown: %d request(s) still in flight after %s s; aborting", self._in_flight, timeout
            )
            self._call(lambda eng: [self._abort_now(rid) for rid in list(self._handles)])
            self.wait_idle(5.0)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout)

    # ---- caller side helpers --------------------------------------------------------------------
    def _call(self, fn: Callable[[Any], T]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stop or not self._thread.is_alive():
                raise EngineUnavailableError("the engine thread has stopped")
            self._commands.append((fn, fut))
            self._cond.notify_all()
        return fut

    def _reserve_and_call(self, requests: list[dict[str, Any]]) -> concurrent.futures.Future:
        for kwargs in requests:
            unknown = set(kwargs) - self._add_request_keys
            if unknown:
                raise TypeError(f"submit: unknown argument(s) {sorted(unknown)}")
        n = len(requests)
        with self._cond:
            if not self._accepting:
                raise EngineUnavailableError("the server is shutting down and takes no new requests")
            if self.max_in_flight is not None and self._in_flight + n > self.max_in_flight:
                raise QueueFullError(
                    f"too many requests in flight ({self._in_flight} of {self.max_in_flight}); retry later"
                )
            self._in_flight += n
        try:
            return self._call(lambda eng: self._add_all(requests))
        except BaseException:
            self._release(n)
            raise

    def _release(self, n: int) -> None:
        with self._cond:
            self._in_flight -= n
            self._cond.notify_all()

    def _abort_result(self, cf: concurrent.futures.Future) -> None:
        if not cf.cancelled() and cf.exception() is None:
            for handle in cf.result():
                self.abort(handle.request_id)

    # ---- engine thread --------------------------------------------------------------------------
    def _add_all(self, requests: list[dict[str, Any]]) -> list[RequestHandle]:
        added: list[str] = []
        try:
            for kwargs in requests:
                rid = kwargs.get("request_id")
                if rid is not None and rid in self._handles:
                    raise ValueError(f"rid: request id {rid!r} is already in use")
                kwargs = {k: v for k, v in kwargs.items() if v is not None}
                rid = self.engine.add_request(**kwargs)
                added.append(rid)
                self._handles[rid] = RequestHandle(rid, self)
        except BaseException:
            for rid in added:
                self._handles.pop(rid, None)
                self._engine_abort(rid)
            self._release(len(requests))
            raise
        return [self._handles[rid] for rid in added]

    def _abort_now(self, request_id: str) -> None:
        if request_id in self._handles:
            self._engine_abort(request_id)

    def _engine_abort(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:  # an unknown or already finished id is not an error for the caller
            logger.debug("abort of %s failed", request_id, exc_info=True)

    def _busy(self) -> bool:
        return bool(self._handles) or self.engine.has_unfinished()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._commands and not self._stop and not self._busy():
                    self._cond.wait()
                commands = list(self._commands)
                self._commands.clear()
                stop = self._stop and not self._commands
            for fn, fut in commands:
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as e:  # delivered to the caller, never kills the loop
                    fut.set_exception(e)
            if self._busy():
                self._step()
            elif stop:
                return

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
            self._consecutive_step_failures = 0
        except Exception as e:
            self._step_failed(e)
            return
        now = time.monotonic()
        for out in outputs:
            handle = self._handles.get(out.request_id)
            if handle is None:
                continue  # aborted during a failed submit, or added by someone else
            try:
                self._deliver(handle, out, now)
            except Exception as e:  # a bad output fails its own request, never the loop
                logger.exception("delivering an output of %s failed", out.request_id)
                self._fail(handle, f"internal error: {type(e).__name__}: {e}")

    def _deliver(self, handle: RequestHandle, out: RequestOutput, now: float) -> None:
        snap = snapshot(out)
        handle._fix_delta(snap)
        self._notify(snap, now)
        handle._push(snap)
        if snap.finished:
            del self._handles[handle.request_id]
            self._release(1)

    def _notify(self, out: RequestOutput, now: float) -> None:
        for fn in self._listeners:
            try:
                fn(out, now)
            except Exception:
                logger.exception("output listener failed")

    def _fail(self, handle: RequestHandle, message: str) -> None:
        """Finish ``handle`` with an abort carrying ``message`` and stop its request in the engine."""
        self._engine_abort(handle.request_id)
        out = RequestOutput(
            request_id=handle.request_id,
            prompt_tokens=0,
            lora_name=None,
            finish_reason="abort",
            error=message,
            arrival_time=handle.submit_time,
            finish_time=time.monotonic(),
        )
        self._notify(out, time.monotonic())  # a failed request is counted like any other that ends
        handle._push(out)
        if self._handles.pop(handle.request_id, None) is not None:
            self._release(1)

    def _step_failed(self, error: Exception) -> None:
        """A step raised: fail the requests it was running (we cannot tell which one is to blame)."""
        logger.exception("engine step failed; aborting %d in-flight request(s)", len(self._handles))
        self._consecutive_step_failures += 1
        for handle in list(self._handles.values()):
            self._fail(handle, f"internal error: {type(error).__name__}: {error}")
        if self._consecutive_step_failures > 1:
            # The engine keeps failing with nothing of ours left: back off instead of spinning.
            time.sleep(min(1.0, 0.01 * 2**self._consecutive_step_failures))

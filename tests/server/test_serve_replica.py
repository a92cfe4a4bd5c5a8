"""A Ray Serve replica's adapter residency without Ray: Ray's multiplexer may evict an adapter that a call has
just made resident (more adapters wanted at once than its cache holds, as after a replica dies and its
calls are retried on the other). The unload must wait for that call, which the engine would otherwise
refuse as "being unloaded" (seen in CI: a 404 in ``test_killing_a_replica_loses_no_unanswered_request``).

The replica runs with stand-ins: an engine that records loads and unloads, an LRU cache of one adapter in
place of Ray's multiplexer, and an ASGI app that answers 200 only if the call's adapter is still registered
when its request reaches the engine (after the test lets it go on).
"""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("ray")

from mmlora.lora.paths import ADAPTER_FILES  # noqa: E402
from mmlora.serve.asgi_bridge import HTTPCall, ResponseStart  # noqa: E402
from mmlora.serve.replica import EngineReplica, ResidentAdapter  # noqa: E402


class FakeEngine:
    def __init__(self) -> None:
        self.registered: set[str] = set()
        self.events: list[tuple[str, str]] = []

    def load_lora(self, name: str, path: str) -> None:
        self.registered.add(name)
        self.events.append(("load", name))

    def unload_lora(self, name: str) -> None:
        self.registered.discard(name)
        self.events.append(("unload", name))

    def list_loras(self) -> list[dict]:
        return [{"name": n} for n in sorted(self.registered)]


class FakeBackground:
    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine

    async def run_async(self, fn):  # noqa: ANN001, ANN201
        return fn(self.engine)

    def shutdown(self, drain: bool, timeout: float) -> None:
        pass


class Replica(EngineReplica):
    """The replica's own logic over the stand-ins; ``get_adapter`` is an LRU of one, as Ray's multiplexer
    with ``max_num_models_per_replica=1`` (eviction awaits the resident adapter's ``__del__``)."""

    def __init__(self, tmp_path) -> None:  # noqa: ANN001
        self.engine = FakeEngine()
        self.bg = FakeBackground(self.engine)
        self.preloaded: set[str] = set()
        self.lora_root = str(tmp_path)
        self.replica_id = b"test"
        self.adapter_loads = 0
        self._init_claims()
        self.cache: dict[str, ResidentAdapter] = {}
        self.gates: dict[str, asyncio.Event] = {}
        self.app = self._app

    async def get_adapter(self, name: str) -> ResidentAdapter:
        if name not in self.cache:
            for old in list(self.cache):
                await self.cache.pop(old).__del__()
            self.cache[name] = await self.load(name)
        return self.cache[name]

    async def _app(self, scope, receive, send) -> None:  # noqa: ANN001
        body = json.loads((await receive())["body"])
        name = body["lora_path"]
        await self.gates.setdefault(name, asyncio.Event()).wait()  # the request reaches the engine later
        status = 200 if name in self.engine.registered else 404
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": name.encode(), "more_body": False})


def _adapter_folders(root) -> None:  # noqa: ANN001
    """Folders the replica's path check accepts (the stand-in engine reads nothing in them)."""
    for name in ("a1", "a2"):
        (root / name).mkdir()
        for file in ADAPTER_FILES:
            (root / name / file).write_text("{}")


async def _answer(replica: Replica, name: str) -> int:
    call = HTTPCall("POST", "/generate", b"", (), json.dumps({"lora_path": name}).encode())
    status = None
    async for message in replica.handle(call, [name]):
        if isinstance(message, ResponseStart):
            status = message.status
    return status


def test_an_adapter_evicted_under_a_call_is_unloaded_after_it(tmp_path) -> None:  # noqa: ANN001
    _adapter_folders(tmp_path)

    async def scenario() -> None:
        replica = Replica(tmp_path)
        first = asyncio.create_task(_answer(replica, "a1"))
        await asyncio.sleep(0.05)  # a1 resident, its request not yet in the engine
        second = asyncio.create_task(_answer(replica, "a2"))  # evicts a1 from the cache of one
        await asyncio.sleep(0.05)
        assert "a1" in replica.engine.registered, "a1 was unloaded under its own call"
        replica.gates.setdefault("a1", asyncio.Event()).set()
        assert await first == 200
        assert ("unload", "a1") in replica.engine.events  # once its call ended
        replica.gates.setdefault("a2", asyncio.Event()).set()
        assert await second == 200

    asyncio.run(scenario())


def test_an_evicted_adapter_asked_for_again_is_not_reloaded(tmp_path) -> None:  # noqa: ANN001
    _adapter_folders(tmp_path)

    async def scenario() -> None:
        replica = Replica(tmp_path)
        first = asyncio.create_task(_answer(replica, "a1"))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(_answer(replica, "a2"))  # evicts a1 (deferred: a1's call runs)
        await asyncio.sleep(0.05)
        third = asyncio.create_task(_answer(replica, "a1"))  # back in the cache: the deferral is called off
        await asyncio.sleep(0.05)
        for name in ("a1", "a2"):
            replica.gates.setdefault(name, asyncio.Event()).set()
        assert await asyncio.gather(first, second, third) == [200, 200, 200]
        assert replica.engine.events.count(("load", "a1")) == 1
        # a2 was evicted by the third call while its own call ran: unloaded when that call ended
        assert replica.engine.events[-1] == ("unload", "a2")
        assert "a1" in replica.engine.registered

    asyncio.run(scenario())

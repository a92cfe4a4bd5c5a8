"""One Ray Serve replica: one mmlora engine behind the very same FastAPI app as ``launch_server``.

Adapters are Ray Serve's multiplexed models. The replica's multiplexed loader is mmlora's adapter load
(from ``--lora-root``), and Ray's per-replica model cache is sized to the engine's host cache
(``max_loaded_loras``), so Ray's LRU eviction is the engine's: an evicted adapter is unloaded (after its
in-flight requests end, by the engine's unload rule). Ray then routes requests for an adapter to a
replica that already holds it. Adapters given at start-up (``--lora-paths``) stay on every replica and
are never evicted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from mmlora.config import EngineConfig
from mmlora.lora.paths import confine_adapter_path
from mmlora.serve.asgi_bridge import HTTPCall, ResponseStart, call_asgi
from mmlora.server.config import ServerConfig

logger = logging.getLogger(__name__)

REPLICA_HEADER = b"x-mmlora-replica"
_UNLOAD_WAIT_S = 30.0


class ResidentAdapter:
    """What Ray's multiplexer caches for an adapter; evicting it unloads the adapter from the engine."""

    def __init__(self, replica: EngineReplica, name: str, owned: bool) -> None:
        self.replica, self.name, self.owned = replica, name, owned

    async def __del__(self) -> None:  # called (and awaited) by Ray's multiplexer on LRU eviction
        if self.owned:
            await self.replica.evict(self.name)


class EngineReplica:
    """Build with ``replica_deployment(max_adapters)``; the class itself is plain and testable."""

    def __init__(
        self, engine_config: EngineConfig, server_config: ServerConfig, lora_root: str | None
    ) -> None:
        from mmlora import Engine
        from mmlora.engine.background import BackgroundEngine
        from mmlora.server.app import build_app

        engine = Engine(config=engine_config)
        self.preloaded = {a["name"] for a in engine.list_loras()}
        self.bg = BackgroundEngine(engine)
        self.app = build_app(self.bg, server_config)
        self.lora_root = lora_root
        self.replica_id = _replica_id()
        self.adapter_loads = 0
        self._init_claims()

    def _init_claims(self) -> None:
        # Per adapter, the calls between making it resident and the end of their answer. Ray's LRU may evict
        # an adapter such a call has just made resident (more adapters wanted at once than the cache holds,
        # as after a replica dies and its calls are retried here): its unload then waits for those calls,
        # which would otherwise be refused with "being unloaded" before their requests reach the engine.
        self._claims: dict[str, int] = {}
        self._evicted: set[str] = set()  # evicted by Ray, unload deferred, still registered in the engine

    async def load(self, name: str) -> ResidentAdapter:
        """Make ``name`` servable here: a start-up adapter as is, else read from the adapter root."""
        if name in self.preloaded:
            return ResidentAdapter(self, name, owned=False)
        if name in self._evicted:  # its deferred unload is called off: it never left the engine
            self._evicted.discard(name)
            return ResidentAdapter(self, name, owned=True)
        path = confine_adapter_path(name, self.lora_root, param="model")
        await self._wait_unloaded(name)
        await self.bg.run_async(lambda eng: eng.load_lora(name, path))
        self.adapter_loads += 1
        return ResidentAdapter(self, name, owned=True)

    async def evict(self, name: str) -> None:
        """Ray's multiplexer dropped ``name``: unload it now, or once the calls that claimed it end."""
        if self._claims.get(name):
            self._evicted.add(name)
        else:
            await self.unload(name)

    async def unload(self, name: str) -> None:
        from mmlora.engine.background import EngineUnavailableError

        try:
            await self.bg.run_async(lambda eng: eng.unload_lora(name))
        except (ValueError, EngineUnavailableError) as e:  # already gone, or the replica is stopping
            logger.debug("adapter %s not unloaded: %s", name, e)

    async def _wait_unloaded(self, name: str) -> None:
        """An adapter evicted a moment ago may still finish requests: loading it again waits (bounded)."""
        deadline = asyncio.get_running_loop().time() + _UNLOAD_WAIT_S
        while any(a["name"] == name for a in await self.bg.run_async(lambda eng: eng.list_loras())):
            if asyncio.get_running_loop().time() > deadline:
                raise ValueError(f"model: adapter {name!r} is still being unloaded; try again")
            await asyncio.sleep(0.05)

    async def handle(self, call: HTTPCall, adapters: list[str]) -> AsyncIterator[ResponseStart | bytes]:
        """Answer one HTTP call with this replica's app, after making its adapters resident.

        An adapter that cannot be loaded (unknown, outside the root) is left to the app, whose answer
        names the problem (404 with the known names) exactly as the single-process server's does.
        """
        for name in adapters:
            self._claims[name] = self._claims.get(name, 0) + 1
        try:
            for name in adapters:
                try:
                    await self.get_adapter(name)
                except ValueError as e:
                    logger.info("adapter %s not made resident: %s", name, e)
            async for message in call_asgi(self.app, call):
                if isinstance(message, ResponseStart):
                    message = ResponseStart(
                        message.status, message.headers + ((REPLICA_HEADER, self.replica_id),)
                    )
                yield message
        finally:
            for name in adapters:
                self._claims[name] -= 1
                if self._claims[name] == 0:
                    del self._claims[name]
                    if name in self._evicted:
                        self._evicted.discard(name)
                        await self.unload(name)

    def served_name(self) -> str:
        return str(self.bg.engine.model_name)

    async def stats(self) -> dict[str, Any]:
        """Residency and load counts, for the cluster benchmark and the tests."""
        adapters = await self.bg.run_async(lambda eng: eng.list_loras())
        return {
            "replica": self.replica_id.decode(),
            "adapter_loads": self.adapter_loads,
            "adapters": adapters,
        }

    def __del__(self) -> None:
        bg = getattr(self, "bg", None)
        if bg is not None:
            bg.shutdown(drain=False, timeout=5.0)


def _replica_id() -> bytes:
    try:
        return serve.get_replica_context().replica_id.unique_id.encode()
    except Exception:  # outside a Ray Serve replica (unit tests): a stable local name
        return b"local"


def replica_deployment(max_adapters: int, num_replicas: int, num_cpus: float, num_gpus: float) -> Any:
    """The Ray Serve deployment of ``EngineReplica`` with a multiplexed adapter cache of ``max_adapters``."""

    class MultiplexedEngineReplica(EngineReplica):
        @serve.multiplexed(max_num_models_per_replica=max_adapters)
        async def get_adapter(self, name: str) -> ResidentAdapter:
            return await self.load(name)

    return serve.deployment(
        MultiplexedEngineReplica,
        name="mmlora-replica",
        num_replicas=num_replicas,
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
        max_ongoing_requests=1024,
    )

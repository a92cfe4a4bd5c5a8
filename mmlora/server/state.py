"""What every handler needs, kept on ``app.state.mmlora``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from mmlora.engine.background import BackgroundEngine
from mmlora.lora.refs import AdapterRef
from mmlora.server.config import ServerConfig
from mmlora.server.engine_io import TokenText
from mmlora.server.errors import APIError
from mmlora.server.metrics import ServerMetrics
from mmlora.server.preprocess import Preprocessor


@dataclass
class ServerState:
    bg: BackgroundEngine
    config: ServerConfig
    served_name: str
    token_text: TokenText
    metrics: ServerMetrics
    preprocess: Preprocessor
    started: float = field(default_factory=time.time)

    @property
    def engine(self) -> Any:
        """For read-only facts (tokenizer, is_multimodal, max_model_len); calls go through ``bg``."""
        return self.bg.engine

    def adapter(
        self, key: Any, *, param: str = "lora_path", same_as: tuple[str, str] | None = None
    ) -> AdapterRef | None:
        """The adapter a request names (None or "": the base model), for the engine to resolve once when
        it adds the request: a registered name or path, or (with --enable-lora-runtime-update only) a
        folder confined to --lora-root. Unknown names are answered 404 (see errors.to_api_error)."""
        if key is None or key == "":
            return None
        if not isinstance(key, str):
            raise APIError(400, f"{param}: expected a string or null, got {type(key).__name__}", param=param)
        return AdapterRef(
            key,
            param,
            allow_folders=self.config.enable_lora_runtime_update,
            confine=True,
            lora_root=self.config.lora_root,
            same_as=same_as,
        )

    async def loras(self) -> list[dict[str, Any]]:
        """The engine's adapters (``Engine.list_loras``), read on the engine thread."""
        return await self.bg.run_async(lambda eng: list(eng.list_loras()))

    async def adapter_names(self) -> list[str]:
        """Adapters that take requests (those being unloaded are left out)."""
        return [info["name"] for info in await self.loras() if not info["unloading"]]

"""What every handler needs, kept on ``app.state.mmlora``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from mmlora.engine.background import BackgroundEngine
from mmlora.server.adapters import AdapterDirectory
from mmlora.server.config import ServerConfig
from mmlora.server.engine_io import TokenText
from mmlora.server.metrics import ServerMetrics
from mmlora.server.preprocess import Preprocessor


@dataclass
class ServerState:
    bg: BackgroundEngine
    config: ServerConfig
    served_name: str
    adapters: AdapterDirectory
    token_text: TokenText
    metrics: ServerMetrics
    preprocess: Preprocessor
    started: float = field(default_factory=time.time)

    @property
    def engine(self) -> Any:
        """For read-only facts (tokenizer, is_multimodal, max_model_len); calls go through ``bg``."""
        return self.bg.engine

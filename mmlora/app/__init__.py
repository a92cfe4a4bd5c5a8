"""The Gradio app: ``AppController`` (what it does), ``build_ui`` (the page), ``cli`` (``python app.py``).

``build_ui`` needs gradio (``pip install 'mmlora[app]'``); the controller and stats do not.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BASE": "controller",
    "MAX_COMPARE": "controller",
    "AppController": "controller",
    "StreamView": "controller",
    "make_sampling": "controller",
    "StatsMonitor": "stats",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    # Imported on first use: ``python app.py`` checks its options (mmlora.app.cli) before torch loads.
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mmlora.app' has no attribute {name!r}")
    return getattr(importlib.import_module(f"mmlora.app.{_EXPORTS[name]}"), name)

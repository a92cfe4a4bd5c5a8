"""The Gradio app: ``AppController`` (what it does), ``build_ui`` (the page), ``cli`` (``python app.py``).

``build_ui`` needs gradio (``pip install 'mmlora[app]'``); the controller and stats do not.
"""

from mmlora.app.controller import BASE, MAX_COMPARE, AppController, StreamView, make_sampling
from mmlora.app.stats import StatsMonitor

__all__ = ["BASE", "MAX_COMPARE", "AppController", "StatsMonitor", "StreamView", "make_sampling"]

"""``build_app(bg, server_config)``: the FastAPI application over a ``BackgroundEngine``."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from mmlora.engine.background import BackgroundEngine
from mmlora.server import admin, native, openai_api, residency
from mmlora.server.body_limit import BodyLimit
from mmlora.server.config import ServerConfig
from mmlora.server.engine_io import ClientDisconnected, TokenText
from mmlora.server.errors import APIKeyMiddleware, error_response, install_error_handlers
from mmlora.server.metrics import ServerMetrics
from mmlora.server.preprocess import Preprocessor
from mmlora.server.state import ServerState

logger = logging.getLogger(__name__)


def build_app(bg: BackgroundEngine, server_config: ServerConfig | None = None) -> FastAPI:
    """Create the app. The caller owns ``bg`` (and shuts it down); the app never stops the engine.

    Endpoints: ``POST /generate`` (SGLang), ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``
    (OpenAI), ``/load_lora_adapter``, ``/unload_lora_adapter``, ``/health``, ``/health_generate``,
    ``/get_model_info``, ``/metrics``.
    """
    config = server_config or ServerConfig()
    engine = bg.engine
    served_name = str(engine.model_name)
    if bg.max_in_flight is None:
        bg.max_in_flight = config.max_in_flight_requests or _default_in_flight_limit(engine)
    state = ServerState(
        bg=bg,
        config=config,
        served_name=served_name,
        token_text=TokenText(engine.tokenizer),
        metrics=ServerMetrics(bg, served_name, config.max_adapter_metric_labels),
        preprocess=Preprocessor(engine, config),
    )
    app = FastAPI(title="mmlora", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.mmlora = state
    install_error_handlers(app)

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; the engine request is already aborted

    for module in (native, openai_api, admin, residency):
        app.include_router(module.router)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)
    app.add_middleware(IntakeGate, bg=bg)
    if config.api_key:  # added last = runs first: unauthenticated callers learn nothing
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    return app


class IntakeGate:
    """While draining (SIGTERM) new HTTP requests get 503 at once; /metrics stays readable.

    A pure ASGI middleware: it neither buffers streaming answers nor hides client disconnects.
    """

    def __init__(self, app: ASGIApp, bg: BackgroundEngine) -> None:
        self.app = app
        self.bg = bg

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.bg.accepting and scope.get("path") != "/metrics":
            response = error_response(
                503, "the server is shutting down and takes no new requests", code="unavailable"
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _default_in_flight_limit(engine: Any) -> int | None:
    sched = getattr(getattr(engine, "config", None), "scheduler", None)
    if sched is None:
        return None
    return int(sched.max_running_requests) + int(sched.max_queued_requests)

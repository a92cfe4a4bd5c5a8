"""``python -m mmlora.launch_server``: serve a model and its adapters over HTTP.

Flags are generated from the config dataclasses (``mmlora.config`` and ``ServerConfig``), so SGLang's
launch line works as is, e.g.::

    python -m mmlora.launch_server --model-path M --lora-paths name=path /other/adapter \\
        --disable-radix --disable-cuda-graph --max-loras-per-batch 4

An unknown flag is an error. SIGTERM (or Ctrl-C) stops intake at once (new requests get 503), lets the
requests in flight finish (up to ``--drain-timeout`` seconds), then exits.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from mmlora.config import ENGINE_SECTIONS, add_cli_args, engine_config_from_cli, from_cli_args
from mmlora.preflight import check_engine_config, check_port, exit_on_config_error
from mmlora.server.config import ServerConfig

logger = logging.getLogger("mmlora.launch_server")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mmlora.launch_server",
        description="Serve one base model and many LoRA adapters (SGLang /generate and OpenAI /v1 APIs).",
        allow_abbrev=False,
    )
    add_cli_args(parser, *ENGINE_SECTIONS, ServerConfig)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> tuple[Any, ServerConfig]:
    """-> (EngineConfig, ServerConfig); invalid values exit with a usage error naming the option."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return engine_config_from_cli(args), from_cli_args(args, ServerConfig)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits


def _make_server(app: Any, server_config: ServerConfig, bg: Any) -> Any:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """Stop intake before uvicorn starts its graceful shutdown (which waits for open requests)."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            if bg.accepting:
                logger.info("signal %s: refusing new requests, draining %d in flight", sig, bg.num_in_flight)
                bg.stop_intake()
            super().handle_exit(sig, frame)
            # uvicorn re-raises captured signals after its shutdown, which would kill the process
            # before the engine is stopped: a completed drain is a clean exit (status 0) instead.
            self._captured_signals.clear()

    config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        log_level=server_config.log_level.lower(),
        timeout_graceful_shutdown=int(server_config.drain_timeout),
        lifespan="off",
    )
    return DrainingServer(config)


def main(argv: Sequence[str] | None = None) -> int:
    engine_config, server_config = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG
        if server_config.log_level.lower() == "trace"
        else server_config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    exit_on_config_error(check_engine_config, engine_config)  # before anything heavy is imported
    exit_on_config_error(check_port, server_config.host, server_config.port)
    from mmlora import Engine
    from mmlora.engine.background import BackgroundEngine
    from mmlora.engine.setup import freeze_startup_objects
    from mmlora.server.app import build_app

    try:
        engine = Engine(config=engine_config)
    except ValueError as e:
        logger.error("cannot start: %s", e)
        return 2
    num_loras = len(engine.list_loras())  # before the engine thread owns it
    freeze_startup_objects()
    bg = BackgroundEngine(engine)
    app = build_app(bg, server_config)
    server = _make_server(app, server_config, bg)
    logger.info(
        "serving %s with %d adapter(s) on http://%s:%d",
        engine.model_name,
        num_loras,
        server_config.host,
        server_config.port,
    )
    try:
        server.run()
    finally:
        bg.shutdown(drain=True, timeout=server_config.drain_timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Command line of ``python app.py``: engine flags generated from the config dataclasses, plus the app's own.

With no arguments the app serves the default model ("smollm2") with the demo adapters shipped in
``mmlora/assets/adapters``. ``GRADIO_SERVER_NAME`` / ``GRADIO_SERVER_PORT`` apply unless
``--server-name`` / ``--server-port`` are given (Gradio reads them itself).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

from mmlora.config import ENGINE_SECTIONS, EngineConfig, add_cli_args, engine_config_from_cli
from mmlora.preflight import check_engine_config, check_port, exit_on_config_error

logger = logging.getLogger(__name__)

DEMO_ADAPTERS = Path(__file__).resolve().parent.parent / "assets" / "adapters"
DEFAULT_MODEL = "smollm2"


def demo_adapter_specs(folder: Path | None = None) -> list[str]:
    """``["name=path", ...]`` for every PEFT adapter folder directly inside ``folder`` (sorted by name).

    ``folder`` defaults to ``DEMO_ADAPTERS``, the adapters shipped with the package.
    """
    folder = DEMO_ADAPTERS if folder is None else folder
    if not folder.is_dir():
        return []
    return [
        f"{sub.name}={sub}"
        for sub in sorted(folder.iterdir())
        if sub.is_dir() and (sub / "adapter_config.json").is_file()
    ]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="app.py",
        description="Gradio UI over one mmlora engine: chat with any adapter, compare adapters side by side.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_cli_args(parser, *ENGINE_SECTIONS)
    # None means "not given": the default model then gets the demo adapters.
    parser.set_defaults(lora_paths=None)
    app = parser.add_argument_group("app")
    app.add_argument(
        "--lora-root",
        default=".",
        help='Adapters loaded from the UI must lie under this folder; "" disables loading by path.',
    )
    app.add_argument(
        "--share",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Also serve through a public Gradio share link (off: local only).",
    )
    app.add_argument(
        "--server-name", default=None, help="Listen address (default: $GRADIO_SERVER_NAME or 127.0.0.1)."
    )
    app.add_argument(
        "--server-port", type=int, default=None, help="Port (default: $GRADIO_SERVER_PORT or 7860)."
    )
    app.add_argument(
        "--max-in-flight", type=int, default=256, help="Requests in flight beyond which new ones are refused."
    )
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.max_in_flight < 1:
        raise SystemExit("--max-in-flight: must be >= 1")
    return args


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's config from parsed flags; the demo adapters when the default model has none given."""
    if args.lora_paths is None:
        args.lora_paths = demo_adapter_specs() if args.model == DEFAULT_MODEL else []
        if args.model == DEFAULT_MODEL and not args.lora_paths:
            logger.warning("no demo adapters found in %s; serving the base model only", DEMO_ADAPTERS)
    return engine_config_from_cli(args)


def checked_engine_config(args: argparse.Namespace) -> EngineConfig:
    """``engine_config(args)`` with every check that needs no weights, and the port if one is given.

    A mistake exits with one line on stderr and status 2.
    """
    config = exit_on_config_error(engine_config, args)
    exit_on_config_error(check_engine_config, config)
    port = args.server_port or os.environ.get("GRADIO_SERVER_PORT")
    if port:  # without one, Gradio looks for a free port itself
        host = args.server_name or os.environ.get("GRADIO_SERVER_NAME") or "127.0.0.1"
        exit_on_config_error(check_port, host, int(port), option="server_port")
    return config


def build_engine(args: argparse.Namespace, config: EngineConfig | None = None) -> Any:
    """Load the model and start its step loop on a background thread; returns the ``BackgroundEngine``."""
    from mmlora import Engine
    from mmlora.engine.background import BackgroundEngine

    config = engine_config(args) if config is None else config
    logger.info("loading %s with %d adapter(s)…", config.model.model, len(config.lora.lora_paths))
    return BackgroundEngine(Engine(config=config), max_in_flight=args.max_in_flight, name="mmlora-app-engine")


def launch(bg: Any, args: argparse.Namespace, **launch_kwargs: Any) -> Any:
    """Build the page over ``bg`` and serve it (blocks unless ``prevent_thread_lock=True`` is passed).

    Returns the page (``gradio.Blocks``); its ``close()`` stops serving."""
    from mmlora.app.controller import AppController
    from mmlora.app.ui import build_ui

    root = os.path.abspath(args.lora_root) if args.lora_root else None
    demo = build_ui(AppController(bg, lora_root=root))
    demo.queue(default_concurrency_limit=None)
    demo.launch(share=args.share, server_name=args.server_name, server_port=args.server_port, **launch_kwargs)
    return demo

"""Gradio UI for mmlora: ``python app.py`` serves the default model with the demo adapters.

``python app.py --help`` lists the flags (the engine's, generated from its config, and the app's).
"""

import logging
import signal
from typing import Any

from mmlora.app.cli import build_engine, launch, parse_args


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the app like Ctrl+C: the page closes, then the engine


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args()
    bg = build_engine(args)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        launch(bg, args)
    except KeyboardInterrupt:
        pass  # Ctrl+C or SIGTERM, also while Gradio is still starting up: a clean stop either way
    finally:
        bg.shutdown(drain=False, timeout=10)
        logging.getLogger("app").info("stopped")


if __name__ == "__main__":
    main()

"""Gradio UI for mmlora: ``python app.py`` serves the default model with the demo adapters.

``python app.py --help`` lists the flags (the engine's, generated from its config, and the app's).
"""

import logging

from mmlora.app.cli import build_engine, launch, parse_args


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args()
    bg = build_engine(args)
    try:
        launch(bg, args)
    finally:
        bg.shutdown(drain=False, timeout=10)


if __name__ == "__main__":
    main()

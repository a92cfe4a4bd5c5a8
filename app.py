"""Gradio UI for mmlora: ``python app.py`` serves the default model with the demo adapters.

``python app.py --help`` lists the flags (the engine's, generated from its config, and the app's).
A mistake in the flags is one line on stderr and exit status 2, before the model is loaded.
"""

import logging
import os
import signal
import sys
import threading

from mmlora.app.cli import build_engine, checked_engine_config, launch, parse_args
from mmlora.preflight import exit_on_config_error


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args()
    config = checked_engine_config(args)
    # SIGTERM and Ctrl+C set this event; the main thread then closes the page and stops the engine.
    # Gradio's own blocking loop is not used: it turns the signal into a KeyboardInterrupt and waits.
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    # A mistake found only when the engine starts (a hub id that cannot be fetched, a checkpoint that
    # does not fit) is one line and status 2 too, as in launch_server.
    bg = exit_on_config_error(build_engine, args, config)
    demo = None
    try:
        if not stop.is_set():
            demo = launch(bg, args, prevent_thread_lock=True)
        stop.wait()
    finally:
        if demo is not None:
            demo.close()
        bg.shutdown(drain=False, timeout=1)
        logging.getLogger("app").info("stopped")
    # The page and the engine are stopped. Tearing down the interpreter's modules (torch, gradio) would
    # take seconds more and release nothing the system does not: exit now, with what was logged flushed.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

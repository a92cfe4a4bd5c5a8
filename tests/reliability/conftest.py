"""Fixtures of the reliability suite: the server tests' tiny model and adapters, and a live server over
them with run-time adapter updates on (``tests/server/server_fixtures.py``)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "server"))

from server_fixtures import server, tiny  # noqa: E402

__all__ = ["server", "tiny"]

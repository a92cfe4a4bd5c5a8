"""Test-wide setup: the shared helpers in tests/ are importable (``import tiny_models``)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

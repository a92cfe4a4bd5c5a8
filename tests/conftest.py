"""Test-wide setup: the shared helpers in tests/ are importable (``import tiny_models``), and without a
GPU Triton kernels run in the interpreter (it must be set before any kernel is defined)."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

"""``python app.py`` end to end: serves on GRADIO_SERVER_NAME/GRADIO_SERVER_PORT, and stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("gradio", reason="the app needs gradio: pip install gradio")

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_app_py_serves_on_the_gradio_env_port_and_stops_on_sigterm(tiny_app: Any) -> None:
    port = free_port()
    env = {**os.environ, "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port)}
    env["GRADIO_ANALYTICS_ENABLED"] = "False"
    cmd = [
        sys.executable, "app.py", "--model", str(tiny_app.folder), "--device", "cpu", "--dtype", "float32",
        "--lora-paths", f"alpha={tiny_app.adapters['alpha']}", "--max-lora-rank", "8", "--max-kv-tokens", "2048",
        "--lora-root", str(tiny_app.root),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 120
        page = None
        while page is None:
            assert proc.poll() is None, f"app.py exited early:\n{proc.stdout.read()}"
            assert time.monotonic() < deadline, "app.py did not serve within 120 s"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as resp:
                    page = resp.read().decode()
            except OSError:
                time.sleep(0.5)
        assert "mmlora" in page
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "loading " in out and "with 1 adapter(s)" in out and "app: stopped" in out, out
    assert "Traceback" not in out and "Keyboard interruption" not in out, out

"""Image references in requests: data URLs and base64, local files only under the allowed root, no fetch."""

from __future__ import annotations

import base64
import os

import pytest

from mmlora.server.config import ServerConfig
from mmlora.server.errors import APIError
from mmlora.server.media import load_image_bytes

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 2


def refused(ref: str, config: ServerConfig, phrase: str) -> None:
    with pytest.raises(APIError) as e:
        load_image_bytes(ref, config)
    assert e.value.status == 400 and phrase in e.value.message, e.value.message


def test_data_urls_and_bare_base64():
    b64 = base64.b64encode(PNG).decode()
    assert load_image_bytes("data:image/png;base64," + b64, ServerConfig()) == PNG
    assert load_image_bytes(b64, ServerConfig()) == PNG
    refused("data:image/png;base64,@@@@", ServerConfig(), "invalid base64")
    refused("data:image/png,rawbytes", ServerConfig(), "base64 data URLs")


def test_local_files_only_under_the_allowed_root(tmp_path):
    root, outside = tmp_path / "media", tmp_path / "secret"
    root.mkdir()
    outside.mkdir()
    (root / "cat.png").write_bytes(PNG)
    (outside / "key.png").write_bytes(b"secret")
    os.symlink(outside / "key.png", root / "link.png")
    cfg = ServerConfig(allowed_local_media_path=str(root))
    assert load_image_bytes(str(root / "cat.png"), cfg) == PNG
    assert load_image_bytes("cat.png", cfg) == PNG
    assert load_image_bytes(f"file://{root / 'cat.png'}", cfg) == PNG
    refused(str(outside / "key.png"), cfg, "outside")
    refused("../secret/key.png", cfg, "outside")
    refused("link.png", cfg, "outside")
    refused(f"file://{outside / 'key.png'}", cfg, "outside")
    refused("missing.png", cfg, "no such image")
    refused(str(root / "cat.png"), ServerConfig(), "disabled")


def test_remote_urls_are_off_by_default():
    refused("https://example.com/cat.png", ServerConfig(), "--allow-remote-media")
    refused("http://127.0.0.1:1/cat.png", ServerConfig(), "--allow-remote-media")

"""Turn image references from requests into bytes for the engine, without unsafe reads.

Accepted: ``data:image/...;base64,...`` URLs and bare base64 strings; local files (a path or a
``file://`` URL) only under ``--allowed-local-media-path`` (by resolved real path); ``http(s)://`` URLs
only with ``--allow-remote-media``. Everything else is a 400.
"""

from __future__ import annotations

import base64
import binascii
import os
import urllib.parse
import urllib.request

from mmlora.server.config import ServerConfig
from mmlora.server.errors import APIError

MAX_IMAGE_BYTES = 32 * 1024 * 1024
_REMOTE_TIMEOUT_S = 10.0
_B64_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=")


def load_image_bytes(ref: str, config: ServerConfig, *, param: str = "image_url") -> bytes:
    """Resolve one image reference to its encoded bytes (PNG, JPEG, ...), or raise ``APIError(400)``."""
    if not isinstance(ref, str) or not ref:
        raise APIError(400, f"{param}: expected a non-empty string", param=param)
    if ref.startswith("data:"):
        header, sep, payload = ref.partition(",")
        if not sep or ";base64" not in header:
            raise APIError(400, f"{param}: only base64 data URLs are supported", param=param)
        return _b64(payload, param)
    scheme = urllib.parse.urlsplit(ref).scheme.lower()
    if scheme in ("http", "https"):
        if not config.allow_remote_media:
            raise APIError(
                400, f"{param}: remote image URLs are disabled (start with --allow-remote-media)", param=param
            )
        return _fetch(ref, param)
    if scheme == "file":
        return _read_local(urllib.parse.unquote(urllib.parse.urlsplit(ref).path), config, param)
    if len(ref) >= 64 and len(ref) % 4 == 0 and _B64_CHARS.issuperset(ref):
        return _b64(ref, param)  # SGLang also accepts a bare base64 payload (a JPEG's starts with "/9j/")
    if len(ref) < 4096:
        return _read_local(ref, config, param)
    raise APIError(400, f"{param}: not a data URL, base64 image, allowed local path or URL", param=param)


def _b64(payload: str, param: str) -> bytes:
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"{param}: invalid base64 image data", param=param) from None
    if len(data) > MAX_IMAGE_BYTES:
        raise APIError(400, f"{param}: image larger than {MAX_IMAGE_BYTES} bytes", param=param)
    return data


def _read_local(path: str, config: ServerConfig, param: str) -> bytes:
    if not config.allowed_local_media_path:
        raise APIError(
            400, f"{param}: local image files are disabled (see --allowed-local-media-path)", param=param
        )
    root = os.path.realpath(config.allowed_local_media_path)
    real = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([real, root]) != root:
        raise APIError(400, f"{param}: {path!r} is outside the allowed local media path", param=param)
    if not os.path.isfile(real):
        raise APIError(400, f"{param}: no such image file {path!r}", param=param)
    if os.path.getsize(real) > MAX_IMAGE_BYTES:
        raise APIError(400, f"{param}: image larger than {MAX_IMAGE_BYTES} bytes", param=param)
    with open(real, "rb") as fh:
        return fh.read()


def _fetch(url: str, param: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=_REMOTE_TIMEOUT_S) as resp:  # noqa: S310 (opt-in)
            data = resp.read(MAX_IMAGE_BYTES + 1)
    except OSError as e:
        raise APIError(400, f"{param}: could not fetch {url!r}: {e}", param=param) from None
    if len(data) > MAX_IMAGE_BYTES:
        raise APIError(400, f"{param}: image larger than {MAX_IMAGE_BYTES} bytes", param=param)
    return data

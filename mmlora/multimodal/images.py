"""Image inputs -> RGB ``PIL.Image``, decoded defensively.

Accepted: a ``PIL.Image.Image``; encoded bytes (PNG, JPEG, WebP, GIF, BMP, TIFF); a local file path
(``str`` or ``os.PathLike``); a ``data:image/...;base64,...`` URL; a bare base64 string. Encoded data
larger than ``MAX_IMAGE_BYTES`` or images with more than ``MAX_IMAGE_PIXELS`` pixels are refused before
their pixels are decoded (no decompression bombs). Every failure is a ``ValueError`` naming the problem.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from typing import Any

MAX_IMAGE_BYTES = 32 * 1024 * 1024
MAX_IMAGE_PIXELS = 64 * 1024 * 1024
MIN_IMAGE_SIDE = 1
ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
_B64_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=\n\r")


def load_image(image: Any, *, name: str = "image") -> Any:
    """One image input -> an RGB ``PIL.Image.Image`` (a new object; the input is never modified)."""
    from PIL import Image

    if isinstance(image, Image.Image):
        _check_size(image.width, image.height, name)
        return image.convert("RGB")
    if isinstance(image, (bytes, bytearray, memoryview)):
        return decode_image_bytes(bytes(image), name=name)
    if isinstance(image, os.PathLike):
        return _load_path(os.fspath(image), name)
    if isinstance(image, str):
        if not image:
            raise ValueError(f"{name}: empty string")
        if image.startswith("data:"):
            header, sep, payload = image.partition(",")
            if not sep or ";base64" not in header:
                raise ValueError(f"{name}: only base64 data URLs are supported (data:image/...;base64,...)")
            return decode_image_bytes(_b64(payload, name), name=name)
        if len(image) < 4096 and os.path.isfile(image):
            return _load_path(image, name)
        if len(image) >= 64 and _B64_CHARS.issuperset(image):
            return decode_image_bytes(_b64(image, name), name=name)
        raise ValueError(
            f"{name}: {image[:80]!r} is neither an existing file, a data URL nor base64 image data"
        )
    raise ValueError(
        f"{name}: unsupported type {type(image).__name__} (expected PIL.Image, bytes, a path, a data URL or base64)"
    )


def decode_image_bytes(data: bytes, *, name: str = "image") -> Any:
    """Encoded image bytes -> RGB ``PIL.Image``; refuses oversize, corrupt or unsupported data."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ValueError(f"{name}: empty image data")
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"{name}: encoded image is {len(data)} bytes, more than the limit {MAX_IMAGE_BYTES}")
    try:
        img = Image.open(io.BytesIO(data))  # reads the header only
    except UnidentifiedImageError:
        raise ValueError(
            f"{name}: not a recognised image file (supported: {', '.join(ALLOWED_FORMATS)})"
        ) from None
    except Exception as e:  # PIL raises many types on malformed headers
        raise ValueError(f"{name}: cannot read image header: {type(e).__name__}: {e}") from None
    if img.format not in ALLOWED_FORMATS:
        raise ValueError(
            f"{name}: image format {img.format} is not supported (supported: {', '.join(ALLOWED_FORMATS)})"
        )
    _check_size(img.width, img.height, name)
    try:
        img.load()
        return img.convert("RGB")
    except Exception as e:  # truncated or corrupt pixel data
        raise ValueError(f"{name}: corrupt image data ({img.format}): {type(e).__name__}: {e}") from None


def _check_size(width: int, height: int, name: str) -> None:
    if width < MIN_IMAGE_SIDE or height < MIN_IMAGE_SIDE:
        raise ValueError(f"{name}: image has no pixels ({width}x{height})")
    if width * height > MAX_IMAGE_PIXELS:
        raise ValueError(
            f"{name}: image is {width}x{height}, more than the limit of {MAX_IMAGE_PIXELS} pixels"
        )


def _load_path(path: str, name: str) -> Any:
    if not os.path.isfile(path):
        raise ValueError(f"{name}: no such image file {path!r}")
    size = os.path.getsize(path)
    if size > MAX_IMAGE_BYTES:
        raise ValueError(f"{name}: file {path!r} is {size} bytes, more than the limit {MAX_IMAGE_BYTES}")
    with open(path, "rb") as fh:
        return decode_image_bytes(fh.read(), name=name)


def _b64(payload: str, name: str) -> bytes:
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ValueError(f"{name}: base64 image data larger than the limit of {MAX_IMAGE_BYTES} bytes")
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{name}: invalid base64 image data") from None

"""Multimodal request work, out of the model classes: image decoding (``images``), the image processor
(``processor``), prompt expansion (``prompt``), M-RoPE positions (``mrope``) and the per-forward image
features with their lifetime (``features``)."""

from mmlora.multimodal.images import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, decode_image_bytes, load_image

__all__ = ["MAX_IMAGE_BYTES", "MAX_IMAGE_PIXELS", "decode_image_bytes", "load_image"]

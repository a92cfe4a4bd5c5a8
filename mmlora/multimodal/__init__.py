"""Image inputs for vision-language models: defensive decoding (``images``) and preprocessing (``processor``)."""

from mmlora.multimodal.images import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, decode_image_bytes, load_image

__all__ = ["MAX_IMAGE_BYTES", "MAX_IMAGE_PIXELS", "decode_image_bytes", "load_image"]

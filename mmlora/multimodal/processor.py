"""transformers' Qwen2-VL image processor, built locally (no hub): from a checkpoint folder or defaults."""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def _processor_class() -> type:
    # The default Qwen2VLImageProcessor needs torchvision; the PIL backend computes the same pixels.
    if importlib.util.find_spec("torchvision") is not None:
        from transformers import Qwen2VLImageProcessor

        return Qwen2VLImageProcessor
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil


def default_image_processor(vision_config: Any) -> Any:
    """Qwen2-VL's published preprocessing (min 56*56, max 28*28*1280 pixels) with the model's patching."""
    return _processor_class()(
        patch_size=vision_config.patch_size,
        temporal_patch_size=vision_config.temporal_patch_size,
        merge_size=vision_config.spatial_merge_size,
    )


def load_image_processor(folder: str | None, vision_config: Any) -> Any:
    """The image processor saved in ``folder`` (preprocessor_config.json), else the defaults."""
    if folder and any(os.path.isfile(os.path.join(folder, f)) for f in PROCESSOR_FILES):
        from transformers import AutoImageProcessor

        try:
            return AutoImageProcessor.from_pretrained(folder)
        except Exception as e:  # e.g. a torchvision-only processor class on a machine without torchvision
            logger.warning("image processor in %s not loadable (%s); using the PIL backend", folder, e)
            return _processor_class().from_pretrained(folder)
    return default_image_processor(vision_config)

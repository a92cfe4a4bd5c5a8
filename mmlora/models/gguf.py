"""A GGUF file's config, tokenizer and HF-named weights, with its metadata parsed once.

transformers parses a GGUF file's whole metadata (with its GGUFReader, the slow part) once for the
config, again inside ``AutoTokenizer`` and a third time to load the weights. Here the metadata parse
is done once per file and shared: :func:`gguf_metadata` caches transformers' own
``load_gguf_checkpoint(return_tensors=False)`` result, ``AutoConfig`` / ``AutoTokenizer`` get it
through :func:`shared_parse`, and :func:`iter_gguf_weights` reads the tensors through the header alone
(transformers' fast reader: no metadata values) and maps them with transformers' own name map and
tensor processors, so the tensors equal what ``load_gguf_checkpoint(return_tensors=True)`` gives.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

_patch_lock = threading.RLock()


def _transformers_parse(path: str) -> dict:
    from transformers import modeling_gguf_pytorch_utils as legacy

    load = getattr(legacy.load_gguf_checkpoint, "__wrapped__", legacy.load_gguf_checkpoint)
    return load(path, return_tensors=False)


@functools.lru_cache(maxsize=2)
def _cached_parse(path: str, mtime_ns: int) -> dict:
    return _transformers_parse(path)


def gguf_metadata(path: str) -> dict:
    """``load_gguf_checkpoint(path, return_tensors=False)``: config, tokenizer and tokenizer_config dicts."""
    return _cached_parse(os.path.realpath(path), os.stat(path).st_mtime_ns)


@contextlib.contextmanager
def shared_parse() -> Iterator[None]:
    """Within this block, transformers' metadata-only GGUF parses are answered from :func:`gguf_metadata`."""
    from transformers import modeling_gguf_pytorch_utils as legacy

    with _patch_lock:
        original = legacy.load_gguf_checkpoint

        @functools.wraps(original)
        def cached(path: str, return_tensors: bool = False, **kwargs: Any) -> dict:
            if return_tensors or kwargs:
                return original(path, return_tensors=return_tensors, **kwargs)
            return gguf_metadata(path)

        legacy.load_gguf_checkpoint = cached
        try:
            yield
        finally:
            legacy.load_gguf_checkpoint = original


def iter_gguf_weights(path: str, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named float32 CPU tensors of the GGUF file, dequantized one at a time."""
    from gguf import GGMLQuantizationType, dequantize
    from transformers import AutoModelForCausalLM
    from transformers.integrations.gguf import GgufHeader, load_gguf_state_dict
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    parsed = gguf_metadata(path)
    header = GgufHeader.from_file(path)
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(hf_config)
    processor = TENSOR_PROCESSORS.get(header.architecture, TensorProcessor)(config=parsed["config"])
    names = get_gguf_hf_weights_map(meta_model, processor)
    raw = load_gguf_state_dict(header)
    for info in header.tensors:
        qtype = GGMLQuantizationType(info.ggml_type)
        # the raw bytes, rows kept: dequantize views float types and unpacks quantized blocks per row
        data = raw[info.name].data.reshape(*info.shape[:-1], -1)
        result = processor.process(
            weights=dequantize(data, qtype),
            name=info.name,
            tensor_key_mapping=names,
            parsed_parameters=parsed,
        )
        if result.name in names:
            yield names[result.name], torch.from_numpy(np.copy(result.weights))

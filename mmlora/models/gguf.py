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
import copy
import functools
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

_patch_lock = threading.RLock()


# GGUF architectures whose legacy metadata parse is the plain key renaming (no special case in
# ``load_gguf_checkpoint``, which renames llama files named "mistral", rewrites gemma3/t5/lfm2/...),
# and that a test holds equal to it: llama, the architecture of SmolLM2 and most GGUF files. Others
# take the legacy parse.
_PLAIN_ARCHITECTURES = frozenset({"llama"})


def _transformers_parse(path: str) -> dict:
    fast = _header_parse(path)
    if fast is not None:
        return fast
    from transformers import modeling_gguf_pytorch_utils as legacy

    load = getattr(legacy.load_gguf_checkpoint, "__wrapped__", legacy.load_gguf_checkpoint)
    return load(path, return_tensors=False)


def _header_parse(path: str) -> dict | None:
    """The legacy parse's config and tokenizer, read with transformers' fast metadata reader.

    The legacy parse walks every metadata value with gguf's ``GGUFReader`` (5 s for SmolLM2's
    98k-string vocabulary and merges, of an 8 s engine build budget) though transformers now reads the
    tokenizer with its own fast reader. For the plain architectures the config is the legacy key
    renaming (transformers' own ``GGUF_TO_TRANSFORMERS_MAPPING`` and defaults) applied to the fast
    reader's values; ``tests/models/test_gguf_parse.py`` holds it equal to the legacy parse. None when
    this transformers has no fast reader or the file needs a legacy special case.
    """
    try:
        from transformers.integrations.gguf import get_gguf_tokenizer, read_gguf_metadata
        from transformers.modeling_gguf_pytorch_utils import (
            GGUF_CONFIG_DEFAULTS_MAPPING,
            GGUF_TO_TRANSFORMERS_MAPPING,
        )
    except ImportError:
        return None
    metadata, tensor_names = read_gguf_metadata(path)
    arch = metadata["general.architecture"]
    if arch not in _PLAIN_ARCHITECTURES or "mistral" in str(metadata.get("general.name", "")).lower():
        return None
    config: dict[str, Any] = {"tie_word_embeddings": "output.weight" not in tensor_names}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(arch, {}).items():
        config.setdefault(key, value)
    renames = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    for key, value in metadata.items():
        prefix, _, rest = key.partition(".")
        target = renames.get(prefix, {}).get(rest)
        if target is None or target == -1:
            continue
        config[target] = value[0] if isinstance(value, list) and len(value) == 1 else value
    if "vocab_size" not in config:
        config["vocab_size"] = metadata["tokenizer.ggml.tokens"]  # the reader counts unread arrays
    _, tokenizer, tokenizer_config = _gguf_tokenizer(get_gguf_tokenizer, path)
    return {"config": config, "tokenizer": tokenizer, "tokenizer_config": tokenizer_config}


@functools.lru_cache(maxsize=2)
def _cached_tokenizer(read: Any, path: str, mtime_ns: int) -> tuple[str, dict, dict]:
    return read(path)


def _gguf_tokenizer(read: Any, path: str) -> tuple[str, dict, dict]:
    """transformers' ``get_gguf_tokenizer(path)``, read once per file; each caller gets its own copy."""
    cached = _cached_tokenizer(read, os.path.realpath(path), os.stat(path).st_mtime_ns)
    return copy.deepcopy(cached)


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

    with _patch_lock, _shared_tokenizer_read():
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


@contextlib.contextmanager
def _shared_tokenizer_read() -> Iterator[None]:
    """Within this block, transformers' fast tokenizer read is answered from the one read of the file."""
    try:
        from transformers import integrations
        from transformers.integrations import gguf as fast
    except ImportError:
        yield
        return
    read = getattr(fast, "get_gguf_tokenizer", None)
    if read is None:
        yield
        return
    modules = [m for m in (fast, integrations) if "get_gguf_tokenizer" in vars(m)] or [fast]
    previous = [vars(m).get("get_gguf_tokenizer") for m in modules]
    for module in modules:
        module.get_gguf_tokenizer = functools.partial(_gguf_tokenizer, read)
    try:
        yield
    finally:
        for module, before in zip(modules, previous):
            if before is None:
                del module.get_gguf_tokenizer
            else:
                module.get_gguf_tokenizer = before


@contextlib.contextmanager
def _cached_tensor_name_maps() -> Iterator[None]:
    """gguf's ``get_tensor_name_map``, one build per (arch, layers) within this block.

    transformers' ``get_gguf_hf_weights_map`` recurses over every submodule of the model and asks gguf
    for the same name map each time; gguf builds it anew (~20 ms), which made 397 builds, 8 s, for
    SmolLM2. The map is a pure function of its arguments.
    """
    import gguf

    with _patch_lock:
        original = gguf.get_tensor_name_map
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
        try:
            yield
        finally:
            gguf.get_tensor_name_map = original


def iter_gguf_weights(path: str, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named float32 CPU tensors of the GGUF file, dequantized one at a time."""
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
    with _cached_tensor_name_maps():
        names = get_gguf_hf_weights_map(meta_model, processor)
    raw = load_gguf_state_dict(header)
    for info in header.tensors:
        result = processor.process(
            weights=_dequantize(raw[info.name].data, info.ggml_type, info.shape),
            name=info.name,
            tensor_key_mapping=names,
            parsed_parameters=parsed,
        )
        if result.name in names:
            yield names[result.name], torch.from_numpy(np.copy(result.weights))


def _dequantize(data: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's raw GGUF bytes as float values of ``shape`` (numpy, for transformers' processors).

    Quantized blocks go through transformers' vectorised torch dequantizer where it knows the type
    (3.5x faster than gguf's per-row numpy one on SmolLM2, and bit-identical there); float types and
    the rest through gguf's, which views float types and unpacks the others per row.
    """
    try:
        from transformers.integrations.gguf.dequant import GGML_BLOCK
        from transformers.integrations.gguf.dequant import dequantize as torch_dequantize
    except ImportError:
        GGML_BLOCK = {}
    if ggml_type in GGML_BLOCK:
        values = torch_dequantize(torch.from_numpy(np.array(data)), ggml_type)
        return values.reshape(shape).numpy()
    from gguf import GGMLQuantizationType, dequantize

    return dequantize(data.reshape(*shape[:-1], -1), GGMLQuantizationType(ggml_type))

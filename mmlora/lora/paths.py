"""Where run-time adapters may be read from: confined to a root folder by their resolved real path.

Shared by the HTTP server and the app. ``..``, absolute paths elsewhere and symbolic links that point
outside the root are all refused before a byte is read; only safetensors adapters are accepted.
"""

from __future__ import annotations

import os

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class AdapterPathError(ValueError):
    """A run-time adapter path that may not be read; the message names the parameter."""


class AdapterFolderMissing(AdapterPathError):
    """The path lies inside the root but no such folder exists (servers answer 404, as vLLM does)."""


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def confine_adapter_path(path: str, lora_root: str | None, *, param: str = "lora_path") -> str:
    """The real path of a PEFT adapter folder inside ``lora_root``, or an AdapterPathError."""
    if not lora_root:
        raise AdapterPathError(
            f"{param}: adapters cannot be loaded by path: no adapter root (--lora-root) is set"
        )
    if "\x00" in path:
        raise AdapterPathError(f"{param}: contains a NUL byte")
    root = os.path.realpath(lora_root)
    real = os.path.realpath(os.path.join(root, path))  # an absolute `path` replaces root here
    if not _inside(real, root):
        raise AdapterPathError(f"{param}: {path!r} is outside the allowed adapter root")
    if not os.path.exists(real):
        raise AdapterFolderMissing(
            f"{param}: {path!r} is not an adapter folder under the adapter root (no such folder)"
        )
    if not os.path.isdir(real):
        raise AdapterPathError(f"{param}: {path!r} is not an adapter folder under the adapter root")
    for name in ADAPTER_FILES:
        file = os.path.join(real, name)
        if not os.path.exists(file):
            if name.endswith(".safetensors") and any(
                os.path.exists(os.path.join(real, b)) for b in ("adapter_model.bin", "pytorch_model.bin")
            ):
                raise AdapterPathError(
                    f"{param}: pickled adapters (.bin) are refused; convert it to safetensors"
                )
            raise AdapterPathError(f"{param}: {path!r} has no {name}")
        if not _inside(os.path.realpath(file), root):
            raise AdapterPathError(f"{param}: {name} links outside the allowed adapter root")
    return real

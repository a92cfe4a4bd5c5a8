"""Models, tokenizers and adapters named by Hugging Face Hub id (``org/name`` or ``org/name@revision``).

An id is resolved once into the local hub cache by ``huggingface_hub.snapshot_download`` and from then on
treated like any folder. huggingface_hub itself honours ``HF_TOKEN``, ``HF_HUB_OFFLINE``, ``HF_ENDPOINT``,
``HF_HOME`` / ``HF_HUB_CACHE`` and shows its progress bars; only the files loading needs are fetched
(top-level configs, tokenizer files and safetensors weights; never ``*.bin`` or ``*.pth``). Every failure is
a :class:`HubError`: one line naming the repo and what to do. A string that exists on disk is always a
path, never an id.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from mmlora.config import ConfigError, LoRAConfig, ModelConfig, split_lora_spec
from mmlora.models.loader import ModelSource, resolve_model

logger = logging.getLogger(__name__)

# Top-level files that configs, tokenizers and image processors are read from.
CONFIG_PATTERNS = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors"]
PICKLED_ADAPTER = "adapter_model.bin"
WEIGHT_INDEX = "model.safetensors.index.json"
WEIGHTS = "model.safetensors"  # transformers' name for unsharded weights (repos may hold other copies)
_SUBFOLDERS = ["*/*"]  # the loader reads only a repo's top level (skips e.g. original/consolidated.*)
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+")
_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})/?$")


class HubError(ConfigError):
    """A hub id that cannot be resolved; the message is one line naming the repo and what to do."""


@dataclass(frozen=True)
class HubRef:
    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return f"{self.repo_id}@{self.revision}" if self.revision else self.repo_id


def parse_hub_ref(spec: str) -> HubRef | None:
    """``"org/name[@revision]"`` -> HubRef, or None when ``spec`` exists on disk or is not id-shaped."""
    if not isinstance(spec, str) or os.path.exists(spec):
        return None
    repo_id, sep, revision = spec.partition("@")
    if not _REPO_ID.fullmatch(repo_id) or (sep and not revision) or ".." in repo_id or "--" in repo_id:
        return None
    if repo_id.endswith(".gguf"):
        return None  # a GGUF *file* that does not exist: the loader says so
    return HubRef(repo_id, revision or None)


def hub_root(folder: str) -> str | None:
    """``"org/name@<commit>"`` when ``folder`` is a snapshot folder of the hub cache, else None."""
    m = _SNAPSHOT.search(Path(folder).as_posix())
    return f"{m['org']}/{m['name']}@{m['commit']}" if m else None


def snapshot(
    ref: HubRef,
    *,
    what: str,
    allow: list[str],
    cache_dir: str | None = None,
    ignore: list[str] | None = None,
) -> Path:
    """The snapshot folder of ``ref`` holding the files matching ``allow`` (downloaded if missing)."""
    from huggingface_hub import constants, errors, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    revision = ref.revision or "main"
    where = f"{what}: {ref.repo_id} (revision {revision})"
    cache = cache_dir or constants.HF_HUB_CACHE
    logger.info("resolving %s from the Hugging Face Hub into %s", ref, cache)
    try:
        folder = snapshot_download(
            ref.repo_id,
            revision=ref.revision,
            cache_dir=cache_dir,
            allow_patterns=allow,
            ignore_patterns=ignore,
        )
    except GatedRepoError:
        raise HubError(
            f"{where} is gated: accept its terms at {constants.ENDPOINT}/{ref.repo_id}, then set HF_TOKEN "
            "(or run `hf auth login`)"
        ) from None
    except RepositoryNotFoundError:
        raise HubError(
            f"{where} is no local path and was not found on {constants.ENDPOINT}: check the id, or set "
            "HF_TOKEN if it is private"
        ) from None
    except RevisionNotFoundError:
        raise HubError(f"{where}: the repo has no such revision (branch, tag or commit)") from None
    except LocalEntryNotFoundError as e:
        partial = isinstance(e, getattr(errors, "IncompleteSnapshotError", ()))
        state = "only partly in" if partial else "no local path and not in"
        if constants.HF_HUB_OFFLINE:
            raise HubError(
                f"{where} is {state} the hub cache {cache} and HF_HUB_OFFLINE=1 forbids downloading: "
                "download it once online, or point --download-dir / HF_HUB_CACHE at a cache that has it"
            ) from None
        raise HubError(
            f"{where} is {state} the hub cache {cache} and {constants.ENDPOINT} cannot be reached: check the "
            "network (or HF_ENDPOINT)"
        ) from None
    except HfHubHTTPError as e:
        raise HubError(f"{where}: download failed: {str(e).splitlines()[0]}") from None
    return Path(folder)


def _need(folder: Path, ref: HubRef, what: str, name: str) -> Path:
    path = folder / name
    if not path.is_file():
        raise HubError(f"{what}: {ref} has no {name}")
    return path


def _model_files(ref: HubRef, mc: ModelConfig) -> Path:
    """Configs and tokenizer first; then only the weight shards the index names (else model.safetensors)."""
    folder = snapshot(ref, what="model", allow=CONFIG_PATTERNS, cache_dir=mc.download_dir, ignore=_SUBFOLDERS)
    index = folder / WEIGHT_INDEX
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else None
    pinned = HubRef(ref.repo_id, folder.name)  # the commit just resolved: no second look-up of the ref
    snapshot(
        pinned,
        what="model",
        allow=shards or [WEIGHTS],
        cache_dir=mc.download_dir,
        ignore=_SUBFOLDERS,
    )
    _need(folder, ref, "model", "config.json")
    return folder


def _model_ref(mc: ModelConfig) -> HubRef | None:
    ref = parse_hub_ref(mc.model)
    if ref is None:
        return None
    if ref.revision and mc.revision and ref.revision != mc.revision:
        raise HubError(
            f"model: {mc.model!r} names revision {ref.revision!r} but --revision is {mc.revision!r}"
        )
    return HubRef(ref.repo_id, ref.revision or mc.revision)


def resolve_model_source(mc: ModelConfig) -> ModelSource:
    """Where the base model's weights and config are: a hub id resolved into the cache (named by its id),
    ``gguf_file`` inside a folder or repo, or whatever :func:`resolve_model` accepts."""
    ref = _model_ref(mc)
    if ref is None:
        if mc.gguf_file is None:
            return resolve_model(mc.model)
        if not os.path.isdir(mc.model):
            raise HubError(
                f"gguf_file: --model {mc.model!r} must be a folder or a hub id 'org/name' holding {mc.gguf_file}"
            )
        return resolve_model(os.path.join(mc.model, mc.gguf_file))
    if mc.gguf_file is not None:
        folder = snapshot(ref, what="model", allow=[mc.gguf_file], cache_dir=mc.download_dir)
        source = resolve_model(str(_need(folder, ref, "gguf_file", mc.gguf_file)))
    else:
        source = resolve_model(str(_model_files(ref, mc)))
    return dataclasses.replace(source, name=ref.repo_id)


def resolve_tokenizer(mc: ModelConfig) -> str | None:
    """``--tokenizer`` as a local path: a hub id (with its own ``@revision``) is resolved into the cache."""
    ref = parse_hub_ref(mc.tokenizer) if mc.tokenizer else None
    if ref is None:
        return mc.tokenizer
    return str(snapshot(ref, what="tokenizer", allow=CONFIG_PATTERNS, cache_dir=mc.download_dir))


def resolve_adapter(
    path: str, *, download_dir: str | None = None, allow_pickled: bool = False, what: str = "lora_paths"
) -> str:
    """An adapter's folder: a hub id is fetched (its two PEFT files only) into the cache; paths pass as is."""
    ref = parse_hub_ref(path)
    if ref is None:
        return path
    allow = ADAPTER_FILES + ([PICKLED_ADAPTER] if allow_pickled else [])
    folder = snapshot(ref, what=what, allow=allow, cache_dir=download_dir)
    _need(folder, ref, what, ADAPTER_FILES[0])
    if not (folder / ADAPTER_FILES[1]).is_file() and not (
        allow_pickled and (folder / PICKLED_ADAPTER).is_file()
    ):
        raise HubError(
            f"{what}: {ref} has no {ADAPTER_FILES[1]} (an adapter saved as {PICKLED_ADAPTER} is only "
            "fetched with --allow-pickled-adapters)"
        )
    return str(folder)


def resolve_lora_config(lora: LoRAConfig, download_dir: str | None) -> LoRAConfig:
    """``lora_paths`` with every hub id resolved to its snapshot folder; a bare id stays the adapter's name."""
    specs = []
    for spec in lora.lora_paths:
        name, path = split_lora_spec(spec)
        folder = resolve_adapter(path, download_dir=download_dir, allow_pickled=lora.allow_pickled_adapters)
        specs.append(spec if folder == path else f"{name}={folder}")
    return dataclasses.replace(lora, lora_paths=specs)

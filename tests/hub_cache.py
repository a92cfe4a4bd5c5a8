"""A Hugging Face Hub cache folder written by hand with the exact layout huggingface_hub writes, so that
hub ids resolve offline (``HF_HUB_OFFLINE=1``, ``HF_HUB_CACHE`` pointing here):

    models--org--name/blobs/<sha256 for LFS files, git blob sha1 otherwise>
    models--org--name/snapshots/<commit>/<file>  -> ../../blobs/<blob>   (relative symlinks)
    models--org--name/refs/<branch or tag>       the commit, no newline
    models--org--name/trees/<commit>.json         the repo's full file listing (huggingface_hub >= 1.x)

``remote_only`` files appear in the listing but not in the snapshot, as after a real download with
``allow_patterns``: asking huggingface_hub for one of them offline is an "incomplete snapshot" error, so a
load that succeeds proves it never asked for them.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path
from typing import Any

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pth")


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def add_snapshot(
    cache: Path,
    repo_id: str,
    folder: Path,
    *,
    refs: tuple[str, ...] = ("main",),
    remote_only: dict[str, bytes] | None = None,
) -> str:
    """Put the top-level files of ``folder`` into ``cache`` as one commit of ``repo_id``; returns the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
    digest = hashlib.sha1(repo_id.encode())
    for name, data in files.items():
        digest.update(name.encode() + hashlib.sha256(data).digest())
    commit = digest.hexdigest()
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    listing = {}
    for name, data in {**files, **(remote_only or {})}.items():
        lfs = name.endswith(LFS_SUFFIXES)
        entry = {"size": len(data), "blob_id": _git_blob_sha1(data)}
        if lfs:
            entry.update(lfs_sha256=hashlib.sha256(data).hexdigest(), lfs_size=len(data))
        listing[name] = entry
        if name not in files:
            continue
        blob = repo / "blobs" / (entry["lfs_sha256"] if lfs else entry["blob_id"])
        if not blob.exists():
            blob.write_bytes(data)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    (repo / "trees").mkdir(exist_ok=True)
    tree = {"format_version": 1, "files": {k: listing[k] for k in sorted(listing)}}
    (repo / "trees" / f"{commit}.json").write_text(json.dumps(tree, indent=1))
    return commit


def go_offline(monkeypatch: Any, cache: Path) -> None:
    """HF_HUB_OFFLINE=1 and HF_HUB_CACHE=cache; huggingface_hub reads both at import, so its constants are
    set too (a fresh process needs only the environment)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))


def _local(host: object) -> bool:
    return host in ("127.0.0.1", "::1", "localhost", b"localhost")


def refuse_network(monkeypatch: Any) -> list[object]:
    """Refuse and record every connection and name look-up beyond loopback. huggingface_hub swallows
    connection errors (it falls back to the cache), so callers assert on the record, not on an exception."""
    attempts: list[object] = []
    real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def connect(self: socket.socket, address: Any) -> None:
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _local(address[0]):
            attempts.append(address)
            raise OSError(f"test: network access to {address} refused")
        return real_connect(self, address)

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if not _local(host):
            attempts.append(host)
            raise OSError(f"test: name look-up of {host} refused")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return attempts

"""Fixtures shared by the kernel and graph tests."""

from __future__ import annotations

import pytest
from tiny_models import ALL_SEVEN, make_adapter, make_checkpoint, make_gemma2_checkpoint


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """``tiny(arch="llama")``: (a tiny checkpoint of ``arch``, {"a": rank 4 on all seven projections, "b":
    rank 2 on q_proj, o_proj and down_proj}), made once per arch for the session."""

    def build(arch: str) -> tuple:
        root = tmp_path_factory.mktemp(f"tiny-{arch}")
        base = (
            make_gemma2_checkpoint(root / "base")
            if arch == "gemma2"
            else make_checkpoint(root / "base", arch)
        )
        adapters = {
            "a": make_adapter(base, root / "a", seed=1, r=4, lora_alpha=8, target_modules=ALL_SEVEN),
            "b": make_adapter(
                base, root / "b", seed=2, r=2, lora_alpha=4, target_modules=["q_proj", "o_proj", "down_proj"]
            ),
        }
        return base, {n: str(p) for n, p in adapters.items()}

    cache: dict[str, tuple] = {}
    return lambda arch="llama": cache[arch] if arch in cache else cache.setdefault(arch, build(arch))

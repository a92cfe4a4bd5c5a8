"""Paged KV cache: a block allocator over ``num_blocks`` pages of ``block_size`` tokens, and the cache tensors."""

from __future__ import annotations

import torch


class BlockAllocator:
    """Hands out page ids; every page is either free or owned by exactly one request."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError("BlockAllocator: num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._used = [False] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int, have: int) -> int:
        """Pages to add so that ``num_tokens`` fit, given ``have`` pages already."""
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV cache out of pages: asked {n}, {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self._used[b] = True
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if not self._used[b]:
                raise RuntimeError(f"KV page {b} freed twice")
            self._used[b] = False
            self._free.append(b)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks


class KVCache:
    """One K and one V tensor per layer, each [num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=device)
        self.allocator = BlockAllocator(num_blocks, block_size)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, 0], self.data[i, 1]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()

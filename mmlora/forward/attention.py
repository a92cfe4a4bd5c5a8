"""AttentionMetadata: where each token of one forward reads and writes the paged KV cache.

KV cache layout, per layer: ``k_cache`` and ``v_cache`` of shape [num_blocks, block_size, num_kv_heads,
head_dim]. A request owns a list of blocks (its block table); token j of a request lives in block
``block_table[j // block_size]`` at offset ``j % block_size``, i.e. flat cache slot
``block * block_size + offset``.

A batch mixes prefill chunks and decode tokens. Request b contributes query tokens
``query_start_loc[b] : query_start_loc[b + 1]`` (in batch order), sitting at absolute positions
``seq_lens[b] - q_b ... seq_lens[b] - 1`` (q_b its query length); the tokens before them are already cached
(an earlier chunk, or the tokens decoded so far).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Device tensors (int32 unless noted) and host mirrors for one forward.

    query_start_loc [B + 1]    cumulative query lengths
    seq_lens        [B]        KV length after this forward (cached + new tokens)
    block_tables    [B, max_blocks_per_seq]  cache blocks of each request, padded with 0
    slot_mapping    [T] int64  flat cache slot where each new token's K/V is written
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    num_seqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    query_lens_host: list[int]
    seq_lens_host: list[int]
    # Per-step tensors a backend derives once and every layer reuses (CPU: gather rows, masks).
    derived: dict[str, Any] = field(default_factory=dict, repr=False)
    # A CUDA graph's mixed step (mmlora.engine.mixed_graph): the prefill kernel's query tiles from this
    # fixed-size table (triton_prefill.PrefillTiles) instead of a grid sized by the batch.
    prefill_tiles: Any = None

    @property
    def is_decode(self) -> bool:
        """Every request contributes exactly one token."""
        return self.max_query_len == 1

"""ForwardBatch: everything one model forward needs, built by the model runner each step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmlora.forward.attention import AttentionMetadata


@dataclass
class ForwardBatch:
    """One forward over a mix of prefill chunks and decode tokens, in batch order.

    Adapter routing is not here: the LoRA layers read it from the LoRA manager's context, which
    ``LoRAManager.activate`` (eager) or ``prepare_capture`` / ``prepare_replay`` (graphs) fill.

    input_ids       [T] int64      token ids (image placeholder positions hold any id)
    positions       [T] int64      absolute positions for RoPE, or [3, T] for M-RoPE (t, h, w)
    attn            paged-KV metadata (see AttentionMetadata)
    input_embeds    [N, H] or None features that replace the token embeddings at rows ``embed_rows``
    embed_rows      [N] int64 or None
    logits_rows     [B'] int64     rows whose hidden state is turned into logits (last token of each
                                   request that samples this step)
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    logits_rows: torch.Tensor
    input_embeds: torch.Tensor | None = None
    embed_rows: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.attn.num_tokens

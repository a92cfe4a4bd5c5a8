"""M-RoPE positions (Qwen2-VL): three axes (t, h, w) per token, computed as HF's ``get_rope_index``.

Text advances all three axes by 1; an image's tokens take (t, row, column) of their merged patch, offset
by the position where the image starts, and the text after it continues at that position plus
max(h, w) / merge. Past the prompt, index i has position i + rope_delta on all three axes.
"""

from __future__ import annotations

import torch

from mmlora.multimodal.inputs import ImageInputs


def mrope_positions(
    length: int, spans: list[tuple[int, int]], grid: list[tuple[int, int, int]], merge: int
) -> tuple[torch.Tensor, int]:
    """[3, length] int64 positions of a prompt with the image ``spans`` (start, count) of patch ``grid``s,
    and its rope delta."""
    parts, pos, i = [], 0, 0
    for (start, count), (t, h, w) in zip(spans, grid):
        if start > i:
            parts.append(torch.arange(pos, pos + start - i).expand(3, -1))
            pos += start - i
        gh, gw = h // merge, w // merge
        tt = torch.arange(t).view(t, 1, 1).expand(t, gh, gw).flatten()
        hh = torch.arange(gh).view(1, gh, 1).expand(t, gh, gw).flatten()
        ww = torch.arange(gw).view(1, 1, gw).expand(t, gh, gw).flatten()
        parts.append(torch.stack([tt, hh, ww]) + pos)
        pos += max(h, w) // merge
        i = start + count
    if length > i:
        parts.append(torch.arange(pos, pos + length - i).expand(3, -1))
    positions = torch.cat(parts, dim=1).to(torch.int64)
    return positions, int(positions.max()) + 1 - length


def chunk_positions(mm: ImageInputs | None, start: int, n: int) -> torch.Tensor:
    """[3, n] M-RoPE positions of token indices start .. start + n - 1 of a request (None: text only)."""
    if mm is None:
        return torch.arange(start, start + n).expand(3, -1)
    length = mm.positions.shape[1]
    inside = mm.positions[:, start : min(start + n, length)]
    after = torch.arange(max(start, length), max(start + n, length)).expand(3, -1) + mm.rope_delta
    return torch.cat([inside, after], dim=1)


def decode_position(mm: ImageInputs | None, index: int) -> int | None:
    """The one rotary position of token ``index``, as a decode CUDA graph feeds it (1-D positions), or
    None when the three axes differ there (an image token): that step then runs eagerly. Past the prompt,
    and on its text tokens, the axes agree."""
    if mm is None:
        return index
    length = mm.positions.shape[1]
    if index >= length:
        return index + mm.rope_delta
    t, h, w = mm.positions[:, index].tolist()
    return t if t == h == w else None

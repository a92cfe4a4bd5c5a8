"""LoRABatchInfo: which adapter slot each token of one forward uses; LoRAWeights: one module's adapters.

Preallocated once at the engine's maximum batch (so CUDA graphs can capture the tensors) and filled in
place every step by :meth:`LoRABatchInfo.fill`. Tokens are grouped into *segments*: runs of consecutive
tokens that share an adapter slot (a prefill chunk of one request, or one decode token). Slot ``-1``
means the base model only: kernels leave those rows untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmlora.forward.host_copy import host_tensor, pinned_for

#: The Triton LoRA kernels walk a slot's rank in tiles of this many (a slot of rank 8 reads one tile),
#: so ranks up to it cost the same and the smallest rank bucket is this.
RANK_TILE = 16

#: The longest segment of a CUDA-graph step filled as runs (``fill_rows(..., layout="runs")``): a run of
#: more rows on one adapter is cut into segments of this many, so a graph captured with this
#: ``max_seg_len`` fits every replay in one token tile per segment.
RUN_TILE = 16

#: Token tile sizes a CUDA-graph mixed step has tile tables for (``fill_graph``): the segment kernels'
#: token tiles (16 to 128; their ``TUNING`` picks one).
GRAPH_TILE_SIZES = (16, 32, 64, 128)

#: A first token no segment reaches: tile-table entries past the step's tiles point there and exit.
UNUSED_TILE = 1 << 30

#: Each staged layout and the share of the stage's positions its GEMM reads (1 / the divisor).
STAGED_LAYOUTS = {"staged": 1, "staged/2": 2, "staged/4": 4}

#: The ways a CUDA-graph decode step can route its rows: ``rows`` (one segment per row: per-row kernels
#: such as BGMV), ``runs`` (adjacent rows on one adapter merged into segments of at most RUN_TILE rows:
#: segment kernels such as SGMV read each adapter once per run) and the staged ones (routed as ``runs``; the
#: shrink comes from the base GEMM, :mod:`mmlora.lora.stage`): ``staged`` over every stage position,
#: ``staged/2`` and ``staged/4`` over the first half and quarter of them.
GRAPH_LAYOUTS = ("rows", "runs", *STAGED_LAYOUTS)


def slot_runs(slots: Sequence[int], cap: int = RUN_TILE) -> list[tuple[int, int]]:
    """(slot, length) of each run of equal adjacent ``slots``, runs cut at ``cap`` rows."""
    runs: list[tuple[int, int]] = []
    for s in slots:
        if runs and runs[-1][0] == s and runs[-1][1] < cap:
            runs[-1] = (s, runs[-1][1] + 1)
        else:
            runs.append((s, 1))
    return runs


def length_tiles(
    lengths: Sequence[int], block: int, width: int, absolute: bool
) -> tuple[list[int], list[int]]:
    """A fixed-size tile table over consecutive spans of ``lengths``: (span index, first token) of each
    ``block``-token tile in order, the first token counted from the span's start, or from the first span's
    when ``absolute``; then unused entries ((0, :data:`UNUSED_TILE`)) up to ``width``. A ValueError when the
    spans need more than ``width`` tiles."""
    spans, firsts, start = [], [], 0
    for i, n in enumerate(lengths):
        base = start if absolute else 0
        for m in range(0, n, block):
            spans.append(i)
            firsts.append(base + m)
        start += n
    if len(spans) > width:
        raise ValueError(f"{len(spans)} tiles exceed the table's {width} entries")
    pad = width - len(spans)
    return spans + [0] * pad, firsts + [UNUSED_TILE] * pad


def rank_buckets(max_rank: int) -> tuple[int, ...]:
    """The rank bounds a batch can have under a pool of rank ``max_rank``: 16, 32, 64, ... (doubling,
    below ``max_rank``), then ``max_rank`` itself. One CUDA graph is captured per (batch, rank bucket)."""
    if max_rank < 1:
        raise ValueError(f"max_rank must be >= 1, got {max_rank}")
    buckets, b = [], RANK_TILE
    while b < max_rank:
        buckets.append(b)
        b *= 2
    return (*buckets, max_rank)


def rank_bucket(rank: int, max_rank: int | None = None) -> int:
    """The smallest bucket of :func:`rank_buckets` holding ``rank`` (0 for 0: no adapter in the batch).
    Without ``max_rank`` the doubling is not capped."""
    if rank <= 0:
        return 0
    if max_rank is not None and rank > max_rank:
        raise ValueError(f"rank {rank} exceeds max_rank {max_rank}")
    b = RANK_TILE
    while b < rank:
        b *= 2
    return b if max_rank is None else min(b, max_rank)


@dataclass(frozen=True)
class LoRAWeights:
    """One LoRA target module's views into the adapter pool (layout in :mod:`mmlora.backends.base`).

    A              [num_slots, n_slices * R, in_features]  shrink weights
    B              [num_slots, out_features, R]             expand weights
    scalings       [num_slots, n_slices] float32            alpha / r (or alpha / sqrt(r)) per slice
    slice_offsets  n_slices + 1 ints                       output columns of each slice (packed qkv, gate_up)

    Or paged by rank tile (a pool whose slots hold C pages of U ranks, R = C * U): A [num_slots, C,
    n_slices * U, in_features] and B [num_slots, C, out_features, U]; ranks c*U .. c*U + U - 1 of a slot
    are page c. An adapter of rank r <= U then reads one contiguous page, as in a rank-U pool.
    """

    A: torch.Tensor
    B: torch.Tensor
    scalings: torch.Tensor
    slice_offsets: tuple[int, ...]

    @property
    def n_slices(self) -> int:
        return len(self.slice_offsets) - 1

    @property
    def gated_pair(self) -> bool:
        """Whether the module packs two slices of one width from column 0 (gate | up): the layout a gated
        activation reads."""
        off = self.slice_offsets
        return len(off) == 3 and off[0] == 0 and off[2] == 2 * off[1]

    @property
    def pages(self) -> int:
        """Rank pages per slot (C; 1 for the unpaged layout)."""
        return self.A.shape[1] if self.A.dim() == 4 else 1

    @property
    def page_rank(self) -> int:
        """Ranks per page (U; the pool rank R for the unpaged layout)."""
        return self.B.shape[-1]

    @property
    def rank(self) -> int:
        """The pool rank R: ``pages * page_rank``."""
        return self.pages * self.page_rank


def unpage_a(a: torch.Tensor, n_slices: int) -> torch.Tensor:
    """Gathered A pages [.., C, n*U, in] as the unpaged rows [.., n*C*U, in] (a copy)."""
    *lead, C, rows, in_f = a.shape
    U = rows // n_slices
    return a.reshape(*lead, C, n_slices, U, in_f).transpose(-4, -3).reshape(*lead, n_slices * C * U, in_f)


def unpage_b(b: torch.Tensor) -> torch.Tensor:
    """Gathered B pages [.., C, out, U] as the unpaged [.., out, C*U] (a copy)."""
    *lead, C, out_f, U = b.shape
    return b.transpose(-3, -2).reshape(*lead, out_f, C * U)


def page_weights(weights: LoRAWeights, page_rank: int) -> LoRAWeights:
    """Unpaged ``weights`` copied into pages of ``page_rank`` ranks (the inverse of :func:`unpage_a` and
    :func:`unpage_b`), for tests and benchmarks: a paged pool stores its adapters this way itself."""
    A, B = weights.A, weights.B
    S, _, in_f = A.shape
    n, C, U = weights.n_slices, weights.rank // page_rank, page_rank
    A4 = A.reshape(S, n, C, U, in_f).transpose(1, 2).reshape(S, C, n * U, in_f).contiguous()
    B4 = B.reshape(S, B.shape[1], C, U).permute(0, 2, 1, 3).contiguous()
    return LoRAWeights(A4, B4, weights.scalings, weights.slice_offsets)


class LoRABatchInfo:
    """Per-forward adapter routing, shared by every LoRA layer of the model.

    Device tensors (int32), valid up to ``num_segments`` / ``num_tokens``; rows past them are padding:
      seg_indptr     [max_tokens + 1]  segment i covers tokens seg_indptr[i]:seg_indptr[i + 1]
      seg_lens       [max_tokens]      seg_indptr[i + 1] - seg_indptr[i]
      weight_indices [max_tokens]      slot of segment i, or -1 (base only)
      token_slots    [max_tokens]      slot of each token, or -1
      ranks          [num_slots]       rank of the adapter in each slot (0 when empty)
    Host mirrors (Python lists / ints) let backends make launch decisions without a device sync:
      num_tokens, num_segments, max_rank (largest rank in this batch, 0 when no row has an adapter),
      seg_lens_host, seg_slots_host, ranks_host, max_seg_len (longest segment, 0 when none: kernels
      size token tiles by it, so it is found once per fill, not once per layer), rank_bound (max_rank
      rounded up to its :func:`rank_bucket`: what launch shapes follow, so they take few values),
      graph_layout (None for an eager fill; ``rows`` or ``runs`` for a CUDA-graph step: see
      :data:`GRAPH_LAYOUTS` and :meth:`fill_rows`).
    ``host_derived`` is emptied by every fill: backends may cache routing they derive from the host
    mirrors there (once per forward, shared by every layer).
    """

    def __init__(
        self, max_tokens: int, num_slots: int, device: torch.device | str, max_lora_rank: int | None = None
    ) -> None:
        """``max_lora_rank`` (the pool's rank) caps the rank buckets; None leaves them uncapped."""
        self.max_tokens = max_tokens
        self.max_lora_rank = max_lora_rank
        self.num_slots = num_slots
        self.device = torch.device(device)
        i32 = dict(dtype=torch.int32, device=self.device)
        self.seg_indptr = torch.zeros(max_tokens + 1, **i32)
        self.seg_lens = torch.zeros(max_tokens, **i32)
        self.weight_indices = torch.full((max_tokens,), -1, **i32)
        self.token_slots = torch.full((max_tokens,), -1, **i32)
        self.ranks = torch.zeros(num_slots, **i32)
        self.num_tokens = 0
        self.num_segments = 0
        self.max_rank = 0
        self.rank_bound = 0
        self.seg_lens_host: list[int] = []
        self.seg_slots_host: list[int] = []
        self.max_seg_len = 0
        self.ranks_host: list[int] = [0] * num_slots
        self.host_derived: dict[str, object] = {}
        self.graph_layout: str | None = None
        # A mixed-step graph's token tiles (fill_graph): block_m -> (segment, first token, entries), in
        # buffers made once, so a captured launch reads this step's table at the captured address.
        self.graph_tiles: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._tile_buf: torch.Tensor | None = None

    @property
    def has_lora(self) -> bool:
        return self.max_rank > 0

    def set_slot_rank(self, slot: int, rank: int) -> None:
        """Record the rank of the adapter now held in ``slot`` (0 when the slot is emptied)."""
        # A kernel on the current (upload) stream: an item assignment copies from the host and synchronizes
        # the stream, so a slot load would wait for the step the overlap scheduler has launched.
        self.ranks[slot].fill_(rank)
        self.ranks_host[slot] = rank

    def fill(self, seq_lens: Sequence[int], seq_slots: Sequence[int]) -> None:
        """Fill in place from per-request token counts and slots (-1 = base), in batch order.

        Adjacent requests on the same slot merge into one segment. Empty requests are skipped.
        """
        if len(seq_lens) != len(seq_slots):
            raise ValueError("fill: seq_lens and seq_slots differ in length")
        seg_lens: list[int] = []
        seg_slots: list[int] = []
        token_slots: list[int] = []
        for n, slot in zip(seq_lens, seq_slots):
            if n <= 0:
                continue
            if not -1 <= slot < self.num_slots:
                raise ValueError(f"fill: slot {slot} outside [-1, {self.num_slots})")
            if seg_slots and seg_slots[-1] == slot:
                seg_lens[-1] += n
            else:
                seg_lens.append(n)
                seg_slots.append(slot)
            token_slots.extend([slot] * n)
        total = len(token_slots)
        if total > self.max_tokens:
            raise ValueError(f"fill: {total} tokens exceed the preallocated {self.max_tokens}")
        indptr = [0]
        for n in seg_lens:
            indptr.append(indptr[-1] + n)
        nseg = len(seg_lens)
        host = dict(dtype=torch.int32, device=self.device)
        self.seg_indptr[: nseg + 1].copy_(host_tensor(indptr, **host), non_blocking=True)
        self.seg_indptr[nseg + 1 :].fill_(total)
        self.seg_lens[:nseg].copy_(host_tensor(seg_lens, **host), non_blocking=True)
        self.seg_lens[nseg:].zero_()
        self.weight_indices[:nseg].copy_(host_tensor(seg_slots, **host), non_blocking=True)
        self.weight_indices[nseg:].fill_(-1)
        self.token_slots[:total].copy_(host_tensor(token_slots, **host), non_blocking=True)
        self.token_slots[total:].fill_(-1)
        self.num_tokens = total
        self.num_segments = nseg
        self.seg_lens_host = seg_lens
        self.seg_slots_host = seg_slots
        self.max_seg_len = max(seg_lens, default=0)
        self.host_derived = {}
        self.max_rank = max((self.ranks_host[s] for s in seg_slots if s >= 0), default=0)
        self.rank_bound = rank_bucket(self.max_rank, self.max_lora_rank)
        self.graph_layout = None
        self.graph_tiles = {}

    def fill_graph(
        self,
        seq_lens: Sequence[int],
        seq_slots: Sequence[int],
        num_tokens: int,
        num_segments: int,
        rank_bound: int,
    ) -> None:
        """The routing of a CUDA-graph mixed step (:mod:`mmlora.engine.mixed_graph`), whose host ints are
        baked in at capture: :meth:`fill`'s segments, then ``num_tokens`` tokens (the rest padding, slot
        -1) in ``num_segments`` segment entries (the rest empty), ``max_seg_len`` at ``num_tokens`` (so
        segment kernels take their largest token tile), the rank bound ``rank_bound`` (>= every rank in the
        batch) and, per token tile size in :data:`GRAPH_TILE_SIZES`, a tile table of a fixed number of
        entries (:meth:`graph_tile_count`) in buffers of fixed address. A ValueError when the batch does
        not fit."""
        self.fill(seq_lens, seq_slots)
        if self.num_tokens > num_tokens or self.num_segments > num_segments or self.max_rank > rank_bound:
            raise ValueError(
                f"fill_graph: {self.num_tokens} tokens in {self.num_segments} segments of rank up to "
                f"{self.max_rank} do not fit {num_tokens} tokens, {num_segments} segments, rank bound {rank_bound}"
            )
        if num_tokens > self.max_tokens or num_segments > self.max_tokens:
            raise ValueError(f"fill_graph: {num_tokens} tokens exceed the preallocated {self.max_tokens}")
        lens = self.seg_lens_host
        if self._tile_buf is None:
            entries = self.graph_tile_count(self.max_tokens, self.max_tokens, GRAPH_TILE_SIZES[0])
            self._tile_buf = torch.zeros(
                len(GRAPH_TILE_SIZES), 2, entries, dtype=torch.int32, device=self.device
            )
        # Only the entries the bucket launches are written (the most: the smallest tile's count).
        width = self.graph_tile_count(num_tokens, num_segments, GRAPH_TILE_SIZES[0])
        rows = [
            row for block_m in GRAPH_TILE_SIZES for row in length_tiles(lens, block_m, width, absolute=True)
        ]
        table = host_tensor(rows, torch.int32, self.device).view(len(GRAPH_TILE_SIZES), 2, width)
        self._tile_buf[:, :, :width].copy_(table, non_blocking=True)
        self.graph_tiles = {
            bm: (
                self._tile_buf[i, 0],
                self._tile_buf[i, 1],
                self.graph_tile_count(num_tokens, num_segments, bm),
            )
            for i, bm in enumerate(GRAPH_TILE_SIZES)
        }
        pad = num_segments - self.num_segments
        self.seg_lens_host = lens + [0] * pad
        self.seg_slots_host = self.seg_slots_host + [-1] * pad
        self.num_tokens, self.num_segments, self.max_seg_len = num_tokens, num_segments, num_tokens
        self.max_rank = self.rank_bound = rank_bound

    @staticmethod
    def graph_tile_count(num_tokens: int, num_segments: int, block_m: int) -> int:
        """Entries of a mixed-step graph's tile table: enough for any split of ``num_tokens`` tokens into
        ``num_segments`` segments in tiles of ``block_m`` (rounded up to 16, which keeps the table's
        alignment the same for every count)."""
        n = -(-num_tokens // block_m) + num_segments
        return -(-n // 16) * 16

    def bound_of(self, slots: Sequence[int]) -> int:
        """The rank bound of a batch of these slots (-1 = base): the bucket of their largest rank."""
        top = max((self.ranks_host[s] for s in slots if s >= 0), default=0)
        return rank_bucket(top, self.max_lora_rank)

    def fill_rows(
        self,
        slots: Sequence[int],
        rank_bound: int,
        layout: str = "rows",
        segments: int | None = None,
        runs: list[tuple[int, int]] | None = None,
    ) -> None:
        """The routing of a CUDA-graph step, whose host ints are baked in at capture, with a fixed
        ``rank_bound`` (>= every rank among ``slots``: kernels loop to each slot's rank on the device).

        ``rows``: one segment per row, never merged. ``runs``: adjacent rows on one slot merged into
        segments of at most :data:`RUN_TILE` rows, the rest of the ``segments`` entries (default: one per
        row) empty (zero rows, slot -1); the host ints are those of the worst case (``num_segments =
        segments``, ``max_seg_len = RUN_TILE``), so one capture fits every replay of the same row count
        with at most ``segments`` runs. Segment kernels launch programs for every entry, so a backend that
        replays runs only when there are few (triton-auto: at most half the rows) asks for fewer.
        ``runs``: ``slot_runs(slots)`` when the caller has it already.
        """
        if layout not in GRAPH_LAYOUTS:
            raise ValueError(f"fill_rows: layout must be one of {GRAPH_LAYOUTS}, got {layout!r}")
        n = len(slots)
        if n > self.max_tokens:
            raise ValueError(f"fill_rows: {n} rows exceed the preallocated {self.max_tokens}")
        device_slots = host_tensor(slots, torch.int32, self.device)
        self.token_slots[:n].copy_(device_slots, non_blocking=True)
        num_segments = n
        if layout == "rows":
            self.weight_indices[:n].copy_(device_slots, non_blocking=True)
            indptr = torch.arange(n + 1, dtype=torch.int32, pin_memory=pinned_for(self.device))
            self.seg_indptr[: n + 1].copy_(indptr, non_blocking=True)
            self.seg_lens[:n].fill_(1)
            self.seg_lens_host = [1] * n
            self.seg_slots_host = list(slots)
            self.max_seg_len = 1 if n else 0
        else:
            runs = slot_runs(slots) if runs is None else runs
            num_segments = n if segments is None else segments
            if not len(runs) <= num_segments <= self.max_tokens:
                raise ValueError(
                    f"fill_rows: {len(runs)} runs need segments in [{len(runs)}, {self.max_tokens}], "
                    f"got {num_segments}"
                )
            pad = num_segments - len(runs)
            lens = [length for _, length in runs] + [0] * pad
            seg_slots = [s for s, _ in runs] + [-1] * pad
            indptr = [0]
            for length in lens:
                indptr.append(indptr[-1] + length)
            packed = host_tensor([indptr, [*lens, 0], [*seg_slots, -1]], torch.int32, self.device)
            self.seg_indptr[: num_segments + 1].copy_(packed[0], non_blocking=True)
            self.seg_lens[:num_segments].copy_(packed[1, :num_segments], non_blocking=True)
            self.weight_indices[:num_segments].copy_(packed[2, :num_segments], non_blocking=True)
            self.seg_lens_host = lens
            self.seg_slots_host = seg_slots
            self.max_seg_len = RUN_TILE if n else 0
        self.num_tokens = n
        self.num_segments = num_segments
        self.max_rank = self.rank_bound = rank_bound
        self.host_derived = {}
        self.graph_layout = layout
        self.graph_tiles = {}

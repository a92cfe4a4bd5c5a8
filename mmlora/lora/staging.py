"""Adapters staged for upload: host copies in a few flat page-locked blocks, and the plans that copy them
into a pool slot.

On CUDA the pool keeps each adapter's host copy as a few flat page-locked blocks holding all its A and B
tensors back to back (``LoadedAdapter.staged``; the tensors are views of them), so a slot load is one
host-to-device copy per block into the pool's device staging buffer, then multi-tensor device copies
from chunks of that buffer into the slot's views: not one host-to-device copy per tensor (issue 13:
~670 copies, 8.6 ms of host time per Mistral-7B adapter on the H200).

What is left of an upload's host time is building those copies' argument lists: a Mistral-7B adapter
has ~450 tensors, and splitting the staging buffer and pairing chunks with slot views took most of an
upload's 3.3 ms on the H200 (2026-12-02). Adapters staged alike (same modules, shapes and dtype) share a
layout id, so the pool builds one :class:`UploadPlan` per (slot, layout) and replays it
(:class:`UploadPlans`, which also keeps the device staging buffers the plans copy through).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from mmlora.lora.adapter import LoadedAdapter, LoRAModuleWeights

#: The largest page-locked block an adapter is staged in. PyTorch's caching host allocator rounds each
#: block up to a power of two: one block per adapter could take up to twice its bytes (an 84 MB
#: Mistral-7B rank-16 adapter, 128 MB); blocks of at most this many bytes waste only the rounding of
#: the last one, for a few copies per upload instead of one.
STAGE_BLOCK_BYTES = 16 << 20

# Layout signature (modules, tensor shapes, dtype, block sizes) -> a small id: hashing the signature at
# every upload would cost more than the plan saves.
_LAYOUT_IDS: dict[tuple, int] = {}

Pair = tuple[torch.Tensor | None, torch.Tensor]  # (slot view or None to skip, host source tensor)


def pinned(adapter: LoadedAdapter) -> LoadedAdapter:
    """A copy in page-locked host memory, so slot loads are asynchronous copies: flat blocks
    (:func:`flatten`), or a page-locked copy per tensor when its tensors do not share one dtype."""
    flat = flatten(adapter, pin=True)
    if flat is not None:
        return flat

    def pin(ts: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
        return tuple(t.pin_memory() if t is not None else None for t in ts)

    weights = {
        key: LoRAModuleWeights(A=pin(w.A), B=pin(w.B), scalings=w.scalings)
        for key, w in adapter.weights.items()
    }
    return dataclasses.replace(adapter, weights=weights)


def flatten(adapter: LoadedAdapter, pin: bool) -> LoadedAdapter | None:
    """``adapter`` with its A and B tensors copied back to back into flat blocks of at most
    :data:`STAGE_BLOCK_BYTES` (page-locked with ``pin``; a larger tensor gets a block of its own), kept
    in ``staged``, its tensors views of them, ``staged_layout`` the id of that layout, and
    ``staged_scalings`` every slice's scaling (0 where the slice has no weights) in fp32, module by module
    in the adapter's order; None when the tensors do not share one dtype (a block holds one) or there are
    none."""
    tensors = [t for w in adapter.weights.values() for t in (*w.A, *w.B) if t is not None]
    if not tensors or len({t.dtype for t in tensors}) != 1:
        return None
    cap = STAGE_BLOCK_BYTES // tensors[0].element_size()
    groups: list[list[torch.Tensor]] = [[]]
    filled = 0
    for t in tensors:
        if groups[-1] and filled + t.numel() > cap:
            groups.append([])
            filled = 0
        groups[-1].append(t)
        filled += t.numel()
    blocks, views = [], []
    for group in groups:
        block = torch.empty(sum(t.numel() for t in group), dtype=tensors[0].dtype, pin_memory=pin)
        group_views = [v.view(t.shape) for t, v in zip(group, block.split([t.numel() for t in group]))]
        torch._foreach_copy_(group_views, group)
        blocks.append(block)
        views += group_views
    block_views = iter(views)  # in the order of ``tensors``: by module, A then B

    def view(ts: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
        return tuple(next(block_views) if t is not None else None for t in ts)

    weights = {
        key: LoRAModuleWeights(A=view(w.A), B=view(w.B), scalings=w.scalings)
        for key, w in adapter.weights.items()
    }

    def shapes(ts: tuple[torch.Tensor | None, ...]) -> tuple:
        return tuple(None if t is None else tuple(t.shape) for t in ts)

    signature = (
        tuple((key, shapes(w.A), shapes(w.B)) for key, w in weights.items()),
        tensors[0].dtype,
        tuple(b.numel() for b in blocks),
    )
    layout = _LAYOUT_IDS.setdefault(signature, len(_LAYOUT_IDS))
    scalings = scalings_of(adapter)
    return dataclasses.replace(
        adapter,
        weights=weights,
        staged=tuple(blocks),
        staged_layout=layout,
        staged_scalings=scalings.pin_memory() if pin else scalings,
    )


def scalings_of(adapter: LoadedAdapter) -> torch.Tensor:
    """Every slice's scaling in one fp32 tensor (0 where the slice has no weights), module by module in
    the adapter's order: ``staged_scalings``, as an upload plan copies them."""
    if adapter.staged_scalings is not None:
        return adapter.staged_scalings
    values = [
        float(sc) if a is not None else 0.0
        for w in adapter.weights.values()
        for a, sc in zip(w.A, w.scalings)
    ]
    return torch.tensor(values, dtype=torch.float32)


def check_staged(pairs: list[Pair], staged: tuple[torch.Tensor, ...]) -> None:
    """Raise unless the sources of ``pairs`` are every tensor of the blocks ``staged``, back to back in
    order (as :func:`flatten` lays them out): anything else would upload the wrong weights."""
    size, dtype = staged[0].element_size(), staged[0].dtype
    sources = iter(t for _, t in pairs)
    for block in staged:
        ptr, end = block.data_ptr(), block.data_ptr() + block.numel() * size
        while ptr < end:
            t = next(sources, None)
            if t is None or t.data_ptr() != ptr or not t.is_contiguous() or t.dtype != dtype:
                raise ValueError("an adapter tensor is not where its staged blocks hold it")
            ptr += t.numel() * size
        if ptr != end:
            raise ValueError("an adapter tensor is not where its staged blocks hold it")
    if next(sources, None) is not None:
        raise ValueError("an adapter tensor is not where its staged blocks hold it")


def _rows_joined(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """One view of ``a``'s rows then ``b``'s when ``b`` continues ``a`` along its first dim in the same
    storage (same shape past it, same strides), else None."""
    if (
        a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
        or a.shape[1:] != b.shape[1:]
        or a.stride() != b.stride()
        or b.storage_offset() != a.storage_offset() + a.shape[0] * a.stride(0)
    ):
        return None
    return a.as_strided((a.shape[0] + b.shape[0], *a.shape[1:]), a.stride(), a.storage_offset())


@dataclass
class UploadPlan:
    """The copies of one staged layout into one slot: each block to its offset in the staging buffer,
    then multi-tensor copies from the buffer's chunks to the slot's views; the adapter's scalings to
    their staging buffer, then to the slot's scalings views. ``filled``: the A and B elements the adapter
    fills in the slot."""

    staging: torch.Tensor
    flat: tuple[list[torch.Tensor], list[torch.Tensor]]
    strided: tuple[list[torch.Tensor], list[torch.Tensor]]
    scale_staging: torch.Tensor
    scales: tuple[list[torch.Tensor], list[torch.Tensor]]
    filled: int

    @classmethod
    def build(
        cls,
        pairs: list[Pair],
        staged: tuple[torch.Tensor, ...],
        staging: torch.Tensor,
        scale_pairs: list[tuple[torch.Tensor | None, int]],
        scale_staging: torch.Tensor,
    ) -> UploadPlan:
        """``pairs`` (slot view or None to skip, source), the sources being the tensors of the flat host
        blocks ``staged`` in order (checked); ``staging``: flat, on the slot's device, of the blocks'
        dtype and total length. ``scale_pairs``: (the slot's scalings view of a module or None to skip,
        its slice count) in the order of ``staged_scalings``, whose length ``scale_staging`` has."""
        check_staged(pairs, staged)
        flat: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        strided: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        at = 0  # where the pair's chunk starts in ``staging``
        run_start: int | None = None  # where the last strided pair's chunk starts, if it ends at ``at``
        for d, t in pairs:
            chunk = staging[at : at + t.numel()]
            start, at = at, at + t.numel()
            if d is None:
                run_start = None
                continue
            # _foreach_copy_'s multi-tensor kernel takes pairs of one dense layout: flat slot views with
            # flat chunks. A paged A view A[slot, :k, rows] spans k pages, each part contiguous: k flat
            # pairs. A B view B[slot, rows, :r] below the pool rank (or a paged one, [out, k, U]) is
            # strided: those go in a second call, which copies them one by one (a launch each), so the
            # B views of a module's slices, rows back to back, are joined into one.
            if d.dim() == 1:
                flat[0].append(d)
                flat[1].append(chunk)
                run_start = None
            # [pages, U, in]: its parts share strides, so the first speaks for all. (Iterating every view
            # unbound paged B views [out, pages, U] into ``out`` parts: building the 128 plans of a
            # rank-64 SmolLM2 adapter took 21 s on CPU, not 2, and an H200 run loaded 32 rank-64
            # Mistral-7B adapters in 211 s.)
            elif d.dim() == 3 and d[0].is_contiguous():
                flat[0].extend(part.view(-1) for part in d)
                flat[1].extend(chunk.split(d[0].numel()))  # d lists its elements in t's order
                run_start = None
            else:
                joined = _rows_joined(strided[0][-1], d) if run_start is not None else None
                if joined is not None:
                    strided[0][-1] = joined
                    strided[1][-1] = staging[run_start:at].view(joined.shape)
                else:
                    strided[0].append(d)
                    strided[1].append(chunk.view(d.shape))
                    run_start = start
        if sum(n for _, n in scale_pairs) != scale_staging.numel():
            raise ValueError("the adapter's scalings do not match its modules")
        scales: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for (d, _), chunk in zip(scale_pairs, scale_staging.split([n for _, n in scale_pairs])):
            if d is not None:
                scales[0].append(d)
                scales[1].append(chunk)
        filled = sum(d.numel() for d, _ in pairs if d is not None)
        return cls(staging, flat, strided, scale_staging, scales, filled)

    def run(self, staged: tuple[torch.Tensor, ...], scalings: torch.Tensor) -> None:
        """Copy the blocks ``staged`` and the ``scalings`` (of an adapter of this plan's layout) into the
        slot."""
        at = 0
        for block in staged:
            self.staging[at : at + block.numel()].copy_(block, non_blocking=True)
            at += block.numel()
        self.scale_staging.copy_(scalings, non_blocking=True)
        for dst, src in (self.flat, self.strided, self.scales):
            if dst:
                torch._foreach_copy_(dst, src, non_blocking=True)


class UploadPlans:
    """The device staging buffers a pool's staged uploads are copied through, and their upload plans,
    cached per (slot, staged layout), LRU, at most ``max_plans``.

    The buffers are kept and grown to the largest adapter rather than allocated per upload (84 MB for a
    Mistral-7B rank-16 adapter, where device memory is mostly KV cache); reusing them is safe because
    uploads are ordered on one stream. Plans hold views of the buffers, so growing one drops them all."""

    def __init__(self, device: torch.device, max_plans: int) -> None:
        self.device = device
        self.max_plans = max_plans
        self.plans: OrderedDict[tuple[int, int], UploadPlan] = OrderedDict()
        self._staging: torch.Tensor | None = None
        self._scale_staging: torch.Tensor | None = None

    def _grown(
        self, buf: torch.Tensor | None, numel: int, dtype: torch.dtype, stream: torch.cuda.Stream | None
    ) -> torch.Tensor:
        if buf is not None and buf.numel() >= numel and buf.dtype == dtype:
            return buf
        self.plans.clear()  # their chunks are views of the old buffer
        if buf is not None and stream is not None:
            # Loads still queued on the upload stream may read the old buffer: its memory waits for them.
            buf.record_stream(stream)
        return torch.empty(numel, dtype=dtype, device=self.device)

    def get(
        self,
        slot: int,
        adapter: LoadedAdapter,
        scalings: torch.Tensor,
        stream: torch.cuda.Stream | None,
        slot_pairs: Callable[[], list[Pair]],
        scale_pairs: Callable[[], list[tuple[torch.Tensor | None, int]]],
    ) -> UploadPlan:
        """The upload plan of a staged adapter (``scalings``: its :func:`scalings_of`) into ``slot``:
        cached per (slot, layout) when the adapter was staged by :func:`flatten` (which sets its layout
        id); built from ``slot_pairs()`` and ``scale_pairs()`` and checked otherwise. ``stream``: the
        upload stream loads are queued on, if any."""
        staged = adapter.staged
        numel = sum(b.numel() for b in staged)
        self._staging = self._grown(self._staging, numel, staged[0].dtype, stream)
        self._scale_staging = self._grown(self._scale_staging, scalings.numel(), torch.float32, stream)
        key = (slot, adapter.staged_layout)
        plan = self.plans.get(key) if adapter.staged_layout is not None else None
        if plan is not None:
            first = next(t for w in adapter.weights.values() for t in (*w.A, *w.B) if t is not None)
            if first.data_ptr() != staged[0].data_ptr():  # weights swapped under a kept layout id
                raise ValueError("an adapter tensor is not where its staged blocks hold it")
            self.plans.move_to_end(key)
            return plan
        plan = UploadPlan.build(
            slot_pairs(),
            staged,
            self._staging[:numel],
            scale_pairs(),
            self._scale_staging[: scalings.numel()],
        )
        if adapter.staged_layout is not None:
            self.plans[key] = plan
            while len(self.plans) > self.max_plans:
                self.plans.popitem(last=False)
        return plan

    def clear(self) -> None:
        self.plans.clear()
        self._staging = self._scale_staging = None


def copy_scalings(
    keys: Iterable[tuple[int, str]],
    scale_views: list[torch.Tensor],
    adapter: LoadedAdapter,
    device: torch.device,
) -> None:
    """An unstaged adapter's scalings into a slot's ``scale_views`` (one per module, in the order of
    ``keys``): all in one host tensor (pinned on CUDA) and one host-to-device copy, then one multi-tensor
    copy on the device (a copy per module from the host is a launch each)."""
    scale_dst: list[torch.Tensor] = []
    scale_values: list[float] = []
    for key, view in zip(keys, scale_views):
        w = adapter.weights.get(key)
        if w is not None:
            scale_dst.append(view)
            scale_values += [float(sc) if a is not None else 0.0 for a, sc in zip(w.A, w.scalings)]
    if scale_dst:
        values = torch.tensor(scale_values, dtype=torch.float32)
        if device.type == "cuda":
            values = values.pin_memory().to(device, non_blocking=True)
        torch._foreach_copy_(scale_dst, list(values.split([t.numel() for t in scale_dst])))

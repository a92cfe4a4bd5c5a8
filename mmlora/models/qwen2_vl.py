"""Qwen2-VL (``Qwen2VLForConditionalGeneration``): a Qwen2 language tower with M-RoPE, fed by a vision tower.

Prompt preparation (``prepare_prompt``, at ``add_request``): images are decoded (``mmlora.multimodal``)
and preprocessed by transformers' Qwen2-VL image processor; every ``<|image_pad|>`` of the text (usually
written ``<|vision_start|><|image_pad|><|vision_end|>``) expands to its image's merged-patch count; a
text without placeholders gets one placeholder per image in front. The M-RoPE positions (t, h, w) of
the whole prompt are computed once, as HF's ``get_rope_index``; a token after the prompt (decode, or
recomputed output after preemption) at index i has position i + rope_delta on all three axes.

Each forward (``multimodal_inputs``, called by the model runner): the vision tower runs once over the
images of every request whose chunk covers image tokens and whose features are not cached yet; the
features stay on the request's ``Qwen2VLInputs`` until its last image token is prefilled, and each
prefill chunk takes the rows it covers. LoRA applies to the language tower only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mmlora.forward.batch import ForwardBatch
from mmlora.layers.rotary import RotaryEmbedding, rope_parameters
from mmlora.models.base import CausalLM
from mmlora.models.llama import LlamaForCausalLM, LlamaModel
from mmlora.models.qwen2_vl_vision import Qwen2VLVisionTower
from mmlora.multimodal.images import load_image

# One image slot in a text: the pad token, with the vision start/end markers when written.
_SLOT_RE = re.compile(r"(<\|vision_start\|>)?<\|image_pad\|>(<\|vision_end\|>)?")
MAX_IMAGES_PER_REQUEST = 64


@dataclass
class Qwen2VLInputs:
    """A request's images, prepared once.

    pixel_values   [N, C * tp * p * p] fp32 CPU patches of all images, in image order
    grid_thw       patch grid (t, h, w) of each image
    spans          (start, length) of each image's ``<|image_pad|>`` run in the prompt
    positions      [3, L] int64 CPU M-RoPE positions of the prompt
    rope_delta     position of prompt index i >= L is i + rope_delta
    features       [sum(length), H] vision features on the device while needed, else None
    """

    pixel_values: torch.Tensor
    grid_thw: list[tuple[int, int, int]]
    spans: list[tuple[int, int]]
    positions: torch.Tensor
    rope_delta: int
    features: torch.Tensor | None = None

    @property
    def image_end(self) -> int:
        return max(s + n for s, n in self.spans)


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal RoPE: positions [3, T] (t, h, w); frequency section i of ``mrope_section`` follows axis i.
    1-D positions [T] (decode graphs, text-only batches) mean all three axes are equal. The per-forward
    memo of cos/sin and the rotation itself are RotaryEmbedding's; only the gather differs."""

    def __init__(self, head_dim: int, max_positions: int, params: dict[str, Any]) -> None:
        if params.get("rope_type", "default") not in ("default", "mrope"):
            raise ValueError(
                f"rope_type {params['rope_type']!r} is not supported for Qwen2-VL (default only)"
            )
        super().__init__(head_dim, max_positions, {**params, "rope_type": "default"})
        self.section = [int(s) for s in params.get("mrope_section", [16, 24, 24])]
        if sum(self.section) != head_dim // 2:
            raise ValueError(f"mrope_section {self.section} must sum to head_dim / 2 = {head_dim // 2}")

    def _gather(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # fp32 half-width tables: each section picks its axis before the cast to dtype.
        if self._cache is None or self._cache[0].device != positions.device:
            t = torch.arange(self.max_positions, device=positions.device, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq.to(positions.device))
            self._cache = (freqs.cos(), freqs.sin())
        out = []
        for table in self._cache:
            if positions.dim() == 1:  # text-only decode: all three axes equal, every section reads the same
                half = table[positions]
            else:
                per_axis = table[positions]  # [3, T, D/2]
                parts = [per_axis[i % 3, :, lo:hi] for i, (lo, hi) in enumerate(_bounds(self.section))]
                half = torch.cat(parts, dim=-1)
            out.append(torch.cat((half, half), dim=-1).to(dtype))
        return out[0], out[1]


def _bounds(sizes: list[int]) -> list[tuple[int, int]]:
    out, lo = [], 0
    for s in sizes:
        out.append((lo, lo + s))
        lo += s
    return out


class Qwen2VLForConditionalGeneration(CausalLM):
    hf_architectures = ("Qwen2VLForConditionalGeneration",)
    hf_model_types = ("qwen2_vl",)
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    lora_module_parents = LlamaForCausalLM.lora_module_parents
    lora_target_paths = LlamaForCausalLM.lora_target_paths
    lora_layers_prefix = "model.language_model.layers"
    lora_refused_prefixes = (
        ("model.visual", "the vision tower"),
        ("visual", "the vision tower"),
        ("model.language_model.embed_tokens", "the token embeddings"),
    )
    is_multimodal = True

    def __init__(self, hf_config: Any) -> None:
        super().__init__(hf_config)
        text = hf_config.text_config
        vision = hf_config.vision_config
        if vision.hidden_size != text.hidden_size:
            raise ValueError(
                f"vision_config.hidden_size {vision.hidden_size} != text hidden_size {text.hidden_size}"
            )
        self.model = LlamaModel(text, qkv_bias=True)
        head_dim = text.hidden_size // text.num_attention_heads
        rotary = MRotaryEmbedding(head_dim, text.max_position_embeddings, rope_parameters(text))
        for layer in self.model.layers:
            layer.self_attn.rotary = rotary
        self.visual = Qwen2VLVisionTower(vision)
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        if getattr(hf_config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.merge = vision.spatial_merge_size
        self.vocab_size = text.vocab_size
        self.image_token_id = int(hf_config.image_token_id)
        self.vision_start_id = int(hf_config.vision_start_token_id)
        self.vision_end_id = int(hf_config.vision_end_token_id)
        self.image_processor: Any = None

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    def map_weight_name(self, name: str) -> tuple[str, int | None]:
        # transformers >= 5 names the towers model.language_model / model.visual; checkpoints on disk
        # (and our modules) use model.* / visual.*.
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model.") :]
        elif name.startswith("model.visual."):
            name = name[len("model.") :]
        return super().map_weight_name(name)

    # ---- preprocessing ----------------------------------------------------------------------------

    def set_image_processor(self, processor: Any) -> None:
        """Use ``processor`` (a transformers Qwen2-VL image processor); its patching must match the tower."""
        vcfg = self.config.vision_config
        got = (processor.patch_size, processor.temporal_patch_size, processor.merge_size)
        want = (vcfg.patch_size, vcfg.temporal_patch_size, vcfg.spatial_merge_size)
        if tuple(got) != tuple(want):
            raise ValueError(
                f"image processor patch/temporal/merge sizes {got} do not match the model's {want}"
            )
        self.image_processor = processor

    def _processor(self) -> Any:
        if self.image_processor is None:
            from mmlora.multimodal.processor import load_image_processor

            # A checkpoint folder (the config's name_or_path) may hold its preprocessor_config.json.
            folder = getattr(self.config, "name_or_path", None) or None
            self.set_image_processor(load_image_processor(folder, self.config.vision_config))
        return self.image_processor

    def prepare_prompt(
        self, tokenizer: Any, prompt: str | None, input_ids: Any, images: list[Any]
    ) -> tuple[list[int], Qwen2VLInputs | None]:
        """Token ids with image placeholders expanded, and the request's prepared images (None: text only)."""
        if len(images) > MAX_IMAGES_PER_REQUEST:
            raise ValueError(f"images: {len(images)} images, more than {MAX_IMAGES_PER_REQUEST} per request")
        pil = [load_image(im, name=f"images[{i}]") for i, im in enumerate(images)]
        ids = self._ids_with_slots(tokenizer, prompt, input_ids, len(pil))
        if not ids:
            raise ValueError("prompt: empty")
        if not pil:
            return ids, None
        try:
            out = self._processor()(images=pil, return_tensors="pt")
        except ValueError as e:  # e.g. an aspect ratio beyond what the processor resizes
            raise ValueError(f"images: cannot preprocess: {e}") from None
        grid = [tuple(int(v) for v in row) for row in out["image_grid_thw"].tolist()]
        counts = [t * h * w // self.merge**2 for t, h, w in grid]
        expanded, spans = [], []
        k = 0
        for tok in ids:
            if tok == self.image_token_id:
                spans.append((len(expanded), counts[k]))
                expanded.extend([self.image_token_id] * counts[k])
                k += 1
            else:
                expanded.append(tok)
        positions, delta = self._mrope_positions(len(expanded), spans, grid)
        pixels = out["pixel_values"].to(torch.float32).contiguous()
        return expanded, Qwen2VLInputs(pixels, grid, spans, positions, delta)

    def _ids_with_slots(
        self, tokenizer: Any, prompt: str | None, input_ids: Any, num_images: int
    ) -> list[int]:
        """Prompt ids with one ``image_token_id`` per image slot (expanded later)."""
        slot = [self.vision_start_id, self.image_token_id, self.vision_end_id]
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError(f"text: expected a string, got {type(prompt).__name__}")
            if tokenizer is None:
                raise ValueError("text: this model has no tokenizer; give input_ids")
            pieces = _SLOT_RE.split(prompt)  # text, start?, end?, text, start?, end?, ..., text
            texts, starts, ends = pieces[0::3], pieces[1::3], pieces[2::3]
            slots = len(starts)
            ids: list[int] = []
            if slots == 0:
                ids.extend(slot * num_images)
            for i, piece in enumerate(texts):
                if piece:
                    ids.extend(tokenizer(piece, add_special_tokens=False)["input_ids"])
                if i < slots:
                    ids.extend([self.vision_start_id] if starts[i] else [])
                    ids.append(self.image_token_id)
                    ids.extend([self.vision_end_id] if ends[i] else [])
        else:
            ids = list(input_ids)
            if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"input_ids: every id must be an integer in [0, {self.vocab_size})")
            slots = ids.count(self.image_token_id)
            if slots == 0:
                ids = slot * num_images + ids
        found = ids.count(self.image_token_id)
        if found != num_images:
            raise ValueError(
                f"images: the prompt has {found} image placeholder(s) (<|image_pad|>) but {num_images} image(s) "
                "were given; give one placeholder per image, or none to put the images first"
            )
        for a, b in zip(ids, ids[1:]):
            if a == b == self.image_token_id:
                raise ValueError(
                    "prompt: adjacent image placeholders; separate images with <|vision_end|><|vision_start|>"
                )
        return ids

    def _mrope_positions(
        self, length: int, spans: list[tuple[int, int]], grid: list[tuple[int, int, int]]
    ) -> tuple[torch.Tensor, int]:
        """HF's ``get_rope_index`` for one prompt: text advances by 1, an image by max(h, w) / merge."""
        parts, pos, i = [], 0, 0
        for (start, count), (t, h, w) in zip(spans, grid):
            if start > i:
                parts.append(torch.arange(pos, pos + start - i).expand(3, -1))
                pos += start - i
            gh, gw = h // self.merge, w // self.merge
            tt = torch.arange(t).view(t, 1, 1).expand(t, gh, gw).flatten()
            hh = torch.arange(gh).view(1, gh, 1).expand(t, gh, gw).flatten()
            ww = torch.arange(gw).view(1, 1, gw).expand(t, gh, gw).flatten()
            parts.append(torch.stack([tt, hh, ww]) + pos)
            pos += max(h, w) // self.merge
            i = start + count
        if length > i:
            parts.append(torch.arange(pos, pos + length - i).expand(3, -1))
        positions = torch.cat(parts, dim=1).to(torch.int64)
        return positions, int(positions.max()) + 1 - length

    # ---- per-forward inputs -----------------------------------------------------------------------

    @staticmethod
    def positions_for(mm: Qwen2VLInputs | None, start: int, n: int) -> torch.Tensor:
        """[3, n] M-RoPE positions of token indices start .. start + n - 1 of a request."""
        if mm is None:
            return torch.arange(start, start + n).expand(3, -1)
        length = mm.positions.shape[1]
        inside = mm.positions[:, start : min(start + n, length)]
        after = torch.arange(max(start, length), max(start + n, length)).expand(3, -1) + mm.rope_delta
        return torch.cat([inside, after], dim=1)

    def decode_position(self, mm_inputs: Qwen2VLInputs | None, index: int) -> int | None:
        """Past the prompt (and on its text tokens) the three M-RoPE axes agree: one position serves."""
        if mm_inputs is None:
            return index
        length = mm_inputs.positions.shape[1]
        if index >= length:
            return index + mm_inputs.rope_delta
        t, h, w = mm_inputs.positions[:, index].tolist()
        return t if t == h == w else None

    def multimodal_inputs(
        self, chunks: list[tuple[Qwen2VLInputs | None, int, int]], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """For the batch's (mm_inputs, start, n) chunks in order: positions [3, T], image features and their rows."""
        todo = [
            mm for mm, s, n in chunks if mm is not None and mm.features is None and _covers_image(mm, s, n)
        ]
        if todo:
            self._encode(todo, device)
        positions, rows, feats, offset = [], [], [], 0
        for mm, start, n in chunks:
            positions.append(self.positions_for(mm, start, n))
            if mm is not None and _covers_image(mm, start, n):
                feat_off = 0
                for s, count in mm.spans:
                    lo, hi = max(s, start), min(s + count, start + n)
                    if lo < hi:
                        rows.append(torch.arange(offset + lo - start, offset + hi - start))
                        feats.append(mm.features[feat_off + lo - s : feat_off + hi - s])
                    feat_off += count
                if start + n >= mm.image_end:
                    mm.features = None  # every image row is in the KV cache now
            offset += n
        pos = torch.cat(positions, dim=1).to(device, non_blocking=True)
        if not rows:
            return pos, None, None
        return pos, torch.cat(feats), torch.cat(rows).to(device, non_blocking=True)

    def _encode(self, todo: list[Qwen2VLInputs], device: torch.device) -> None:
        """One vision-tower pass over the images of several requests; features cached on each."""
        dtype = self.visual.patch_embed.proj.weight.dtype
        pixels = torch.cat([mm.pixel_values for mm in todo]).to(device=device, dtype=dtype)
        grid = [g for mm in todo for g in mm.grid_thw]
        feats = self.visual(pixels, grid)
        sizes = [sum(n for _, n in mm.spans) for mm in todo]
        for mm, f in zip(todo, feats.split(sizes)):
            mm.features = f


def _covers_image(mm: Qwen2VLInputs, start: int, n: int) -> bool:
    return any(s < start + n and start < s + count for s, count in mm.spans)

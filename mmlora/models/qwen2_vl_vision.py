"""The Qwen2-VL vision tower, computed as HF's ``Qwen2VisionTransformerPretrainedModel``.

Input: the image processor's flattened patches ``[N, C * temporal_patch * patch * patch]`` of several
images concatenated, already in spatial-merge block order, and ``grid_thw [num_images, 3]`` (patch grid
of each image). Output: merged features ``[N / merge**2, text hidden]``, one row per ``<|image_pad|>``
token, images in input order. Attention is full (non-causal) within each image frame, never across.
Parameter names follow HF's checkpoints (``patch_embed.proj``, ``blocks.<i>.attn.qkv``, ``merger.mlp.0``...).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from mmlora.layers.rotary import rotate_half
from mmlora.models.arch_config import VisionConfig

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.in_channels = cfg.in_channels
        self.temporal_patch_size = cfg.temporal_patch_size
        self.patch_size = cfg.patch_size
        self.embed_dim = cfg.embed_dim
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.embed_dim, kernel_size=kernel, stride=kernel, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = pixels.view(-1, self.in_channels, self.temporal_patch_size, self.patch_size, self.patch_size)
        return self.proj(x.to(self.proj.weight.dtype)).view(-1, self.embed_dim)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.embed_dim // cfg.num_heads
        self.qkv = nn.Linear(cfg.embed_dim, 3 * cfg.embed_dim, bias=True)
        self.proj = nn.Linear(cfg.embed_dim, cfg.embed_dim)

    def forward(
        self, x: torch.Tensor, seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).unbind(1)
        # Rotary in fp32, as HF does, then back to the activation dtype.
        c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
        qf, kf = q.float(), k.float()
        q = (qf * c + rotate_half(qf) * s).to(x.dtype)
        k = (kf * c + rotate_half(kf) * s).to(x.dtype)
        outs = []
        for qi, ki, vi in zip(q.split(seqlens), k.split(seqlens), v.split(seqlens)):
            o = F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1))
            outs.append(o.transpose(0, 1))
        return self.proj(torch.cat(outs).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        if cfg.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"vision_config.hidden_act {cfg.hidden_act!r} is not supported")
        hidden = int(cfg.embed_dim * cfg.mlp_ratio)
        self.fc1 = nn.Linear(cfg.embed_dim, hidden)
        self.fc2 = nn.Linear(hidden, cfg.embed_dim)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.embed_dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.embed_dim, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(
        self, x: torch.Tensor, seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm, then each merge x merge block of patches (consecutive rows) -> one text-sized vector."""

    def __init__(self, out_dim: int, context_dim: int, merge: int) -> None:
        super().__init__()
        self.hidden = context_dim * merge**2
        self.ln_q = nn.LayerNorm(context_dim, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, out_dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class Qwen2VLVisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.merge = cfg.spatial_merge_size
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg.out_hidden_size, cfg.embed_dim, self.merge)
        head_dim = cfg.embed_dim // cfg.num_heads
        theta = cfg.rope_theta
        # Axial 2D RoPE: a quarter of the head dim rotates with the row, a quarter with the column.
        spatial = head_dim // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        self.inv_freq = inv_freq  # plain fp32 attribute: model.to(bfloat16) must not round it

    def _rotary(
        self, grid_thw: list[tuple[int, int, int]], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.merge
        ids = []
        for t, h, w in grid_thw:
            hpos = torch.arange(h, device=device).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
            wpos = torch.arange(w, device=device).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
            # Block-major order: the processor emits each merge x merge block's patches consecutively.
            hpos = hpos.transpose(1, 2).flatten()
            wpos = wpos.transpose(1, 2).flatten()
            ids.append(torch.stack([hpos, wpos], dim=-1).repeat(t, 1))
        pos = torch.cat(ids)  # [N, 2]
        freqs = pos[..., None].float() * self.inv_freq.to(device)  # [N, 2, head_dim / 4]
        emb = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        emb = torch.cat([emb, emb], dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, pixels: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        x = self.patch_embed(pixels)
        cos, sin = self._rotary(grid_thw, x.device)
        seqlens = [h * w for t, h, w in grid_thw for _ in range(t)]
        for block in self.blocks:
            x = block(x, seqlens, cos, sin)
        return self.merger(x)

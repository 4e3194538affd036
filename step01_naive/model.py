"""A small Llama-style decoder-only transformer that can be cut into pipeline stages.

The same class builds the whole model (for a single-device reference) or any
contiguous slice of it (one pipeline stage). Parameter names are global, e.g.
``layers.5.attn.wq.weight`` lives on whichever stage owns layer 5, so a stage's
gradients can be compared name by name with the whole model's.

Every piece is initialised from its own generator seeded by (seed, piece name),
so a stage built on rank 3 holds exactly the weights the whole model holds for
those layers, with no communication and no need to build the whole model first.
"""
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelConfig:
    """The whole model's shape. Every rank builds its layers from the same config, so a parameter has the same name
    and the same initial values on any layout."""
    vocab_size: int = 256  # byte-level tokens
    n_layers: int = 8
    hidden: int = 128
    n_heads: int = 4
    seq_len: int = 128
    mlp_ratio: float = 8 / 3  # SwiGLU keeps the parameter count of a 4x MLP
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        """The width of one attention head."""
        return self.hidden // self.n_heads

    @property
    def mlp_hidden(self) -> int:
        """mlp_ratio * hidden, rounded up to a multiple of 8 so that tensor parallelism can split it."""
        return -(-int(self.mlp_ratio * self.hidden) // 8) * 8


class RMSNorm(nn.Module):
    """Scale each vector to unit root-mean-square, then by a learned gain."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        rms = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (x.float() * rms).type_as(x) * self.weight


def rotary_tables(cfg: ModelConfig):
    """cos/sin tables for rotary position embedding, shape [seq_len, head_dim/2]."""
    half = cfg.head_dim // 2
    freqs = cfg.rope_base ** (-torch.arange(half, dtype=torch.float32) / half)
    angles = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin):
    """Rotate each (even, odd) pair of channels of x [B, heads, T, head_dim] by its position's angle."""
    t = x.shape[-2]
    cos, sin = cos[:t].to(x.dtype), sin[:t].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.flatten(-2)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary position embedding."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.wq = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.wv = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.wo = nn.Linear(cfg.hidden, cfg.hidden, bias=False)

    def forward(self, x, cos, sin):
        b, t, h = x.shape  # [batch, seq_len, hidden]

        def heads(proj):  # [b, t, h] -> [b, heads, t, head_dim]
            return proj(x).view(b, t, self.n_heads, -1).transpose(1, 2)

        q = apply_rotary(heads(self.wq), cos, sin)
        k = apply_rotary(heads(self.wk), cos, sin)
        out = F.scaled_dot_product_attention(q, k, heads(self.wv), is_causal=True)  # [b, heads, t, head_dim]
        return self.wo(out.transpose(1, 2).reshape(b, t, h))  # heads side by side again: [b, t, h]


class SwiGLU(nn.Module):
    """The gated MLP of Llama: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden, cfg.mlp_hidden, bias=False)
        self.up = nn.Linear(cfg.hidden, cfg.mlp_hidden, bias=False)
        self.down = nn.Linear(cfg.mlp_hidden, cfg.hidden, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


def split_layers(n_layers: int, n_stages: int):
    """Layer indices of each stage; the remainder goes to the first stages.

    >>> split_layers(5, 2)
    [[0, 1, 2], [3, 4]]
    """
    base, extra = divmod(n_layers, n_stages)
    bounds, start = [], 0
    for stage in range(n_stages):
        size = base + (1 if stage < extra else 0)
        bounds.append(list(range(start, start + size)))
        start += size
    return bounds


class Transformer(nn.Module):
    """The whole model, or one pipeline stage of it.

    layer_ids: which decoder layers this piece holds (default: all).
    first: holds the token embedding, so it takes token ids as input.
    last: holds the final norm and the LM head, so it returns logits.
    A middle stage maps hidden states [B, T, hidden] to hidden states.
    """

    def __init__(self, cfg: ModelConfig, layer_ids=None, first=True, last=True, seed=0):
        super().__init__()
        self.cfg, self.first, self.last = cfg, first, last
        self.layer_ids = list(range(cfg.n_layers)) if layer_ids is None else list(layer_ids)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden) if first else None
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg) for i in self.layer_ids})
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps) if last else None
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False) if last else None
        cos, sin = rotary_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int):
        """Normal(0, 0.02) matrices, residual outputs scaled by 1/sqrt(2 * layers), unit norms.

        Each parameter draws from a generator seeded by its global name, so the
        values do not depend on how the model is cut into stages.
        """
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                std = residual_std if name.endswith(("wo.weight", "down.weight")) else 0.02
                param.copy_(torch.randn(param.shape, generator=gen) * std)

    def forward(self, x):
        if self.first:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x, self.rope_cos, self.rope_sin)
        if self.last:
            x = self.head(self.norm(x))
        return x


def lm_loss(logits, targets):
    """Mean next-token cross-entropy over every position of the batch."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))

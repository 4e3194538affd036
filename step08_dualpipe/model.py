"""A small Llama-style decoder-only transformer that can be cut into pipeline stages.

The same class builds the whole model (for a single-device reference) or any
contiguous slice of it (one pipeline stage). Parameter names are global, e.g.
``layers.5.attn.wq.weight`` lives on whichever stage owns layer 5, so a stage's
gradients can be compared name by name with the whole model's.

Every piece is initialised from its own generator seeded by (seed, piece name),
so a stage built on rank 3 holds exactly the weights the whole model holds for
those layers, with no communication and no need to build the whole model first.

Step 06 splits every matrix across a tensor-parallel (TP) group (see
tensor_parallel.py): attention by heads, the MLP by its hidden width, the
embedding and the LM head by vocabulary range. A TP rank draws the whole
parameter from its generator and keeps its slice, so its shard is exactly the
single-device parameter's slice. With TPGroup() (one device) the layers are
plain linear layers and this is step 05's model.
"""
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from tensor_parallel import (ColumnParallelLinear, RowParallelLinear, TPGroup, VocabParallelEmbedding,
                             copy_to_tp_region, vocab_parallel_cross_entropy)
from weight_grad_store import linear
from experts import EPGroup, MoE


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
    tie_embeddings: bool = False  # the LM head reuses the embedding matrix
    experts: int = 0  # step 08, experts.py: a mixture of this many SwiGLU experts per layer (0: one dense SwiGLU)
    top_k: int = 1  # the experts each token goes to

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
    """Causal multi-head self-attention with rotary position embedding, split by heads over TP.

    wq, wk, wv are column-parallel (each rank computes its heads' q, k, v), wo row-parallel
    (each rank's heads contribute a partial output, summed by g): heads never mix before wo.
    """

    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        self.n_heads, self.tp = cfg.n_heads // tp.size, tp  # this rank's heads
        self.wq = ColumnParallelLinear(cfg.hidden, cfg.hidden, tp)
        self.wk = ColumnParallelLinear(cfg.hidden, cfg.hidden, tp)
        self.wv = ColumnParallelLinear(cfg.hidden, cfg.hidden, tp)
        self.wo = RowParallelLinear(cfg.hidden, cfg.hidden, tp)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape  # [batch, seq_len, hidden]
        x = copy_to_tp_region(x, self.tp)  # f: one backward all-reduce for q, k and v together

        def heads(proj):  # [b, t, h] -> [b, heads / tp, t, head_dim]
            return proj(x).view(b, t, self.n_heads, -1).transpose(1, 2)

        q = apply_rotary(heads(self.wq), cos, sin)
        k = apply_rotary(heads(self.wk), cos, sin)
        out = F.scaled_dot_product_attention(q, k, heads(self.wv), is_causal=True)  # [b, heads / tp, t, head_dim]
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))  # this rank's heads side by side [b, t, h / tp]


class SwiGLU(nn.Module):
    """The gated MLP of Llama: down(silu(gate(x)) * up(x)), split over TP by its hidden width.

    gate and up are column-parallel, down row-parallel: silu and the product act feature by
    feature, so each rank's slice of the width stays on that rank, with no communication inside.
    """

    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.gate = ColumnParallelLinear(cfg.hidden, cfg.mlp_hidden, tp)
        self.up = ColumnParallelLinear(cfg.hidden, cfg.mlp_hidden, tp)
        self.down = RowParallelLinear(cfg.mlp_hidden, cfg.hidden, tp)

    def forward(self, x):  # [b, t, h] -> [b, t, mlp_hidden / tp] -> [b, t, h]
        x = copy_to_tp_region(x, self.tp)  # f
        return self.down(F.silu(self.gate(x)) * self.up(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)).

    The norms are replicated on every TP rank: their input is the same full activation everywhere.
    With cfg.experts (step 08) the MLP is a mixture of SwiGLU experts, this rank's share of them (experts.py).
    """

    def __init__(self, cfg: ModelConfig, tp: TPGroup, ep: EPGroup = EPGroup(), layer: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg, tp)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = MoE(cfg.hidden, cfg.experts, cfg.top_k, ep, lambda: SwiGLU(cfg, TPGroup()), layer) \
            if cfg.experts else SwiGLU(cfg, tp)

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
    """The whole model, or one pipeline stage of it, or this TP rank's shard of either.

    layer_ids: which decoder layers this piece holds (default: all).
    first: holds the token embedding, so it takes token ids as input.
    last: holds the final norm and the LM head, so it returns logits (this TP rank's vocabulary slice).
    A middle stage maps hidden states [B, T, hidden] to hidden states.
    tp: the tensor-parallel group this piece is split over (default: one device).
    ep: with experts, the expert-parallel group whose share of the experts this piece holds (default: all).

    With cfg.tie_embeddings the head is the embedding matrix. A last stage that is not also the
    first keeps its own copy of it, drawn from the same generator, so equal to the first stage's;
    it is marked `shared` and the two copies' gradients are summed after the backward
    (finalize_grads.py), as Megatron-LM does.
    """

    def __init__(self, cfg: ModelConfig, layer_ids=None, first=True, last=True, seed=0, tp: TPGroup = None,
                 ep: EPGroup = EPGroup()):
        super().__init__()
        self.cfg, self.first, self.last, self.tp = cfg, first, last, tp or TPGroup()
        self.layer_ids = list(range(cfg.n_layers)) if layer_ids is None else list(layer_ids)
        tied_head = last and cfg.tie_embeddings
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden, self.tp) if first or tied_head else None
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, self.tp, ep, i) for i in self.layer_ids})
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps) if last else None
        self.head = ColumnParallelLinear(cfg.hidden, cfg.vocab_size, self.tp) if last and not tied_head else None
        if tied_head and not first:
            self.embed.weight.shared = True  # a copy of the first stage's matrix: count it once (step 07)
        cos, sin = rotary_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int):
        """Normal(0, 0.02) matrices, residual outputs scaled by 1/sqrt(2 * layers), unit norms.

        Each parameter draws from a generator seeded by its global name, so the
        values do not depend on how the model is cut into stages. A TP shard draws
        the whole parameter and keeps its slice: build the full weight, then slice.
        """
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            std = residual_std if name.endswith(("wo.weight", "down.weight")) else 0.02
            dim = getattr(param, "tp_split_dim", None)
            shape = [n * self.tp.size if d == dim else n for d, n in enumerate(param.shape)]
            full = torch.randn(shape, generator=gen) * std
            param.copy_(full if dim is None else full.chunk(self.tp.size, dim)[self.tp.rank])

    def logits(self, x):  # [b, T, hidden] -> [b, T, vocab / tp]
        """The column-parallel LM head: each TP rank scores its own vocabulary range."""
        x = copy_to_tp_region(self.norm(x), self.tp)  # f
        return linear(x, self.embed.weight if self.head is None else self.head.weight)

    def forward(self, x):
        if self.first:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x, self.rope_cos, self.rope_sin)
        return self.logits(x) if self.last else x


def lm_loss(logits, targets, tp: TPGroup = None):
    """Mean next-token cross-entropy over every position of the batch, from the full logits on one
    device, or from each TP rank's vocabulary slice of them (never gathered)."""
    if tp is not None and tp.size > 1:
        return vocab_parallel_cross_entropy(logits, targets, tp)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))

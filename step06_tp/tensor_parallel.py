"""Megatron-LM's tensor parallelism: one layer's matrices split across the ranks of a TP group.

A linear layer y = x W^T (W: [out, in]) can be split two ways:

    column-parallel   W split by output rows: rank r holds W[r-th out slice, :] and computes
                      its slice of y's features from the whole x. No communication.
    row-parallel      W split by input columns: rank r holds W[:, r-th in slice], takes its
                      slice of x's features and computes a partial y; the partial y's are
                      summed over the ranks (an all-reduce).

A column-parallel layer followed by a row-parallel one needs no communication in
between: the column layer's output slice is exactly the row layer's input slice.
So a block (attention, or the MLP) is one "TP region" that starts with the
operator f and ends with the operator g (Megatron-LM, Shoeybi et al. 2019, fig. 3):

    f  copy to the TP region       forward: identity      backward: all-reduce
    g  reduce from the TP region   forward: all-reduce    backward: identity

f's backward sums the input gradients that each rank's column slices produced;
g's forward sums the row slices' partial outputs. They are conjugate: one
all-reduce per block forward (g), one per block backward (f).

The vocabulary is split like a column-parallel layer: the embedding rows and
the LM head's rows are divided into contiguous vocabulary ranges, one per rank,
and the cross-entropy is computed from the vocabulary slices of the logits
without ever gathering them (vocab_parallel_cross_entropy).

Every parameter here records in `tp_split_dim` which dimension was split, so a
model can be initialised as slices of the single-device weights and the tests
can put the shards back together.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from support import timeline


@dataclass(frozen=True)
class TPGroup:
    """The ranks that share one layer's matrices: their process group, this rank's index among
    them, and their number (their all-reduces go on this process's timeline). TPGroup() is one device."""
    group: object = None
    rank: int = 0
    size: int = 1


def all_reduce(x, tp: TPGroup, what: str, op=dist.ReduceOp.SUM):
    """Reduce x over the TP group, in place, as one timeline box; nothing to do on one rank."""
    if tp.size > 1:
        with timeline.span("tp allreduce", what=what, bytes=x.numel() * x.element_size()):
            dist.all_reduce(x, op=op, group=tp.group)
    return x


class CopyToTPRegion(torch.autograd.Function):
    """f: every rank gets the whole input; in the backward each rank's slice contributed a partial
    input gradient, and their sum is the input's gradient."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        # grad is autograd's fresh sum of the column layers' input gradients: reducing it in place is safe.
        return all_reduce(grad.contiguous(), ctx.tp, "f backward"), None


class ReduceFromTPRegion(torch.autograd.Function):
    """g: sum the row-parallel partial outputs; each rank's partial output affects the loss only
    through the sum, so the sum's gradient passes to every rank unchanged."""

    @staticmethod
    def forward(ctx, x, tp):
        return all_reduce(x, tp, "g forward")  # x is a fresh matmul output nobody else holds

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp_region(x, tp: TPGroup):
    """Megatron's f: the identity forward and the all-reduce of the gradient backward; with one TP rank, x itself."""
    return CopyToTPRegion.apply(x, tp) if tp.size > 1 else x


def reduce_from_tp_region(x, tp: TPGroup):
    """Megatron's g: the all-reduce forward and the identity backward; with one TP rank, x itself."""
    return ReduceFromTPRegion.apply(x, tp) if tp.size > 1 else x


def shard(shape, dim: int, tp: TPGroup):
    """This rank's shape of a [*shape] parameter split along dim."""
    assert shape[dim] % tp.size == 0, f"{shape[dim]} does not split into {tp.size} equal parts"
    return [n // tp.size if d == dim else n for d, n in enumerate(shape)]


def split_parameter(shape, dim: int, tp: TPGroup) -> nn.Parameter:
    """An uninitialised parameter holding this rank's slice along dim (the model fills it in)."""
    param = nn.Parameter(torch.empty(shard(shape, dim, tp)))
    param.tp_split_dim = dim
    return param


class ColumnParallelLinear(nn.Module):
    """y[..., this rank's out slice] = x W_r^T, with W_r the rank's rows of W [out, in].

    Its input must already be in the TP region (f applied by the block): q, k and v read the
    same input, so one f, and one backward all-reduce, serves all three.
    """

    def __init__(self, in_features: int, out_features: int, tp: TPGroup):
        super().__init__()
        self.weight = split_parameter((out_features, in_features), 0, tp)

    def forward(self, x):  # [..., in] -> [..., out / tp]
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T, with W_r the rank's columns of W [out, in] and x_r the rank's
    slice of the input features; g sums the partial outputs, ending the TP region."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.weight = split_parameter((out_features, in_features), 1, tp)

    def forward(self, x):  # [..., in / tp] -> [..., out], the same on every rank
        return reduce_from_tp_region(F.linear(x, self.weight), self.tp)


def vocab_range(vocab_size: int, tp: TPGroup):
    """The token ids [start, end) whose rows this rank holds."""
    per_rank = vocab_size // tp.size
    return tp.rank * per_rank, (tp.rank + 1) * per_rank


class VocabParallelEmbedding(nn.Module):
    """Rank r holds the embedding rows of its vocabulary range. A token outside the range gets a zero
    vector here; exactly one rank holds its row, so the all-reduce (g) gives every rank the row."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup):
        super().__init__()
        self.tp, self.start, self.end = tp, *vocab_range(vocab_size, tp)
        self.weight = split_parameter((vocab_size, hidden), 0, tp)

    def forward(self, tokens):  # [b, T] token ids -> [b, T, hidden]
        if self.tp.size == 1:
            return F.embedding(tokens, self.weight)
        outside = (tokens < self.start) | (tokens >= self.end)
        rows = F.embedding((tokens - self.start).masked_fill(outside, 0), self.weight)
        return reduce_from_tp_region(rows.masked_fill(outside.unsqueeze(-1), 0.0), self.tp)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from vocabulary slices of the logits, as Megatron-LM computes it.

    loss = log(sum_v exp(z_v - M)) - (z_target - M), with M the row maximum (for stability).
    Three all-reduces of one number per token, never the [tokens, vocab] logits:
    MAX of the slices' maxima, SUM of the target logit (only its owner contributes), SUM of the
    slices' exp-sums. The backward is local: d loss / d z = softmax(z) - onehot(target).
    """

    @staticmethod
    def forward(ctx, logits, targets, tp):  # logits [N, vocab / tp], targets [N] -> loss [N]
        row_max = logits.max(dim=-1).values
        all_reduce(row_max, tp, "loss max", dist.ReduceOp.MAX)
        shifted = logits - row_max.unsqueeze(-1)
        start, end = vocab_range(logits.size(-1) * tp.size, tp)
        outside = (targets < start) | (targets >= end)
        local = (targets - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        all_reduce(target_logit, tp, "loss target logit")
        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        all_reduce(sum_exp, tp, "loss exp-sum")
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, outside)  # softmax slice
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss):  # [N] -> [N, vocab / tp]
        softmax, local, outside = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        return grad * grad_loss.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits, targets, tp: TPGroup):
    """Mean next-token cross-entropy from this rank's vocabulary slice of the logits [..., vocab / tp]."""
    flat = logits.reshape(-1, logits.size(-1)).float()
    return VocabParallelCrossEntropy.apply(flat, targets.reshape(-1), tp).mean()

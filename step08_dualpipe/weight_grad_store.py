"""The B/W split of a backward: the input gradient now, the weight gradients later.

A layer y = x W^T has two gradients:

    B:  dx = dy W          the previous layer, and the previous stage, wait for it
    W:  dW = dy^T x        nobody waits for it until the optimizer step

so a schedule may run B at once and W whenever the stage would otherwise idle (Qi et al. 2024, "Zero Bubble
Pipeline Parallelism"). As in DeepSeek's DualPipe, the split lives in the Linear layer itself: `Linear` is an
autograd function whose backward always returns dx, and either computes dW at once or, while deferring, queues it
as a closure in the WeightGradStore. Only forwards whose backward may be split (a splitting schedule's, inside
splittable()) build it; any other takes F.linear, whose backward is autograd's own and costs what step 07's does.
One backward's closures form one W, filed under its (chunk, microbatch); `pop` runs the oldest W, so W's run in the
order of their B's and each weight gradient sums its microbatches in an undivided backward's order.

Only the Linear weights wait: the RMSNorm gains and the embedding get theirs during B, from autograd; they are a
few vectors and one gather (a sliver of the backward), and splitting them would need an autograd function each.

With tensor parallelism the split needs nothing more: a column-parallel layer's input-gradient all-reduce is the
backward of f, an autograd node of its own that runs in B; a shard's weight gradient is local. With mixed precision
(step 07) W adds into the fp32 main_grad, as the gradient hook does for autograd's gradients.
"""
from collections import deque
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F


class WeightGradStore:
    """This process's weight gradients still to compute: one W per split B, keyed by (chunk, microbatch), oldest
    first; the one record of which W's wait. A schedule runs the oldest and ends its step with the store empty."""

    recording = False  # while True, linear builds the course's Linear, whose backward can defer dW
    deferring = False  # while True, linear's backward queues dW instead of computing it
    cache = []  # closures of the backward now running
    queue = deque()  # ((chunk, mb), closures) per split B, oldest first

    @classmethod
    def put(cls, closure):
        """Keep a weight-gradient closure of the backward now running (a Linear's dW)."""
        cls.cache.append(closure)

    @classmethod
    @contextmanager
    def splittable(cls, enabled: bool = True):
        """Within the block, forwards build Linear nodes, so that their backward can be split later."""
        cls.recording = enabled
        try:
            yield
        finally:
            cls.recording = False

    @classmethod
    @contextmanager
    def split(cls, key, enabled: bool = True):
        """Queue the weight gradients of the backward (a B) run within the block, as the W of key: (chunk, mb)."""
        cls.deferring = enabled
        try:
            yield
        finally:
            cls.deferring = False
        if enabled:
            cls.queue.append((key, cls.cache))
            cls.cache = []

    @classmethod
    def oldest(cls):
        """(chunk, microbatch) of the W that runs next."""
        assert cls.queue, "W before its B: no weight gradients are waiting"
        return cls.queue[0][0]

    @classmethod
    def pop(cls, key):
        """Run the W of key, which must be the oldest: W's run in the order of their B's."""
        assert cls.oldest() == key, f"W of {key} before the W of {cls.oldest()}, whose B ran first"
        for closure in cls.queue.popleft()[1]:
            closure()

    @classmethod
    def held(cls):
        """The tensors the newest W keeps alive until it runs: each Linear's output gradient and input."""
        return [t for closure in cls.queue[-1][1] for t in closure.args[1:]]


def accumulate_weight_grad(weight, grad_output, x):
    """dW = dy^T x, summed over the tokens, added to what the weight has (main_grad in half precision)."""
    # [tokens, out]^T @ [tokens, in] -> [out, in]
    grad = grad_output.reshape(-1, grad_output.size(-1)).t().mm(x.reshape(-1, x.size(-1)))
    if hasattr(weight, "main_grad"):  # step 07: the fp32 sum over microbatches
        weight.main_grad += grad.float()
    elif weight.grad is None:
        weight.grad = grad
    else:
        weight.grad += grad


class Linear(torch.autograd.Function):
    """y = x W^T whose backward returns dx at once and computes or queues dW."""

    @staticmethod
    def forward(ctx, x, weight):  # [..., in], [out, in] -> [..., out]
        ctx.save_for_backward(x)
        ctx.weight = weight  # itself, for W to add into: the meter's saved-tensor hook unpacks another object
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_output):
        (x,), weight = ctx.saved_tensors, ctx.weight
        grad_input = grad_output.matmul(weight)  # [..., out] @ [out, in] -> [..., in]: B
        if WeightGradStore.deferring:
            WeightGradStore.put(partial(accumulate_weight_grad, weight, grad_output, x))
        else:
            accumulate_weight_grad(weight, grad_output, x)
        return grad_input, None  # dW went to weight.grad (or main_grad) directly, now or in W


def linear(x, weight):
    """y = x W^T: the course's Linear where the backward may be split, else F.linear."""
    return Linear.apply(x, weight) if WeightGradStore.recording else F.linear(x, weight)

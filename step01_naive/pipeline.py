"""Naive model parallelism: the whole batch goes through the stages one at a time.

Stage s waits in `dist.recv` until stage s-1 has finished its forward; on the
way back, stage s waits until stage s+1 has finished its backward. At any
moment exactly one rank computes and the other p-1 wait, so each rank idles
for (p-1)/p of the step. Steps 02-05 exist to shrink that idle time.

Every schedule of this course is made of four verbs (Megatron-LM's names):

    recv_forward   receive the input activation from the previous stage
    send_forward   send the output activation to the next stage
    recv_backward  receive d(loss)/d(output) from the next stage
    send_backward  send d(loss)/d(input) to the previous stage

Here they are four small functions over blocking `dist.send` / `dist.recv`;
step 03 moves them into a class, PipelineComm, on non-blocking operations.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from model import lm_loss
from support.timeline import span


def bubble_formula(args):
    """(text, value): idle fraction of a rank when one batch visits p stages in turn."""
    return "(p-1)/p", (args.pp - 1) / args.pp


@dataclass
class Stage:
    """This rank's place in the pipeline and what it needs to run a batch."""
    model: torch.nn.Module
    index: int
    count: int
    shape: tuple  # hidden states exchanged between stages: [batch, seq_len, hidden]
    device: torch.device

    @property
    def is_first(self):
        return self.index == 0

    @property
    def is_last(self):
        return self.index == self.count - 1


def recv_forward(stage: Stage):
    """The previous stage's activation, into a new buffer: this stage waits here until that stage sends it."""
    x = torch.empty(stage.shape, device=stage.device)
    with span("recv", what="recv activation"):
        dist.recv(x, src=stage.index - 1)  # blocks until stage-1 has finished its forward
    return x


def send_forward(stage: Stage, out):
    """This stage's output to the next stage, which waits for it. Detached: only the values travel; the autograd
    graph stays on this rank."""
    with span("send", what="send activation"):
        dist.send(out.detach(), dst=stage.index + 1)


def recv_backward(stage: Stage):
    """The gradient of this stage's output, from the next stage: this stage waits here until that stage's backward
    sends it."""
    grad = torch.empty(stage.shape, device=stage.device)
    with span("recv", what="recv gradient"):
        dist.recv(grad, src=stage.index + 1)  # blocks until stage+1 has finished its backward
    return grad


def send_backward(stage: Stage, input_grad):
    """The gradient of this stage's input to the previous stage, which waits for it to run its backward."""
    with span("send", what="send gradient"):
        dist.send(input_grad, dst=stage.index - 1)


def forward_step(stage: Stage, tokens, targets):
    """Receive the input (or read tokens), run this stage, send the output on.

    Returns (stage input, stage output): the input is kept for its gradient,
    the output for the backward. On the last stage the output is the loss.
    """
    x = tokens if stage.is_first else recv_forward(stage).requires_grad_()
    with span("forward"):
        out = stage.model(x)  # [b, T] token ids or [b, T, h] -> [b, T, h], or [b, T, vocab] logits
        if stage.is_last:
            out = lm_loss(out, targets)
    if not stage.is_last:
        send_forward(stage, out)
    return x, out


def backward_step(stage: Stage, x, out):
    """Receive d(loss)/d(output) from the next stage, backpropagate, send d(loss)/d(input) back."""
    out_grad = None if stage.is_last else recv_backward(stage)  # the last stage starts from its loss
    with span("backward"):
        torch.autograd.backward(out, out_grad)
    if not stage.is_first:
        send_backward(stage, x.grad)


def naive_forward_backward(stage: Stage, inputs, targets):
    """One batch forward through all stages and backward again; returns the loss on the last stage."""
    x, out = forward_step(stage, inputs, targets)
    backward_step(stage, x, out)
    return out.detach() if stage.is_last else None

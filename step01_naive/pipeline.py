"""Naive model parallelism: the whole batch goes through the stages one at a time.

Stage s waits in `dist.recv` until stage s-1 has finished its forward; on the
way back, stage s waits until stage s+1 has finished its backward. At any
moment exactly one rank computes and the other p-1 wait, so each rank idles
for (p-1)/p of the step. Steps 02-05 exist to shrink that idle time.
"""
import torch
import torch.distributed as dist

from model import lm_loss


def bubble_formula(pp: int):
    """Idle fraction of a rank when one batch visits p stages in turn."""
    return "(p-1)/p", (pp - 1) / pp


def activation_shape(args, batch_rows: int):
    """Shape of the hidden states passed between stages; both sides know it in advance."""
    return (batch_rows, args.seq_len, args.hidden)


def forward_pass(model, stage, n_stages, inputs, targets, shape, device, timeline):
    """Receive the input (or read tokens), run this stage, send the output on.

    Returns (stage input, stage output): the input is kept for its gradient,
    the output for the backward. On the last stage the output is the loss.
    """
    if stage == 0:
        x = inputs
    else:
        x = torch.empty(shape, device=device)
        with timeline.span("recv", kind_of="activation"):
            dist.recv(x, src=stage - 1)  # blocks until stage-1 has finished its forward
        x.requires_grad_()
    with timeline.span("forward"):
        out = model(x)
        if stage == n_stages - 1:
            out = lm_loss(out, targets)
    if stage < n_stages - 1:
        with timeline.span("send", kind_of="activation"):
            dist.send(out.detach(), dst=stage + 1)
    return x, out


def backward_pass(stage, n_stages, x, out, device, timeline):
    """Receive d(loss)/d(output) from the next stage, backpropagate, send d(loss)/d(input) back."""
    if stage == n_stages - 1:
        with timeline.span("backward"):
            out.backward()
    else:
        grad = torch.empty_like(out)
        with timeline.span("recv", kind_of="gradient"):
            dist.recv(grad, src=stage + 1)  # blocks until stage+1 has finished its backward
        with timeline.span("backward"):
            out.backward(grad)
    if stage > 0:
        with timeline.span("send", kind_of="gradient"):
            dist.send(x.grad, dst=stage - 1)


def forward_backward(model, stage, n_stages, inputs, targets, args, device, timeline):
    """One batch forward through all stages and backward again; returns the loss on the last stage."""
    shape = activation_shape(args, args.batch_size)
    x, out = forward_pass(model, stage, n_stages, inputs, targets, shape, device, timeline)
    backward_pass(stage, n_stages, x, out, device, timeline)
    return out.detach() if stage == n_stages - 1 else None

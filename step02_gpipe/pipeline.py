"""GPipe: split the batch into microbatches, run all forwards, then all backwards.

With m microbatches, stage s can start microbatch i+1 while stage s+1 works on
microbatch i, so p stages overlap. The pipeline still has to fill (the first
p-1 forward slots of the last stage are empty) and drain (the same on the way
back), which leaves each rank idle for (p-1)/(m+p-1) of the step: the bubble.

Gradients are accumulated over the microbatches. Each microbatch loss is its
own mean over its tokens divided by m, so the sum of the m backward passes is
exactly the gradient of the mean loss over the whole batch (all microbatches
hold the same number of tokens).

--recompute (GPipe's re-materialisation): the forward runs without building
an autograd graph and keeps only the stage input; the backward runs the stage
forward again, this time with a graph, and backpropagates through it. Stored
activations fall from m graphs to m inputs plus one graph, for one more forward.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from model import lm_loss


def bubble_formula(pp: int, microbatches: int):
    """Idle fraction of each rank when m microbatches fill and drain p stages."""
    return "(p-1)/(m+p-1)", (pp - 1) / (microbatches + pp - 1)


@dataclass
class Stage:
    """This rank's place in the pipeline and what it needs to run a microbatch."""
    model: torch.nn.Module
    index: int
    count: int
    shape: tuple  # hidden states exchanged between stages, per microbatch
    device: torch.device
    recompute: bool

    @property
    def is_first(self):
        return self.index == 0

    @property
    def is_last(self):
        return self.index == self.count - 1


def run_stage(stage: Stage, x, target, microbatches: int):
    """The stage's computation; on the last stage it ends with this microbatch's share of the loss."""
    out = stage.model(x)
    return lm_loss(out, target) / microbatches if stage.is_last else out


def forward_step(stage: Stage, mb: int, tokens, target, microbatches, timeline, meter):
    """Receive microbatch mb's input (or read its tokens), run the stage, send the output on."""
    if stage.is_first:
        x = tokens
    else:
        x = torch.empty(stage.shape, device=stage.device)
        with timeline.span("recv", mb, kind_of="activation"):
            dist.recv(x, src=stage.index - 1)  # waits for stage-1's forward of mb
        x.requires_grad_(not stage.recompute)
    with timeline.span("forward", mb):
        if stage.recompute:
            meter.keep(mb, x)
            with torch.no_grad():
                out = run_stage(stage, x, target, microbatches)
        else:
            with meter.saving(mb):
                out = run_stage(stage, x, target, microbatches)
            meter.keep(mb, out)  # the stash holds the output until the backward
    if not stage.is_last:
        with timeline.span("send", mb, kind_of="activation"):
            dist.send(out.detach(), dst=stage.index + 1)
    return x, out


def backward_step(stage: Stage, mb: int, x, out, target, microbatches, timeline, meter):
    """Receive d(loss)/d(output) for mb, backpropagate, send d(loss)/d(input) to the previous stage."""
    grad = None
    if not stage.is_last:
        grad = torch.empty(stage.shape, device=stage.device)
        with timeline.span("recv", mb, kind_of="gradient"):
            dist.recv(grad, src=stage.index + 1)  # waits for stage+1's backward of mb
    if stage.recompute:
        with timeline.span("recompute", mb), meter.saving(mb), torch.enable_grad():
            x = x.detach().requires_grad_(not stage.is_first)
            out = run_stage(stage, x, target, microbatches)
    with timeline.span("backward", mb):
        out.backward(grad)
    meter.release(mb)
    if not stage.is_first:
        with timeline.span("send", mb, kind_of="gradient"):
            dist.send(x.grad, dst=stage.index - 1)


def gpipe_forward_backward(stage: Stage, inputs, targets, microbatches, timeline, meter):
    """All forwards, then all backwards, in microbatch order; returns the loss summed over microbatches."""
    mb_inputs, mb_targets = inputs.chunk(microbatches), targets.chunk(microbatches)
    stash, loss = [], None
    for mb in range(microbatches):
        x, out = forward_step(stage, mb, mb_inputs[mb], mb_targets[mb], microbatches, timeline, meter)
        if stage.is_last:
            loss = out.detach() if loss is None else loss + out.detach()
        # With recompute the backward rebuilds the output: holding it would pin one activation per microbatch.
        stash.append((x, None if stage.recompute else out))
    for mb, (x, out) in enumerate(stash):
        backward_step(stage, mb, x, out, mb_targets[mb], microbatches, timeline, meter)
        stash[mb] = None  # drop our references too, so the graph's memory can go
    return loss

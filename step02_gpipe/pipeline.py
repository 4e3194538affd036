"""GPipe: split the batch into microbatches, run all forwards, then all backwards.

With m microbatches, stage s can start microbatch i+1 while stage s+1 works on
microbatch i, so p stages overlap. The pipeline still has to fill (the first
p-1 forward slots of the last stage are empty) and drain (the same on the way
back), which leaves each rank idle for (p-1)/(m+p-1) of the step: the bubble.

Gradients are accumulated over the microbatches. The backward of each
microbatch starts from d(batch mean loss)/d(microbatch mean loss) = 1/m, so the
sum of the m backward passes is exactly the gradient of the mean loss over the
whole batch (all microbatches hold the same number of tokens).

--recompute (GPipe's re-materialisation): the forward runs without building
an autograd graph and keeps only the stage input; the backward runs the stage
forward again, this time with a graph, and backpropagates through it. Stored
activations fall from m graphs to m inputs plus one graph, for one more forward.

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

from support.memory import ActivationMeter
from model import lm_loss
from support.timeline import span


def bubble_formula(args):
    """(text, value): idle fraction of each rank when m microbatches fill and drain p stages."""
    return "(p-1)/(m+p-1)", (args.pp - 1) / (args.microbatches + args.pp - 1)


def peak_stored_microbatches(args, stage: int):
    """(text, value): the most microbatches whose activations `stage` holds at once: all of them."""
    return "m", args.microbatches


@dataclass
class Stage:
    """This rank's place in the pipeline and what it needs to run a microbatch."""
    model: torch.nn.Module
    index: int
    count: int
    shape: tuple  # hidden states exchanged between stages: [microbatch, seq_len, hidden]
    device: torch.device
    meter: ActivationMeter
    recompute: bool

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


def run_stage(stage: Stage, x, target):
    """The stage's computation; on the last stage it ends with the microbatch's mean loss."""
    out = stage.model(x)  # [b, T] token ids or [b, T, h] -> [b, T, h], or [b, T, vocab] logits
    return lm_loss(out, target) if stage.is_last else out


def forward_step(stage: Stage, mb: int, tokens, target):
    """Receive microbatch mb's input (or read its tokens), run the stage, send the output on.

    Returns (stage input, stage output): the input is kept for its gradient,
    the output for the backward. On the last stage the output is the loss.
    """
    x = tokens if stage.is_first else recv_forward(stage).requires_grad_(not stage.recompute)
    with span("forward", mb):
        if stage.recompute:
            stage.meter.keep(mb, x)  # only the input is stored
            with torch.no_grad():
                out = run_stage(stage, x, target)
        else:
            with stage.meter.saving(mb):
                out = run_stage(stage, x, target)
            stage.meter.keep(mb, out)  # the stash holds the output until the backward
    if not stage.is_last:
        send_forward(stage, out)
    return x, out


def backward_step(stage: Stage, mb: int, x, out, target, microbatches: int):
    """Receive d(loss)/d(output) for mb, backpropagate, send d(loss)/d(input) to the previous stage."""
    out_grad = None if stage.is_last else recv_backward(stage)
    if stage.recompute:
        with span("recompute", mb), stage.meter.saving(mb), torch.enable_grad():
            x = x.detach().requires_grad_(not stage.is_first)
            out = run_stage(stage, x, target)
    if stage.is_last:  # d(batch mean loss) / d(microbatch mean loss)
        out_grad = torch.full_like(out, 1 / microbatches)
    with span("backward", mb):
        torch.autograd.backward(out, out_grad)
    stage.meter.release(mb)
    if not stage.is_first:
        send_backward(stage, x.grad)


def gpipe_forward_backward(stage: Stage, microbatches):
    """All forwards, then all backwards, in microbatch order; returns the batch's mean loss (last stage).

    microbatches: [(tokens, targets)], m of them.
    """
    stash, loss_sum = [], None
    for mb, (tokens, target) in enumerate(microbatches):
        x, out = forward_step(stage, mb, tokens, target)
        if stage.is_last:
            loss_sum = out.detach() if loss_sum is None else loss_sum + out.detach()
        # With recompute the backward rebuilds the output: holding it would pin one activation per microbatch.
        stash.append((x, None if stage.recompute else out))
    for mb, (x, out) in enumerate(stash):
        backward_step(stage, mb, x, out, microbatches[mb][1], len(microbatches))
        stash[mb] = None  # drop our references too, so the graph's memory can go
    return None if loss_sum is None else loss_sum / len(microbatches)

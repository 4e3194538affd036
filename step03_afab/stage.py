"""One pipeline stage as a schedule sees it: run a microbatch forward, or backward.

The schedule decides *when*; the stage knows *how*:

    output = stage.forward(mb, input, target)
    input_grad = stage.backward(mb, input, output, output_grad)

On the last stage the output is this microbatch's share of the loss (its mean
divided by the number of microbatches, so that the accumulated gradients are
those of the mean loss over the whole batch) and output_grad is None.

With recompute (GPipe's re-materialisation), forward keeps no autograd graph,
only the input; backward runs the forward again with a graph first.
"""
import torch

from model import lm_loss


class PipelineStage:
    def __init__(self, model, is_first, is_last, microbatches, recompute, timeline, meter):
        self.model, self.is_first, self.is_last = model, is_first, is_last
        self.microbatches, self.recompute = microbatches, recompute
        self.timeline, self.meter = timeline, meter
        self.targets = {}  # microbatch -> targets, kept for the last stage's recompute

    def _run(self, x, target):
        out = self.model(x)
        return lm_loss(out, target) / self.microbatches if self.is_last else out

    def forward(self, mb, x, target):
        if not self.is_first and not self.recompute:
            x.requires_grad_()  # we need d(loss)/d(input) to send back
        with self.timeline.span("forward", mb):
            if not self.recompute:
                with self.meter.saving(mb):
                    out = self._run(x, target)
                self.meter.keep(mb, out)  # the schedule holds the output until the backward
                return out
            self.meter.keep(mb, x)
            self.targets[mb] = target
            with torch.no_grad():
                return self._run(x, target)

    def _recompute(self, mb, x):
        """Run the forward again, this time keeping the graph; returns (input, output)."""
        with self.timeline.span("recompute", mb), self.meter.saving(mb), torch.enable_grad():
            x = x.detach().requires_grad_(not self.is_first)
            return x, self._run(x, self.targets.pop(mb))

    def backward(self, mb, x, out, out_grad):
        """Backpropagate one microbatch through this stage; return d(loss)/d(input) (None on stage 0)."""
        if self.recompute:
            x, out = self._recompute(mb, x)
        with self.timeline.span("backward", mb):
            out.backward(out_grad)
        self.meter.release(mb)
        return None if self.is_first else x.grad

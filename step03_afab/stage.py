"""One pipeline stage as a schedule sees it: run a microbatch forward, or backward.

The schedule decides *when*; the stage knows *how*:

    output = stage.forward(mb, x, target)        # x: the received activation, or token ids on stage 0
    input_grad = stage.backward(mb, x, output, output_grad)

On the last stage the output is the microbatch's mean loss, and the schedule
passes output_grad = 1/m, the gradient of the batch's mean loss with respect to
one microbatch's mean loss: summed over the m backwards, the gradients are those
of the whole batch (all microbatches hold the same number of tokens).

With recompute (GPipe's re-materialisation) forward keeps no autograd graph;
the schedule keeps the input and calls `recompute_forward` to rebuild the graph
before the backward.

`chunk` numbers this rank's model chunks: with virtual stages (step 05) a rank holds several,
and `chunk` tells them apart in the activation meter and the timeline. The timeline
(timeline.span) and the activation meter only watch: off, the stage computes the same.
"""
import torch

from support.memory import ActivationMeter
from model import lm_loss
from support import timeline


class PipelineStage:
    """One model chunk of this rank, as a schedule drives it: the forward and the backward of one microbatch
    (see the module's docstring). It holds no schedule state: which microbatch runs when is the schedule's."""

    def __init__(self, model, *, chunk=0, recompute=False, meter=None):
        self.model, self.chunk, self.recompute = model, chunk, recompute
        self.is_first, self.is_last = model.first, model.last
        self.meter = meter or ActivationMeter(enabled=False)

    def _run(self, x, target):
        # [b, T] token ids or [b, T, h] -> [b, T, h], or [b, T, vocab] on the last stage
        out = self.model(x)
        return lm_loss(out, target) if self.is_last else out

    def forward(self, mb, x, target):
        """Microbatch mb through this stage: x is the received activation (the tokens on the first stage). Keeps what
        the backward needs; returns the output, the loss on the last stage."""
        key = (self.chunk, mb)  # what the meter counts: one (virtual) microbatch
        with timeline.span("forward", mb, chunk=self.chunk):
            if self.recompute:
                self.meter.keep(key, x)  # only the input is stored
                with torch.no_grad():
                    return self._run(x, target)
            if not self.is_first:
                x.requires_grad_()  # we need d(loss)/d(input) to send back
            with self.meter.saving(key):
                out = self._run(x, target)
            self.meter.keep(key, out)  # the schedule holds the output until the backward
            return out

    def recompute_forward(self, mb, x, target):
        """Run the forward again, this time keeping the graph; returns (input, output)."""
        with timeline.span("recompute", mb, chunk=self.chunk), self.meter.saving((self.chunk, mb)), \
                torch.enable_grad():
            x = x.detach().requires_grad_(not self.is_first)
            return x, self._run(x, target)

    def backward(self, mb, x, out, out_grad):
        """Backpropagate one microbatch through this stage; return d(loss)/d(input) (None on stage 0)."""
        with timeline.span("backward", mb, chunk=self.chunk):
            torch.autograd.backward(out, out_grad)
        self.meter.release((self.chunk, mb))
        return None if self.is_first else x.grad

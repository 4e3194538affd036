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

With deallocate (Megatron's deallocate_output_tensor) a sent output's values are
dropped, its autograd node kept: the next stage returns d(loss)/d(output), and a
stage's last operation (a residual add) saves nothing of its own output. PipeDream's
stage (pipedream.py) overrides two seams, weights(mb) and backward_done(mb).

`chunk` numbers this rank's model chunks: with virtual stages (step 05) a rank holds several,
and `chunk` tells them apart in the activation meter and the timeline. The timeline
(timeline.span) and the activation meter only watch: off, the stage computes the same.
"""
import torch
from torch.autograd import Variable
from torch.func import functional_call

from support.memory import ActivationMeter
from model import lm_loss
from support import timeline


def deallocate_output(out):
    """Keep out's autograd node, drop its values: the next stage holds them now."""
    assert out._base is None, "freeing a view would not free the memory of the tensor it views"
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def custom_backward(out, grad):
    """Megatron's custom_backward: out.backward(grad) checks that grad has out's shape, which
    deallocation shrank to one element; the autograd engine itself needs only out's graph node."""
    Variable._execution_engine.run_backward(tensors=(out,), grad_tensors=(grad,), keep_graph=False, create_graph=False,
                                            inputs=(), allow_unreachable=True, accumulate_grad=True)


class PipelineStage:
    """One model chunk of this rank, as a schedule drives it: the forward and the backward of one microbatch
    (see the module's docstring). It holds no schedule state: which microbatch runs when is the schedule's."""

    def __init__(self, model, *, chunk=0, recompute=False, deallocate=False, meter=None):
        self.model, self.chunk, self.recompute, self.deallocate = model, chunk, recompute, deallocate
        self.is_first, self.is_last = model.first, model.last
        self.meter = meter or ActivationMeter(enabled=False)

    def weights(self, mb):
        """The weights mb's forward and recompute run on, {name: tensor}; None: the model's own (PipeDream's vary)."""
        return None

    def backward_done(self, mb):
        """mb's backward has put its gradients in: nothing more to do (PipeDream updates here)."""

    def _run(self, x, target, weights=None):
        # [b, T] token ids or [b, T, h] -> [b, T, h], or [b, T, vocab] on the last stage
        out = self.model(x) if weights is None else functional_call(self.model, weights, (x,))
        return lm_loss(out, target, self.model.tp) if self.is_last else out  # TP: from vocabulary slices

    def forward(self, mb, x, target):
        """Microbatch mb through this stage: x is the received activation (the tokens on the first stage). Keeps what
        the backward needs; returns the output, the loss on the last stage."""
        key = (self.chunk, mb)  # what the meter counts: one (virtual) microbatch
        weights = self.weights(mb)
        with timeline.span("forward", mb, chunk=self.chunk):
            if self.recompute:
                self.meter.keep(key, x)  # only the input is stored
                with torch.no_grad():
                    return self._run(x, target, weights)
            if not self.is_first:
                x.requires_grad_()  # we need d(loss)/d(input) to send back
            with self.meter.saving(key, weights):
                out = self._run(x, target, weights)
            self.meter.keep(key, out)  # the schedule holds the output until the backward
            return out

    def recompute_forward(self, mb, x, target):
        """Run the forward again, this time keeping the graph; returns (input, output)."""
        weights = self.weights(mb)  # those the forward ran on
        with timeline.span("recompute", mb, chunk=self.chunk), self.meter.saving((self.chunk, mb), weights), \
                torch.enable_grad():
            x = x.detach().requires_grad_(not self.is_first)
            return x, self._run(x, target, weights)

    def deallocate_output(self, mb, out):
        """The output has been sent: free its storage (with --deallocate), keep its autograd graph."""
        if self.deallocate and not self.recompute:  # with recompute the output was never kept
            self.meter.forget((self.chunk, mb), out)
            deallocate_output(out)

    def backward(self, mb, x, out, out_grad):
        """Backpropagate one microbatch through this stage; return d(loss)/d(input) (None on stage 0)."""
        with timeline.span("backward", mb, chunk=self.chunk):
            custom_backward(out, out_grad)
            self.backward_done(mb)  # inside the span: PipeDream's update is timed as part of the backward
        self.meter.release((self.chunk, mb))
        return None if self.is_first else x.grad


class VirtualStages(torch.nn.ModuleList):
    """A rank's model chunks as one module, for the optimizer, the meters and the tests.

    Each chunk already names its parameters globally (layers.5.attn.wq.weight), so they are
    listed without the ModuleList's index prefix: the names match the whole model's.
    """

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        """Every chunk's parameters under their global names, without the ModuleList's index."""
        for chunk in self:
            yield from chunk.named_parameters(prefix, recurse, remove_duplicate)

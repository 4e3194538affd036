"""One pipeline stage as a schedule sees it: run a microbatch forward, or backward.

The schedule decides *when*; the stage knows *how*:

    output = stage.forward(mb, input, target)
    input_grad = stage.backward(mb, input, output, output_grad)

On the last stage the output is this microbatch's share of the loss (its mean
divided by the number of microbatches, so that the accumulated gradients are
those of the mean loss over the whole batch) and output_grad is None.

With recompute (GPipe's re-materialisation), forward keeps no autograd graph,
only the input; backward runs the forward again with a graph first.

With virtual stages a rank holds several such stages (model chunks); `chunk`
tells them apart in the activation meter and the timeline.

With deallocate (Megatron's deallocate_output_tensor), once the output has been
sent to the next stage its values are dropped: only its autograd node is needed
for the backward, since the next stage returns d(loss)/d(output) and the last
operation of a stage (a residual add) saves nothing of its own output.
"""
import torch
from torch.autograd import Variable

from model import lm_loss


class PipelineStage:
    def __init__(self, model, is_first, is_last, microbatches, recompute, deallocate, timeline, meter, chunk=0):
        self.model, self.is_first, self.is_last = model, is_first, is_last
        self.microbatches, self.recompute, self.deallocate = microbatches, recompute, deallocate
        self.timeline, self.meter, self.chunk = timeline, meter, chunk
        self.targets = {}  # microbatch -> targets, kept for the last stage's recompute

    def _key(self, mb):
        """What the meter counts: a (chunk, microbatch) pair, one virtual microbatch."""
        return (self.chunk, mb)

    def _run(self, x, target):
        out = self.model(x)
        return lm_loss(out, target) / self.microbatches if self.is_last else out

    def forward(self, mb, x, target):
        if not self.is_first and not self.recompute:
            x.requires_grad_()  # we need d(loss)/d(input) to send back
        with self.timeline.span("forward", mb, chunk=self.chunk):
            if not self.recompute:
                with self.meter.saving(self._key(mb)):
                    out = self._run(x, target)
                self.meter.keep(self._key(mb), out)  # the schedule holds the output until the backward
                return out
            self.meter.keep(self._key(mb), x)
            self.targets[mb] = target
            with torch.no_grad():
                return self._run(x, target)

    def deallocate_output(self, mb, out):
        """The output has been sent: free its storage, keep its autograd graph."""
        if self.deallocate and not self.is_last and not self.recompute:
            self.meter.forget(self._key(mb), out)
            out.data = torch.empty((1,), device=out.device, dtype=out.dtype)

    def _recompute(self, mb, x):
        """Run the forward again, this time keeping the graph; returns (input, output)."""
        with self.timeline.span("recompute", mb, chunk=self.chunk), self.meter.saving(self._key(mb)), \
                torch.enable_grad():
            x = x.detach().requires_grad_(not self.is_first)
            return x, self._run(x, self.targets.pop(mb))

    def backward(self, mb, x, out, out_grad):
        """Backpropagate one microbatch through this stage; return d(loss)/d(input) (None on stage 0)."""
        if self.recompute:
            x, out = self._recompute(mb, x)
        with self.timeline.span("backward", mb, chunk=self.chunk):
            if out_grad is None:
                out.backward()  # the last stage: out is the loss
            else:
                # out.backward(out_grad) would check out's shape, which deallocation shrank to one
                # element; the autograd engine itself only needs out's graph node and the gradient.
                Variable._execution_engine.run_backward(
                    tensors=(out,), grad_tensors=(out_grad,), keep_graph=False, create_graph=False,
                    inputs=(), allow_unreachable=True, accumulate_grad=True)
        self.meter.release(self._key(mb))
        return None if self.is_first else x.grad


class VirtualStages(torch.nn.ModuleList):
    """A rank's model chunks as one module, for the optimizer, the meters and the tests.

    Each chunk already names its parameters globally (layers.5.attn.wq.weight), so they are
    listed without the ModuleList's index prefix: the names match the whole model's.
    """

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        for chunk in self:
            yield from chunk.named_parameters(prefix, recurse, remove_duplicate)

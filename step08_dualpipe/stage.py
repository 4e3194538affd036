"""One pipeline stage as a schedule sees it: run a microbatch forward, or backward.

The schedule decides *when*; the stage knows *how*:

    output = stage.forward(mb, x, target)        # x: the received activation, or token ids on stage 0
    input_grad = stage.backward(mb, x, output, output_grad)

On the last stage the output is the microbatch's mean loss, and the schedule
passes output_grad = 1/m, the gradient of the batch's mean loss with respect to
one microbatch's mean loss: summed over the m backwards, the gradients are those
of the whole batch (all microbatches hold the same number of tokens).
Times S = grad_scale_func(1), the loss scale (1 in fp32, bf16): Megatron's
config.grad_scale_func, the optimizer's scale_loss, given once at build and
read at each seed. (PipeDream's seed is 1/n, n the microbatches of an update.)

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
from overlap import interleave
from support import timeline
from weight_grad_store import WeightGradStore


def drive(steps):
    """Run a pass written as a generator (forward_steps, backward_steps) to its end; what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


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

    def __init__(self, model, *, chunk=0, recompute=False, deallocate=False, meter=None,
                 grad_scale_func=None):
        self.model, self.chunk, self.recompute, self.deallocate = model, chunk, recompute, deallocate
        self.is_first, self.is_last = model.first, model.last
        self.grad_scale_func = grad_scale_func or (lambda loss: loss)  # fp16: the optimizer's scale_loss
        self.meter = meter or ActivationMeter(enabled=False)
        self.nodes = None  # step 08, experts on: the layers as nodes (overlap.LayerNodes, set by overlap.install)

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

    def forward_steps(self, mb, x, target):
        """forward, as a generator (step 08). With the layers as nodes it pauses after each node, yielding the
        node's name, so that DualPipe's pair can interleave two passes (overlap.py); else it runs whole."""
        if self.nodes is None:
            return self.forward(mb, x, target)
        if not self.is_first:
            x.requires_grad_()  # we need d(loss)/d(input) to send back
        out = yield from self.nodes.forward(mb, x, target)  # each node counts what it saves in the meter
        self.meter.keep((self.chunk, mb), out)
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

    def backward(self, mb, x, out, out_grad, split=False):
        """Backpropagate one microbatch through this stage; return d(loss)/d(input) (None on stage 0).
        split (step 08): B only; the microbatch keeps what its W needs (each Linear's input and output gradient)."""
        key = (self.chunk, mb)
        with timeline.span("B" if split else "backward", mb, chunk=self.chunk), WeightGradStore.split(key, split):
            custom_backward(out, out_grad)
            self.backward_done(mb)  # inside the span: PipeDream's update is timed as part of the backward
        return self.backward_ended(mb, x, split)

    def backward_steps(self, mb, x, out, out_grad, split=False):
        """backward, as a generator (step 08): with the layers as nodes it pauses after each node (overlap.py),
        from out's node (its gradient out_grad) to x's; else it runs whole. Its W's are filed as backward's."""
        if self.nodes is None:
            return self.backward(mb, x, out, out_grad, split)
        with WeightGradStore.split((self.chunk, mb), split):  # a pair's B is never split: nothing queued across
            yield from self.nodes.backward(mb, out_grad)
        return self.backward_ended(mb, x, split)

    def backward_ended(self, mb, x, split):
        """After mb's backward: what the meter still counts; d(loss)/d(input) (None on stage 0)."""
        key = (self.chunk, mb)
        self.meter.release(key)
        if split and self.meter.enabled:  # autograd has freed what the forward saved; W holds what it needs
            for t in WeightGradStore.held():
                self.meter.keep(key, t)
        return None if self.is_first else x.grad

    def backward_weights(self, mb):
        """W of microbatch mb, which must be the oldest waiting in the WeightGradStore."""
        with timeline.span("W", mb, chunk=self.chunk):
            WeightGradStore.pop((self.chunk, mb))
        self.meter.release((self.chunk, mb))

    def overlapped_forward_backward(self, forward, backward):
        """DualPipe's pair, a forward of this stage and a backward of another microbatch, drawn as one
        bracketed box (F&B). forward() and backward() give the two passes as generators (forward_steps,
        backward_steps). Dense, they run one after the other on one stream, on any device; with the layers
        as nodes (experts), interleaved so that one's all-to-alls travel under the other's compute."""
        with timeline.span("F&B", chunk=self.chunk):
            if self.nodes is None:
                drive(forward())
                drive(backward())
            else:
                interleave(forward(), backward())


class VirtualStages(torch.nn.ModuleList):
    """A rank's model chunks as one module, for the optimizer, the meters and the tests.

    Each chunk already names its parameters globally (layers.5.attn.wq.weight), so they are
    listed without the ModuleList's index prefix: the names match the whole model's.
    """

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        """Every chunk's parameters under their global names, without the ModuleList's index."""
        for chunk in self:
            yield from chunk.named_parameters(prefix, recurse, remove_duplicate)

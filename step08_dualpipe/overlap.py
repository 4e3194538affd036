"""DualPipe's overlap, real: a pair's two passes cut into nodes and interleaved. Read after experts.py.

    torchrun --nproc_per_node 4 step08_dualpipe/train.py --pp 2 --dp 2 --experts 4 --top-k 2 --ep 2 \\
        --schedule dualpipev --link-latency-ms 20

With experts, every layer of a forward and of a backward waits twice for an all-to-all. DualPipe pairs a
forward of one microbatch with a backward of another, two passes that do not depend on each other, so one's
all-to-all can travel while the other computes. DeepSeek-V3 "divide[s] each chunk into four components:
attention, all-to-all dispatch, MLP, and all-to-all combine" and rearranges them. Here, as in Megatron-LM's
TransformerLayerSchedulePlan, a layer is four nodes (with experts on, dualpipe and dualpipev, no --recompute):

    attention  norm, attention, residual, norm, router, top-k, the count exchange, the permutation (compute)
    dispatch   all_to_all_single of the permuted rows, posted with async_op=True        (communication)
    experts    the local experts on the rows that arrived                                  (compute)
    combine    the inverse all-to-all, posted (communication); whoever reads it next waits for it, then
               un-permutes, weights by the router and adds the residual (compute, in the combine's Node)

Each compute node is a Node: its inputs are detached from the graph before it, so its backward runs on its
own, from its outputs' gradients to its inputs' (Megatron's ScheduleNode). A backward runs the nodes in
reverse: combine (the un-permutation's backward, then its all-to-all posted), experts (their input
gradients; their weight gradients held apart, "experts W"), dispatch (posted), attention. The Linears still
file their dW with the WeightGradStore when the B is split, so zb1p's and DualPipe's W's stay W's.

A pass is a generator (PipelineStage.forward_steps, backward_steps): it runs one node and pauses, yielding
the node's name. --pairs sequential drives each pass to its end: the same nodes, each all-to-all waited for
at once. The pair (interleave) resumes the two passes in Megatron-LM's order for a layer of each
(pair_order):

    compute:  B.combine | F.attention | B.experts   | B.experts W |          | F.experts   | B.attention
    comm:               B.combine ====|   F.dispatch ===========  B.dispatch=|= F.combine ===========

    B combine        the backward's combine goes first: its all-to-all then travels under F's attention,
    F attention      a compute that needs nothing from the backward;
    B experts        waits for B's combine (just posted, hidden behind F's attention);
    F dispatch       posted as soon as F's router has sorted the rows;
    B experts W      the experts' weight gradients: compute that covers F's dispatch;
    B dispatch       posted;
    F experts        waits for F's dispatch, covers B's dispatch;
    F combine        posted;
    B attention      waits for B's dispatch, covers F's combine, whose wait sits in F's next attention.

ONE thread posts every all-to-all, in this fixed order, on every rank of an expert group. gloo and NCCL
match collectives by the order each rank posts them (gloo tags a collective when it is posted), so two
ranks that posted the same two all-to-alls in different orders would pair one's dispatch with the other's
combine, or hang. Every rank of an expert group runs the same stage and the same schedule, so it posts the
same sequence; tests/overlap_order.py compares the sequences across the group. On gloo an async all-to-all
runs on gloo's worker threads, so the compute really runs meanwhile, even on a CPU.

What a GPU adds, which a CPU cannot show: NCCL's all-to-all runs on its own CUDA stream, beside the compute
stream, and both compete for the GPU's SMs. DeepSeek-V3 "manually adjust[s] the ratio of GPU SMs dedicated to
communication versus computation"; DeepEP's kernels set how many SMs communication takes; Megatron-LM puts
the comm nodes on a second stream and needs CUDA_DEVICE_MAX_CONNECTIONS > 1. This file posts NCCL's work the
same way (async_op=True, wait() makes the compute stream wait), but overlap on a GPU is not measured here.

--link-latency-ms X simulates a slow network, for teaching: a link that carries one all-to-all at a time,
each for X ms, in posting order (as one NCCL communicator's stream does). An all-to-all completes X ms after
the link is free (its wait sleeps the rest), so a wait at once exposes X, and a wait after other compute
exposes only what the compute did not cover. The count exchange is not delayed.
"""
import time
from contextlib import contextmanager

import torch.distributed as dist
from torch.autograd import Variable

from experts import account, ungroup, unpermute
from model import lm_loss
from support import timeline
from support.timeline import COMPUTE, measured_steps
from weight_grad_store import WeightGradStore


# The timeline's boxes of a posted all-to-all: its posting, and the wait of the node that reads it (the
# exposed part). Outside the compute boxes: a rank that waits does no compute.
POST, WAIT = "all-to-all post", "all-to-all wait"


class Link:
    """The network the all-to-alls travel on: latency_s > 0 simulates a slow one (--link-latency-ms) that
    carries one all-to-all at a time, in posting order, as one NCCL communicator's stream does."""
    latency_s = 0.0
    free_at = 0.0  # when the simulated link has delivered every all-to-all posted so far

    @classmethod
    def arrival(cls) -> float:
        """When an all-to-all posted now arrives: latency_s after the link is free (time.monotonic)."""
        cls.free_at = max(time.monotonic(), cls.free_at) + cls.latency_s
        return cls.free_at


class InFlight:
    """An all-to-all posted with async_op=True: send[r] rows of x to rank r, recv[r] rows from it.
    wait() blocks until it has arrived (with a simulated link, no earlier than Link.arrival said) and
    returns [sum(recv), h]."""

    def __init__(self, x, send, recv, ep, direction: str, what: str, mb):
        self.x, self.ep, self.mb, self.what = x.contiguous(), ep, mb, f"{direction} {what}"
        if ep.size == 1:  # one rank holds every expert: nothing travels
            self.out, self.work = self.x, None
            return
        sent = account(x, send, ep, direction)
        with timeline.span(POST, mb, what=f"post {self.what}", bytes=sent):
            self.out = x.new_empty((sum(recv), *x.shape[1:]))
            self.work = dist.all_to_all_single(self.out, self.x, recv, send, group=ep.group, async_op=True)
            self.arrives = Link.arrival()

    def wait(self):
        """The arrived rows, once they are here (NCCL: the current stream waits for the all-to-all's)."""
        if self.work is not None:
            with timeline.span(WAIT, self.mb, what=f"wait {self.what}", link_ms=Link.latency_s * 1e3):
                time.sleep(max(0.0, self.arrives - time.monotonic()))
                self.work.wait()
            self.work = self.x = None
        return self.out


class Node:
    """A piece of the graph whose inputs are detached from what came before, so that its backward runs on
    its own: autograd from its outputs' gradients to its inputs', which go to the node before.
    fn(*inputs) -> tuple of outputs. keep: the first inputs that stay themselves (the stage's input)."""

    def __init__(self, fn, *inputs, keep=0):
        self.inputs = [t if i < keep else t.detach().requires_grad_(t.is_floating_point())
                       for i, t in enumerate(inputs)]
        self.outputs = fn(*self.inputs)

    def backward(self, *grads):
        """Backpropagate grads (one per output; None for none) through this node; its inputs' gradients."""
        outputs, grads = zip(*[(o, g) for o, g in zip(self.outputs, grads) if g is not None])
        # As stage.custom_backward: a sent output may be deallocated (one element), autograd needs only its node
        Variable._execution_engine.run_backward(tensors=outputs, grad_tensors=grads, keep_graph=False,
                                                create_graph=False, inputs=(), allow_unreachable=True,
                                                accumulate_grad=True)
        grads = [t.grad for t in self.inputs]
        self.inputs = self.outputs = None
        return grads


@contextmanager
def weight_grads_apart(held: list):
    """The Linears' dW of the body go to `held`, to run later ("experts W"), unless the B is split, in
    which case the WeightGradStore's W runs them. Either way each weight adds the same dW once."""
    if WeightGradStore.deferring:
        yield
        return
    cache, WeightGradStore.cache, WeightGradStore.deferring = WeightGradStore.cache, held, True
    try:
        yield
    finally:
        WeightGradStore.cache, WeightGradStore.deferring = cache, False


class LayerPass:
    """One layer's nodes for one microbatch: what its forward keeps for its backward."""

    def __init__(self, layer, stage, mb):
        self.layer, self.moe, self.stage, self.mb = layer, layer.mlp, stage, mb

    def named(self, what: str) -> str:
        """An all-to-all's name on the timeline: what it carries and its layer (the order check reads them)."""
        return f"{what} of layer {self.moe.layer}"

    def compute(self, kind: str, node: str):
        """A compute node's box on the timeline (kind: forward or backward), and, forward, the activation meter."""
        if kind == "backward" and WeightGradStore.deferring:  # a split B (zero bubble): its W comes later
            kind = "B"
        box = timeline.span(kind, self.mb, chunk=self.stage.chunk, what=f"{kind} {node}")
        if kind != "forward":
            return box
        meter = self.stage.meter.saving((self.stage.chunk, self.mb))
        return _both(box, meter)

    # Forward.
    def attention(self, x, embed=None, keep=0):
        """x [b, t, h] (token ids with embed) -> rows [T*k, h] sorted by destination rank; the plan."""
        def fn(x):
            x = embed(x) if embed is not None else x
            h = x + self.layer.attn(self.layer.attn_norm(x), self.stage.model.rope_cos, self.stage.model.rope_sin)
            rows, self.plan = self.moe.route_and_permute(self.layer.mlp_norm(h))
            return h, rows, self.plan.weights

        with self.compute("forward", "attention"):
            self.pre = Node(fn, x, keep=keep)

    def dispatch(self):
        self.sent = InFlight(self.pre.outputs[1], self.plan.send, self.plan.recv, self.moe.ep, "forward",
                             self.named("dispatch"), self.mb)

    def experts(self):
        received = self.sent.wait()  # [R, h] by source rank, then expert
        with self.compute("forward", "experts"):
            self.mlp = Node(lambda rows: (ungroup(self.moe.run_experts(rows[self.plan.regroup], self.plan),
                                                  self.plan),), received)

    def combine(self):
        self.sent = InFlight(self.mlp.outputs[0], self.plan.recv, self.plan.send, self.moe.ep, "forward",
                             self.named("combine"), self.mb)

    def finish(self, head=None):
        """Wait for the combine; un-permute, weight, add the residual (then head(y) on the last layer)."""
        rows = self.sent.wait()  # [T*k, h], sorted by expert
        h, _, weights = self.pre.outputs

        def fn(rows, weights, h):
            y = h + unpermute(rows, weights, self.plan)
            return (y if head is None else head(y),)

        with self.compute("forward", "combine"):
            self.post = Node(fn, rows, weights, h)
        return self.post.outputs[0]

    # Backward, in reverse.
    def combine_backward(self, grad):
        with self.compute("backward", "combine"):
            self.g_rows, self.g_weights, self.g_h = self.post.backward(grad)
        self.sent = InFlight(self.g_rows, self.plan.send, self.plan.recv, self.moe.ep, "backward",
                             self.named("combine"), self.mb)

    def experts_backward(self):
        grad = self.sent.wait()
        self.held = []
        with self.compute("backward", "experts"), weight_grads_apart(self.held):
            (self.g_received,) = self.mlp.backward(grad)

    def experts_weights(self):
        with self.compute("backward", "experts W"):
            for closure in self.held:
                closure()
        self.held = None

    def dispatch_backward(self):
        self.sent = InFlight(self.g_received, self.plan.recv, self.plan.send, self.moe.ep, "backward",
                             self.named("dispatch"), self.mb)

    def attention_backward(self):
        """-> the gradient of the layer's input (None: the stage's input, whose .grad has it)."""
        g_rows = self.sent.wait()
        with self.compute("backward", "attention"):
            (grad,) = self.pre.backward(self.g_h, g_rows, self.g_weights)
        self.sent = self.pre = self.mlp = self.post = self.plan = None
        return grad


@contextmanager
def _both(first, second):
    with first, second:
        yield


class LayerNodes:
    """A stage's layers as nodes (the experts on): forward and backward of a microbatch as generators that
    pause after each node, yielding its name (PipelineStage.forward_steps, backward_steps)."""

    def __init__(self, stage):
        self.stage, self.model = stage, stage.model
        self.passes = {}  # microbatch -> its LayerPasses, from its forward to its backward

    def forward(self, mb, x, target):
        """x [b, t, h] (token ids on the first stage) -> the output (the loss on the last stage)."""
        passes, model = [], self.model
        for i, layer in enumerate(model.layers.values()):
            p = LayerPass(layer, self.stage, mb)
            if i == 0:
                p.attention(x, embed=model.embed if model.first else None, keep=0 if model.first else 1)
            else:
                p.attention(passes[-1].finish())  # waits for the last layer's combine
            yield "attention"
            passes.append(p)
            p.dispatch()
            yield "dispatch"
            p.experts()
            yield "experts"
            p.combine()
            yield "combine"
        head = (lambda y: lm_loss(model.logits(y), target, model.tp)) if model.last else None
        self.passes[mb] = passes
        return passes[-1].finish(head)

    def backward(self, mb, out_grad):
        """From the output's gradient (the loss's seed on the last stage) to the stage input's .grad."""
        grad = out_grad
        for p in reversed(self.passes.pop(mb)):
            p.combine_backward(grad)
            yield "combine"
            p.experts_backward()
            yield "experts"
            p.experts_weights()
            yield "experts W"
            p.dispatch_backward()
            yield "dispatch"
            grad = p.attention_backward()
            yield "attention"


def pair_order():
    """A pair's order for one layer of each pass: [(pass, node)], pass "F" (the forward) or "B" (the backward),
    node a name its generator yields (LayerNodes.forward: attention, dispatch, experts, combine;
    LayerNodes.backward: combine, experts, experts W, dispatch, attention). Each pass's nodes keep their own
    order; between the two passes, the order decides which all-to-all travels under which compute. Every
    rank of an expert group returns the same order, so every rank posts the same collectives in turn."""
    # Megatron-LM's order (TransformerLayerSchedulePlan.run); the module's docstring says why, node by node.
    return [("B", "combine"), ("F", "attention"), ("B", "experts"), ("F", "dispatch"), ("B", "experts W"),
            ("B", "dispatch"), ("F", "experts"), ("F", "combine"), ("B", "attention")]


def interleave(forward, backward):
    """DualPipe's pair, overlapped: the forward's and the backward's nodes (two generators) run from this one
    thread in pair_order(), layer by layer (the forward's i-th layer with the backward's i-th from the end);
    a pass with layers left runs them alone; then each pass finishes (the forward's last combine and head)."""
    passes, done = {"F": forward, "B": backward}, set()
    while len(done) < 2:
        order, ran_any = pair_order(), False
        for side, node in order:
            if side in done:
                continue
            try:
                ran = next(passes[side])
            except StopIteration:
                done.add(side)
                continue
            ran_any = True
            assert ran == node, f"the pair's order expected {side}'s {node}, its pass ran {ran}"
        assert ran_any or len(done) == 2, f"the pair's order {order} runs no node of {set(passes) - done}"


def enabled(args) -> bool:
    """Whether the stages run as nodes: experts, a DualPipe schedule, no recompute (config refuses
    --pairs overlapped with it)."""
    return bool(args.experts) and args.schedule in ("dualpipe", "dualpipev") and not args.recompute


def install(args, stages):
    """Give each stage its LayerNodes when the run uses them, and the simulated link its latency."""
    Link.latency_s = args.link_latency_ms / 1e3
    for stage in stages:
        stage.nodes = LayerNodes(stage) if enabled(args) else None


def report_lines(args, events) -> list:
    """Per rank and step, the dispatches' and combines' time on the link, the part of it exposed (spent
    waiting) and the hidden fraction; with a simulated link and overlapped pairs, each pair's ideal time,
    predicted as the longer of its two lanes (compute, and posts x latency), beside its measured time."""
    if not (enabled(args) and args.ep > 1):
        return []
    steps = measured_steps(events)
    latency = Link.latency_s
    link = f"a simulated link of {latency * 1e3:g} ms" if latency else "no simulated link"
    lines = [f"all-to-all (dispatch, combine) per step, --pairs {args.pairs}, {link}, steps {steps[0]}..{steps[-1]}:"]
    for rank in sorted({e["rank"] for e in events}):
        mine = [e for e in events if e["rank"] == rank and e["step"] in steps]
        posts = [e for e in mine if e["kind"] == POST]
        exposed = sum(e["end"] - e["start"] for e in mine if e["kind"] == WAIT) / len(steps)
        text = f"  rank {rank}: {len(posts) // len(steps)} all-to-alls, exposed (waiting) {exposed * 1e3:.1f} ms"
        if latency:
            link_time = len(posts) * latency / len(steps)
            text += f" of {link_time * 1e3:.1f} ms on the link, hidden {1 - exposed / link_time:.0%}"
        lines.append(text + pair_times(mine, latency))
    return lines


def pair_times(events, latency: float) -> str:
    """A rank's mean overlapped pair: predicted max(compute lane, comm lane) beside the measured F&B box."""
    pairs = [e for e in events if e["kind"] == "F&B"]
    if not pairs or not latency:
        return ""
    ideal = measured = 0.0
    for pair in pairs:
        inside = [e for e in events if pair["start"] <= e["start"] and e["end"] <= pair["end"]]
        compute = sum(e["end"] - e["start"] for e in inside if e["kind"] in COMPUTE)
        comm = latency * sum(e["kind"] == POST for e in inside)
        ideal, measured = ideal + max(compute, comm), measured + pair["end"] - pair["start"]
    return f"; a pair: ideal {ideal / len(pairs) * 1e3:.1f} ms (its longer lane), measured {measured / len(pairs) * 1e3:.1f} ms"

"""Pipeline schedules: AFAB, 1F1B, and interleaved 1F1B with virtual stages.

AFAB, GPipe's schedule: every microbatch goes forward through this stage, then
every microbatch goes backward, in the same order on every stage so each
receive meets its send. The stage keeps the inputs and outputs of all m
microbatches until their backward: activation memory grows with m (1F1B fixes that).

1F1B (PipeDream-Flush, Megatron-LM's default) runs the same m forwards and m backwards,
so it has the same bubble, but starts each backward as early as possible. Stage s (of p) runs
    warm-up:   min(p-s-1, m) forwards, enough to fill the pipeline below it,
    steady:    one forward then one backward, until every forward is done,
    cool-down: the remaining backwards.
At most min(p-s, m) microbatches are in flight on stage s: activation memory is bounded by p, not m.

ZB-H1 (step 08; Qi et al. 2024, "Zero Bubble Pipeline Parallelism") splits each backward into B, the
input gradient the previous stage waits for, and W, the weight gradients nobody waits for
(weight_grad_store.py). Stage s runs 1F1B's warm-up, then for each microbatch i a forward while any
remain, B of i, and W of i-s once i >= s; the last s W's close the step. The s postponed W's fill
the gaps where 1F1B waits for a gradient: the bubble falls from (p-1)(F+B+W) to (p-1)(F+B-W), in
units of compute time, while every stage holds at most p microbatches, 1F1B's first-stage peak.
DualPipe and DualPipeV (step 08, DeepSeek-V3) are a family of their own, in dualpipe.py, which runs
its schedules on this module's Stash.

The Stash below is what every later schedule shares: it runs one microbatch
forward or backward on the right stage and keeps what the backward needs.
"""
from collections import deque

import torch

from stage import PipelineStage, drive
from weight_grad_store import WeightGradStore


def bubble_formula(args, times=None):
    """(text, value): idle fraction of each rank when m microbatches fill and drain p stages. With v virtual
    stages the fill and drain take 1/v as long: (p-1)/(v*m) of the ideal compute time (the ratio Megatron-LM's
    paper quotes), i.e. (p-1)/(v*m+p-1) of the step.
    zb1p idles (p-1)(F+B-W) beside m(F+B+W) of compute; times: the mean F, B and W measured in the run (equal if None).
    """
    if args.schedule == "zb1p":
        f, b, w = times or (1, 1, 1)
        idle = (args.pp - 1) * (f + b - w)
        text = f"(p-1)(F+B-W)/(m(F+B+W)+(p-1)(F+B-W)), F:B:W = 1:{b / f:.2f}:{w / f:.2f}"
        return text, idle / (args.microbatches * (f + b + w) + idle)
    if args.schedule == "interleaved":
        v = args.virtual_stages
        return "(p-1)/(v*m+p-1)", (args.pp - 1) / (v * args.microbatches + args.pp - 1)
    return "(p-1)/(m+p-1)", (args.pp - 1) / (args.microbatches + args.pp - 1)


def peak_stored_microbatches(args, stage: int):
    """(text, value): the most microbatches whose activations `stage` holds at once."""
    if args.schedule == "1f1b":
        return "min(p-stage, m)", min(args.pp - stage, args.microbatches)
    if args.schedule == "interleaved":
        warmup = interleaved_warmup(args.pp, stage, args.microbatches, args.virtual_stages)
        return ("min(2(p-stage-1) + (v-1)p + 1, v*m) (chunk, microbatch) pairs",
                min(warmup + 1, args.virtual_stages * args.microbatches))
    if args.schedule == "zb1p":  # 1F1B's p-stage, plus the stage's postponed W's
        return "min(p, m)", min(args.pp, args.microbatches)
    return "m", args.microbatches


def warmup_microbatches(pp: int, stage: int, microbatches: int) -> int:
    """Forwards stage `stage` runs before its first backward in 1F1B."""
    return min(pp - stage - 1, microbatches)


def interleaved_warmup(pp: int, stage: int, microbatches: int, virtual: int) -> int:
    """Virtual-microbatch forwards before the first backward: enough to keep every chunk busy."""
    return min((pp - stage - 1) * 2 + (virtual - 1) * pp, microbatches * virtual)


def virtual_microbatch(k: int, pp: int, virtual: int, forward: bool):
    """(model chunk of this rank, microbatch) of the k-th virtual microbatch, in forward or backward order."""
    chunk = (k // pp) % virtual
    return (chunk if forward else virtual - 1 - chunk), (k // (pp * virtual)) * pp + k % pp


class Stash:
    """What one rank keeps between a microbatch's forward and its backward, and the losses.

    stages: this rank's model chunks (one until step 05). comm: the PipelineComm whose receive buffers the
    stash hands back after each backward. microbatches: [(tokens, targets)] of this replica.
    """

    def __init__(self, stages, comm, microbatches, split=False):
        self.stages, self.comm, self.microbatches = stages, comm, microbatches
        self.split = split  # step 08: its schedule splits backwards, so its forwards build splittable Linears
        self.kept = {}  # (chunk, mb) -> (stage input, stage output) until the backward
        self.gradients = {}  # (chunk, mb) -> the received output gradient a split B leaves to its W (step 08)
        self.losses = []  # last stage only: each microbatch's mean loss, in microbatch order

    def forward(self, mb, x, chunk=0):
        """x is the received activation; the model's first stage reads tokens instead (x is None)."""
        return drive(self.forward_steps(mb, x, chunk))

    def forward_steps(self, mb, x, chunk=0):
        """forward as a generator that pauses between the stage's nodes (step 08: stage.forward_steps)."""
        stage = self.stages[chunk]
        tokens, target = self.microbatches[mb]
        x = tokens if stage.is_first else x
        with WeightGradStore.splittable(self.split):  # only forwards read it: a paired backward may run meanwhile
            out = yield from stage.forward_steps(mb, x, target)
        if stage.is_last:
            self.losses.append(out.detach())
        # With recompute the backward rebuilds the output: holding it would pin one activation per microbatch.
        self.kept[chunk, mb] = (x, None if stage.recompute else out)
        return out

    def backward(self, mb, out_grad, chunk=0, split=False):
        """out_grad is the received gradient; the model's last stage starts from its loss (out_grad is None).
        split: B only; backward_weights runs the W later."""
        return drive(self.backward_steps(mb, out_grad, chunk, split))

    def backward_steps(self, mb, out_grad, chunk=0, split=False):
        """backward as a generator that pauses between the stage's nodes (step 08: stage.backward_steps)."""
        stage = self.stages[chunk]
        x, out = self.kept.pop((chunk, mb))
        received = (None if stage.is_first else x, out_grad)  # the communicator's buffers, free after the backward
        if stage.recompute:
            with WeightGradStore.splittable(self.split):
                x, out = stage.recompute_forward(mb, x, self.microbatches[mb][1])
        if stage.is_last:  # d(S x batch mean loss) / d(microbatch mean loss), S the loss scale
            out_grad = torch.full_like(out, stage.grad_scale_func(1.0) / len(self.microbatches))
        input_grad = yield from stage.backward_steps(mb, x, out, out_grad, split)
        if split:  # the stage's last Linear reads the received gradient as its dy in W: keep it until then
            self.gradients[chunk, mb], received = received[1], received[:1]
        self.comm.recycle(*received)
        return input_grad

    def backward_weights(self, mb, chunk=0):
        """W of mb (step 08); then the gradient buffer its B received can take the next message."""
        self.stages[chunk].backward_weights(mb)
        self.comm.recycle(self.gradients.pop((chunk, mb)))

    def deallocate(self, mb, chunk=0):
        """mb's output has been sent: its values may go (see PipelineStage.deallocate_output)."""
        stage = self.stages[chunk]
        if not stage.is_last:  # the last stage sends nothing: its output is the loss
            stage.deallocate_output(mb, self.kept[chunk, mb][1])

    @property
    def loss(self):
        """The batch's mean loss on the rank that holds the model's last stage, else None."""
        return sum(self.losses) / len(self.microbatches) if self.losses else None


def afab_forward_backward(stages, comm, microbatches):
    """Every forward, then every backward, in microbatch order on every stage; returns the mean loss."""
    stash = Stash(stages, comm, microbatches)
    for mb in range(len(microbatches)):
        out = stash.forward(mb, comm.recv_forward())  # recv_forward waits for stage-1's forward of mb
        comm.send_forward(out)
        stash.deallocate(mb)
    for mb in range(len(microbatches)):
        comm.send_backward(stash.backward(mb, comm.recv_backward()))  # waits for stage+1's backward of mb
    return stash.loss


def one_f_one_b_forward_backward(stages, comm, microbatches):
    """Warm-up forwards, then alternate one forward and one backward, then the remaining backwards."""
    stash = Stash(stages, comm, microbatches)
    m = len(microbatches)
    warmup = warmup_microbatches(comm.num_stages, comm.stage, m)
    steady = m - warmup

    for mb in range(warmup):
        comm.send_forward(stash.forward(mb, comm.recv_forward()))
        stash.deallocate(mb)

    x = comm.recv_forward() if steady else None
    for i in range(steady):
        fwd_mb, bwd_mb = warmup + i, i  # forward the newest microbatch, backward the oldest
        out = stash.forward(fwd_mb, x)
        # Hand the output on and wait for the oldest microbatch's gradient in one exchange: the next stage sends it now.
        out_grad = comm.send_forward_recv_backward(out)
        stash.deallocate(fwd_mb)
        input_grad = stash.backward(bwd_mb, out_grad)
        if i == steady - 1:
            comm.send_backward(input_grad)
        else:  # send the gradient back while the previous stage sends our next input
            x = comm.send_backward_recv_forward(input_grad)

    for mb in range(steady, m):
        comm.send_backward(stash.backward(mb, comm.recv_backward()))
    return stash.loss


def interleaved_computes(pp: int, stage: int, microbatches: int, virtual: int):
    """A rank's forwards and backwards in 1F1B order over virtual microbatches, [("F", k) | ("B", k)]:
    warm-up forwards, then one forward and one backward until every forward is done, then the rest."""
    total = microbatches * virtual
    warmup = interleaved_warmup(pp, stage, microbatches, virtual)
    steady = [compute for i in range(total - warmup) for compute in (("F", warmup + i), ("B", i))]
    return [("F", k) for k in range(warmup)] + steady + [("B", k) for k in range(total - warmup, total)]


def interleaved_actions(pp: int, microbatches: int, virtual: int):
    """Every rank's actions for one step: its computes, ("F", k) and ("B", k), and before each compute that
    takes a tensor from a neighbour, the receive that brings it, ("recv F", k) or ("recv B", k).

    Where the receives go decides who waits for whom. One simulation builds every rank's list: the ranks
    run their computes in lockstep rounds, rank 0 first in each round, a compute as soon as its input has
    been sent, and when a compute runs, the receive of what it sends goes at once to the end of the
    receiver's list. So each receive is posted about when its sender computes, long before it is needed
    (on gloo a message moves only once its receive is posted), and every receive follows its send in one
    order that all ranks share: no rank can block at the head of its NCCL stream on a receive whose send
    waits behind a receive of the sender's. PyTorch's pipelining runtime places its receives the same way.
    """
    todo = [deque(interleaved_computes(pp, stage, microbatches, virtual)) for stage in range(pp)]
    actions = [[] for _ in range(pp)]
    sent = set()  # (stage, kind, k): computes whose input a neighbour has sent
    last = pp * virtual - 1  # the model's last chunk; chunk 0 is its first

    def model_chunk(stage, kind, k):
        return virtual_microbatch(k, pp, virtual, forward=kind == "F")[0] * pp + stage

    while any(todo):
        ran = False
        for stage in range(pp):
            if not todo[stage]:
                continue
            kind, k = todo[stage][0]
            begin, end = (0, last) if kind == "F" else (last, 0)  # where this direction enters and leaves
            chunk = model_chunk(stage, kind, k)
            if chunk != begin and (stage, kind, k) not in sent:
                continue  # its input is not sent yet: this rank idles this round
            actions[stage].append(todo[stage].popleft())
            ran = True
            if chunk != end:  # the output goes to the neighbour that runs the model's next chunk
                to = (stage + 1) % pp if kind == "F" else (stage - 1) % pp
                # Across the wrap of the ring the next chunk is the receiver's next chunk: p virtual
                # microbatches later in its numbering (virtual_microbatch).
                k_to = k + pp if (to == 0 if kind == "F" else to == pp - 1) else k
                actions[to].append(("recv " + kind, k_to))
                sent.add((to, kind, k_to))
        if not ran:  # every rank waits for an input that no rank will send: the orders do not fit
            raise RuntimeError(f"interleaved orders of pp {pp}, m {microbatches}, v {virtual} cannot run: "
                               f"next computes {[t[0] for t in todo if t]}")
    return actions


def interleaved_forward_backward(stages, comm, microbatches):
    """1F1B over virtual microbatches. Each output and input gradient goes to its ring neighbour right after
    the compute that made it; each receive is posted where interleaved_actions puts it, and waited for only
    just before the compute that needs it: meanwhile the message travels."""
    stash = Stash(stages, comm, microbatches)
    pp, virtual = comm.num_stages, len(stages)
    arriving = {}  # (kind, k) -> the function that waits for the input of compute k

    def input_of(kind, k):
        """Wait for compute k's input; None where the model begins for it (tokens, or the loss)."""
        wait = arriving.pop((kind, k), None)
        return wait() if wait else None

    for kind, k in interleaved_actions(pp, len(microbatches), virtual)[comm.stage]:
        if kind == "recv F":
            arriving["F", k] = comm.irecv_forward()
        elif kind == "recv B":
            arriving["B", k] = comm.irecv_backward()
        elif kind == "F":
            chunk, mb = virtual_microbatch(k, pp, virtual, forward=True)
            out = stash.forward(mb, input_of("F", k), chunk)
            if not stages[chunk].is_last:  # the last rank's chunks too, round the ring to rank 0
                comm.communicate(send_next=out)
            stash.deallocate(mb, chunk)
        else:
            chunk, mb = virtual_microbatch(k, pp, virtual, forward=False)
            input_grad = stash.backward(mb, input_of("B", k), chunk)
            if not stages[chunk].is_first:
                comm.communicate(send_prev=input_grad)
    return stash.loss


def zb1p_forward_backward(stages, comm, microbatches):
    """ZB-H1: 1F1B's order with each backward split, stage s running W of microbatch i-s after B of i.

    The next activation is received after the postponed W, in a receive of its own: a receive posted with
    B's send (1F1B's send_backward_recv_forward) waits for it before the W, and the W idles no time away.
    Posting B's send and that receive apart cannot deadlock here. The previous stage posts its send of the
    activation with its receive of our gradient, as one exchange (send_forward_recv_backward): our send
    meets that exchange, then our receive meets it or the next one. No rank waits on a neighbour that
    waits on it, by the replay's model (operations complete in posting order, one stream per rank)."""
    stash = Stash(stages, comm, microbatches, split=True)
    m, stage = len(microbatches), comm.stage
    warmup = warmup_microbatches(comm.num_stages, stage, m)

    for mb in range(warmup):
        comm.send_forward(stash.forward(mb, comm.recv_forward()))
        stash.deallocate(mb)

    x = comm.recv_forward() if warmup < m else None
    for i in range(m):
        fwd_mb = warmup + i
        if fwd_mb < m:  # steady: the newest forward, then the oldest microbatch's B
            out_grad = comm.send_forward_recv_backward(stash.forward(fwd_mb, x))
            stash.deallocate(fwd_mb)
        else:  # cool-down
            out_grad = comm.recv_backward()
        # Send B's input gradient at once: the previous stage waits for it, not for our W. The send
        # completes while W runs; the next input is received only after W (two exchanges).
        comm.send_backward(stash.backward(i, out_grad, split=True))
        if i >= stage:
            stash.backward_weights(i - stage)
        if fwd_mb + 1 < m:
            x = comm.recv_forward()

    for mb in range(m - stage, m):  # the W's this stage postponed
        stash.backward_weights(mb)
    assert not WeightGradStore.queue, "every W of the step has run"
    return stash.loss


SCHEDULES = {"afab": afab_forward_backward, "1f1b": one_f_one_b_forward_backward,
             "interleaved": interleaved_forward_backward, "zb1p": zb1p_forward_backward}


def schedule_of(args):
    """The function that runs one step of args.schedule."""
    return SCHEDULES[args.schedule]


def model_chunks(args, stage: int):
    """(global indices of this rank's model chunks, how many chunks the model is cut into): with v virtual
    stages, stage, stage + p, ..."""
    return list(range(stage, args.pp * args.virtual_stages, args.pp)), args.pp * args.virtual_stages


def stage_class(args, model, before_update):
    """The stages a flushed schedule drives: plain PipelineStages (the optimizer steps once per batch)."""
    return PipelineStage


def train_steps(run, flushed_steps, *pieces):
    """The flushed schedules train one batch per step: train.py's flushed_steps (the pieces are PipeDream's)."""
    return flushed_steps(run)


def peaks(run) -> dict:
    """What this family measures beyond the activation meter: nothing."""
    return {}


def report_lines(args, record, name, stage_of) -> list:
    """What this family reports beyond activation memory and the bubble: nothing."""
    return []

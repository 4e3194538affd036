"""Pipeline schedules: all-forward-all-backward (AFAB) and one-forward-one-backward (1F1B).

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

The Stash below is what every later schedule shares: it runs one microbatch
forward or backward on the right stage and keeps what the backward needs.
"""
import torch

from stage import PipelineStage


def bubble_formula(args):
    """(text, value): idle fraction of each rank when m microbatches fill and drain p stages."""
    return "(p-1)/(m+p-1)", (args.pp - 1) / (args.microbatches + args.pp - 1)


def peak_stored_microbatches(args, stage: int):
    """(text, value): the most microbatches whose activations `stage` holds at once."""
    if args.schedule == "1f1b":
        return "min(p-stage, m)", min(args.pp - stage, args.microbatches)
    return "m", args.microbatches


def warmup_microbatches(pp: int, stage: int, microbatches: int) -> int:
    """Forwards stage `stage` runs before its first backward in 1F1B."""
    return min(pp - stage - 1, microbatches)


class Stash:
    """What one rank keeps between a microbatch's forward and its backward, and the losses.

    stages: this rank's model chunks (one until step 05). comm: the PipelineComm whose receive buffers the
    stash hands back after each backward. microbatches: [(tokens, targets)] of this replica.
    """

    def __init__(self, stages, comm, microbatches):
        self.stages, self.comm, self.microbatches = stages, comm, microbatches
        self.kept = {}  # (chunk, mb) -> (stage input, stage output) until the backward
        self.losses = []  # last stage only: each microbatch's mean loss, in microbatch order

    def forward(self, mb, x, chunk=0):
        """x is the received activation; the model's first stage reads tokens instead (x is None)."""
        stage = self.stages[chunk]
        tokens, target = self.microbatches[mb]
        x = tokens if stage.is_first else x
        out = stage.forward(mb, x, target)
        if stage.is_last:
            self.losses.append(out.detach())
        # With recompute the backward rebuilds the output: holding it would pin one activation per microbatch.
        self.kept[chunk, mb] = (x, None if stage.recompute else out)
        return out

    def backward(self, mb, out_grad, chunk=0):
        """out_grad is the received gradient; the model's last stage starts from its loss (out_grad is None)."""
        stage = self.stages[chunk]
        x, out = self.kept.pop((chunk, mb))
        received = (None if stage.is_first else x, out_grad)  # the communicator's buffers, free after the backward
        if stage.recompute:
            x, out = stage.recompute_forward(mb, x, self.microbatches[mb][1])
        if stage.is_last:  # d(batch mean loss) / d(microbatch mean loss)
            out_grad = torch.full_like(out, 1 / len(self.microbatches))
        input_grad = stage.backward(mb, x, out, out_grad)
        self.comm.recycle(*received)
        return input_grad

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


SCHEDULES = {"afab": afab_forward_backward, "1f1b": one_f_one_b_forward_backward}


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

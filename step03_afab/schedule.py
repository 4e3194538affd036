"""Pipeline schedules, written on the engine: all-forward-all-backward (AFAB).

AFAB, GPipe's schedule: every microbatch goes forward through this stage, then
every microbatch goes backward, in the same order on every stage so each
receive meets its send. The stage keeps the inputs and outputs of all m
microbatches until their backward: activation memory grows with m (1F1B fixes that).

The Stash below is what every later schedule shares: it runs one microbatch
forward or backward on the right stage and keeps what the backward needs.
"""
import torch


def bubble_formula(args):
    """(text, value): idle fraction of each rank when m microbatches fill and drain p stages."""
    return "(p-1)/(m+p-1)", (args.pp - 1) / (args.microbatches + args.pp - 1)


def peak_stored_microbatches(args, stage: int):
    """(text, value): the most microbatches whose activations `stage` holds at once."""
    return "m", args.microbatches


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
    for mb in range(len(microbatches)):
        comm.send_backward(stash.backward(mb, comm.recv_backward()))  # waits for stage+1's backward of mb
    return stash.loss

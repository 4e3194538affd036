"""Pipeline schedules: all-forward-all-backward (AFAB) and one-forward-one-backward (1F1B).

Both run the same m forwards and m backwards per stage, so both have GPipe's
bubble (p-1)/(m+p-1). They differ in *when* the backwards run:

AFAB keeps every microbatch's activations until all forwards are done: m sets.

1F1B (PipeDream-Flush, Megatron-LM's default) starts each backward as early as
possible. Stage s (of p) runs
    warm-up:   min(p-s-1, m) forwards, enough to fill the pipeline below it,
    steady:    one forward then one backward, until every forward is done,
    cool-down: the remaining backwards.
At most min(p-s, m) microbatches are in flight on stage s at any time, so
activation memory is bounded by the pipeline depth instead of m.
"""


def bubble_formula(pp: int, microbatches: int):
    """Idle fraction of each rank: m microbatches fill and drain p stages (AFAB and 1F1B alike)."""
    return "(p-1)/(m+p-1)", (pp - 1) / (microbatches + pp - 1)


def warmup_microbatches(pp: int, stage: int, microbatches: int) -> int:
    """Forwards stage `stage` runs before its first backward."""
    return min(pp - stage - 1, microbatches)


def peak_microbatches_in_flight(schedule: str, pp: int, stage: int, microbatches: int) -> int:
    """Microbatches whose activations a stage holds at once, at most."""
    return microbatches if schedule == "afab" else min(pp - stage, microbatches)


class MicrobatchRunner:
    """Runs microbatch forwards and backwards on a stage and remembers what the backward needs."""

    def __init__(self, stage, mb_inputs, mb_targets, sync_gradients):
        self.stage, self.mb_inputs, self.mb_targets = stage, mb_inputs, mb_targets
        self.sync_gradients = sync_gradients
        self.inputs, self.outputs, self.loss = {}, {}, None

    def forward(self, mb, x):
        """x is the received activation, or None on the first stage (it reads tokens)."""
        x = self.mb_inputs[mb] if x is None else x
        out = self.stage.forward(mb, x, self.mb_targets[mb])
        if self.stage.is_last:
            self.loss = out.detach() if self.loss is None else self.loss + out.detach()
        self.inputs[mb] = x
        # With recompute the backward rebuilds the output: holding it would pin one activation per microbatch.
        self.outputs[mb] = None if self.stage.recompute else out
        return out

    def backward(self, mb, out_grad):
        input_grad = self.stage.backward(mb, self.inputs.pop(mb), self.outputs.pop(mb), out_grad)
        if mb == len(self.mb_inputs) - 1:
            self.sync_gradients()  # this rank's last backward: one all-reduce per optimizer step
        return input_grad


def afab_forward_backward(stage, comm, mb_inputs, mb_targets, sync_gradients):
    """Every forward, then every backward, in microbatch order on every stage."""
    run = MicrobatchRunner(stage, mb_inputs, mb_targets, sync_gradients)
    for mb in range(len(mb_inputs)):
        out = run.forward(mb, comm.recv_forward(mb))
        comm.send_forward(out, mb)
        stage.deallocate_output(mb, out)
    for mb in range(len(mb_inputs)):
        comm.send_backward(run.backward(mb, comm.recv_backward(mb)), mb)
    return run.loss


def one_f_one_b_forward_backward(stage, comm, mb_inputs, mb_targets, sync_gradients):
    """Warm-up forwards, then alternate one forward and one backward, then the remaining backwards."""
    run = MicrobatchRunner(stage, mb_inputs, mb_targets, sync_gradients)
    microbatches = len(mb_inputs)
    warmup = warmup_microbatches(comm.pgm.pp, comm.pgm.stage, microbatches)
    steady = microbatches - warmup

    for mb in range(warmup):
        out = run.forward(mb, comm.recv_forward(mb))
        comm.send_forward(out, mb)
        stage.deallocate_output(mb, out)

    x = comm.recv_forward(warmup) if steady else None
    for i in range(steady):
        fwd_mb, bwd_mb = warmup + i, i  # forward the newest microbatch, backward the oldest
        out = run.forward(fwd_mb, x)
        # Hand the output on and wait for the gradient of the oldest microbatch in one exchange:
        # the next stage is sending that gradient to us right now.
        out_grad = comm.send_forward_recv_backward(out, fwd_mb, bwd_mb)
        stage.deallocate_output(fwd_mb, out)
        input_grad = run.backward(bwd_mb, out_grad)
        if i == steady - 1:
            comm.send_backward(input_grad, bwd_mb)
        else:  # send the gradient back while the previous stage sends our next input
            x = comm.send_backward_recv_forward(input_grad, bwd_mb, fwd_mb + 1)

    for mb in range(steady, microbatches):
        comm.send_backward(run.backward(mb, comm.recv_backward(mb)), mb)
    return run.loss


SCHEDULES = {"afab": afab_forward_backward, "1f1b": one_f_one_b_forward_backward}

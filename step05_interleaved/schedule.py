"""Pipeline schedules: AFAB, 1F1B, and interleaved 1F1B with virtual stages.

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

Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM) cuts the model into p*v
chunks; rank r holds chunks r, r+p, r+2p, ... (v "virtual stages"), so each
microbatch goes round the ring of ranks v times. A rank's work per microbatch
is split into v pieces that are each 1/v as long, so filling and draining the
pipeline costs 1/v as much time: the bubble falls to (p-1)/(v*m) of the
compute time, (p-1)/(v*m+p-1) of the step, at the price of v times more
point-to-point messages. The
schedule runs "virtual microbatches" k = 0 .. m*v-1: groups of p microbatches
go through chunk 0, then the same group through chunk 1, and so on; backwards
visit the chunks in the opposite order. This grouping needs m to be a multiple of p.
"""


def bubble_formula(pp: int, microbatches: int, virtual: int = 1):
    """Idle fraction of each rank's step: m microbatches fill and drain p stages (AFAB and 1F1B alike).

    With v virtual stages the fill and drain take 1/v as long: the bubble is (p-1)/(v*m) of the
    ideal compute time (the ratio Megatron-LM's paper quotes), i.e. (p-1)/(v*m+p-1) of the step.
    """
    if virtual == 1:
        return "(p-1)/(m+p-1)", (pp - 1) / (microbatches + pp - 1)
    return "(p-1)/(v*m+p-1)", (pp - 1) / (virtual * microbatches + pp - 1)


def warmup_microbatches(pp: int, stage: int, microbatches: int) -> int:
    """Forwards stage `stage` runs before its first backward."""
    return min(pp - stage - 1, microbatches)


def interleaved_warmup(pp: int, stage: int, microbatches: int, virtual: int) -> int:
    """Virtual-microbatch forwards before the first backward: enough to keep every chunk busy."""
    return min((pp - stage - 1) * 2 + (virtual - 1) * pp, microbatches * virtual)


def peak_microbatches_in_flight(schedule: str, pp: int, stage: int, microbatches: int, virtual: int = 1) -> int:
    """(Virtual) microbatches whose activations a stage holds at once, at most."""
    if schedule == "afab":
        return microbatches
    if schedule == "1f1b":
        return min(pp - stage, microbatches)
    return min(interleaved_warmup(pp, stage, microbatches, virtual) + 1, microbatches * virtual)


def virtual_microbatch(k: int, pp: int, virtual: int, forward: bool):
    """(model chunk of this rank, microbatch) of the k-th virtual microbatch, in forward or backward order."""
    chunk = (k // pp) % virtual
    return (chunk if forward else virtual - 1 - chunk), (k // (pp * virtual)) * pp + k % pp


class MicrobatchRunner:
    """Runs microbatch forwards and backwards on a rank's stages (model chunks) and remembers
    what each backward needs."""

    def __init__(self, stages, mb_inputs, mb_targets, sync_gradients):
        self.stages, self.mb_inputs, self.mb_targets = stages, mb_inputs, mb_targets
        self.sync_gradients = sync_gradients
        self.inputs, self.outputs, self.loss = {}, {}, None
        self.backwards_left = len(stages) * len(mb_inputs)

    def forward(self, mb, x, chunk=0):
        """x is the received activation; the model's first chunk reads tokens instead (x is None)."""
        stage = self.stages[chunk]
        x = self.mb_inputs[mb] if stage.is_first else x
        out = stage.forward(mb, x, self.mb_targets[mb])
        if stage.is_last:
            self.loss = out.detach() if self.loss is None else self.loss + out.detach()
        self.inputs[chunk, mb] = x
        # With recompute the backward rebuilds the output: holding it would pin one activation per microbatch.
        self.outputs[chunk, mb] = None if stage.recompute else out
        return out

    def backward(self, mb, out_grad, chunk=0):
        key = (chunk, mb)
        input_grad = self.stages[chunk].backward(mb, self.inputs.pop(key), self.outputs.pop(key), out_grad)
        self.backwards_left -= 1
        if self.backwards_left == 0:
            self.sync_gradients()  # this rank's last backward: one all-reduce per optimizer step
        return input_grad


def afab_forward_backward(stage, comm, mb_inputs, mb_targets, sync_gradients):
    """Every forward, then every backward, in microbatch order on every stage."""
    run = MicrobatchRunner([stage], mb_inputs, mb_targets, sync_gradients)
    for mb in range(len(mb_inputs)):
        out = run.forward(mb, comm.recv_forward(mb))
        comm.send_forward(out, mb)
        stage.deallocate_output(mb, out)
    for mb in range(len(mb_inputs)):
        comm.send_backward(run.backward(mb, comm.recv_backward(mb)), mb)
    return run.loss


def one_f_one_b_forward_backward(stage, comm, mb_inputs, mb_targets, sync_gradients):
    """Warm-up forwards, then alternate one forward and one backward, then the remaining backwards."""
    run = MicrobatchRunner([stage], mb_inputs, mb_targets, sync_gradients)
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


def interleaved_forward_backward(stages, comm, mb_inputs, mb_targets, sync_gradients):
    """1F1B over virtual microbatches. Every exchange with the ring neighbours is one batched call,
    so a rank sends its newest output and oldest input gradient while receiving what comes next."""
    run = MicrobatchRunner(stages, mb_inputs, mb_targets, sync_gradients)
    pp, rank, virtual = comm.pgm.pp, comm.pgm.stage, len(stages)
    total, last_chunk = len(mb_inputs) * virtual, pp * virtual - 1

    def where(k, forward):
        """(chunk, microbatch, global chunk index) of virtual microbatch k."""
        chunk, mb = virtual_microbatch(k, pp, virtual, forward)
        return chunk, mb, chunk * pp + rank

    def input_label(k):
        """The activation that virtual forward k receives; None past the end or where it reads tokens."""
        if k >= total:
            return None
        _, mb, g = where(k, True)
        return (g - 1, mb) if g > 0 else None

    def grad_label(k):
        """The output gradient that virtual backward k receives; None past the end or where it starts
        from the loss."""
        if k >= total:
            return None
        _, mb, g = where(k, False)
        return (g, mb) if g < last_chunk else None

    def forward(k, x):
        chunk, mb, g = where(k, True)
        out = run.forward(mb, x, chunk)
        return out, (None if g == last_chunk else (out, (g, mb)))

    def backward(k, out_grad):
        chunk, mb, g = where(k, False)
        input_grad = run.backward(mb, out_grad, chunk)
        return None if g == 0 else (input_grad, (g - 1, mb))

    def deallocate(k, out):
        chunk, mb, _ = where(k, True)
        stages[chunk].deallocate_output(mb, out)

    warmup = interleaved_warmup(pp, rank, len(mb_inputs), virtual)
    x, grad = comm.exchange_ring(recv_input=input_label(0), recv_grad=grad_label(0) if warmup == 0 else None)
    for k in range(warmup):
        out, send = forward(k, x)
        first_grad = grad_label(0) if k == warmup - 1 else None  # the steady state starts with backward 0
        x, grad = comm.exchange_ring(output=send, recv_input=input_label(k + 1), recv_grad=first_grad)
        deallocate(k, out)
    for i in range(total - warmup):
        k_fwd, k_bwd = warmup + i, i
        out, send = forward(k_fwd, x)
        send_grad = backward(k_bwd, grad)
        x, grad = comm.exchange_ring(output=send, input_grad=send_grad, recv_input=input_label(k_fwd + 1),
                                     recv_grad=grad_label(k_bwd + 1))
        deallocate(k_fwd, out)
    for k in range(total - warmup, total):
        _, grad = comm.exchange_ring(input_grad=backward(k, grad), recv_grad=grad_label(k + 1))
    return run.loss


SCHEDULES = {"afab": afab_forward_backward, "1f1b": one_f_one_b_forward_backward,
             "interleaved": interleaved_forward_backward}

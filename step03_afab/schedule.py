"""All-forward-all-backward (AFAB): GPipe's schedule, written on the engine.

Every microbatch goes forward through this stage, then every microbatch goes
backward, in the same order on every stage so each receive meets its send.
The stage keeps the inputs and outputs of all m microbatches until their
backward: activation memory grows with m (step 04 fixes that).
"""


def bubble_formula(pp: int, microbatches: int):
    """Idle fraction of each rank when m microbatches fill and drain p stages."""
    return "(p-1)/(m+p-1)", (pp - 1) / (microbatches + pp - 1)


def afab_forward_backward(stage, comm, mb_inputs, mb_targets, sync_gradients):
    """One optimizer step's forwards and backwards; returns the loss summed over microbatches (last stage)."""
    microbatches = len(mb_inputs)
    inputs, outputs, loss = [], [], None
    for mb in range(microbatches):
        x = comm.recv_forward(mb)  # None on the first stage: it reads tokens
        x = mb_inputs[mb] if x is None else x
        out = stage.forward(mb, x, mb_targets[mb])
        comm.send_forward(out, mb)
        if stage.is_last:
            loss = out.detach() if loss is None else loss + out.detach()
        inputs.append(x)
        # With recompute the backward rebuilds the output: holding it would pin one activation per microbatch.
        outputs.append(None if stage.recompute else out)
    for mb in range(microbatches):
        out_grad = comm.recv_backward(mb)  # None on the last stage: its output is the loss
        comm.send_backward(stage.backward(mb, inputs[mb], outputs[mb], out_grad), mb)
        inputs[mb] = outputs[mb] = None  # let this microbatch's graph go
    sync_gradients()  # after the last backward: one all-reduce per optimizer step
    return loss

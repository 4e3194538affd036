"""After the schedule, before the optimizer step: every gradient made the one the optimizer must apply.

Megatron-LM does this in one function, finalize_model_grads (megatron/core/distributed/finalize_model_grads.py),
which train.compute_gradients calls once per optimizer step, after the schedule has run every backward and sent
every gradient. Every reduction here is one all-reduce of one flat buffer (all_reduce_flat): one message, not one
per tensor.

Data parallelism across pipelines: average each stage's gradients over its replicas. Each data-parallel replica of
a stage saw a different shard of the global batch. Averaging their gradients gives the gradient of the mean loss
over the whole global batch (all shards are the same size). Gradients accumulate locally over the microbatches
first, so one all-reduce moves them all, instead of one per microbatch.
"""
import torch
import torch.distributed as dist

from support import timeline


def all_reduce_flat(grads, group, what=None, divide_by=1):
    """Sum `grads` over `group` as one flat buffer (one timeline box), divide by `divide_by`, and give each
    gradient its part back."""
    with timeline.span("allreduce", what=what):
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        if divide_by != 1:
            flat /= divide_by
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def average_gradients(model, pgm):
    """All-reduce this stage's gradients over its data-parallel group and divide by its size."""
    if pgm.dp == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    all_reduce_flat(grads, pgm.dp_group, divide_by=pgm.dp)


def finalize_model_grads(model, pgm):
    """Every reduction the gradients need once the schedule is done (called once per optimizer step)."""
    average_gradients(model, pgm)

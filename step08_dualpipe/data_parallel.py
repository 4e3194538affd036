"""Data parallelism across pipelines: average each stage's gradients over its replicas.

Each data-parallel replica of a stage saw a different shard of the global batch.
Averaging their gradients gives the gradient of the mean loss over the whole
global batch (all shards are the same size). It is done once per optimizer
step, after the schedule has run every backward and sent every gradient
(train.compute_gradients): gradients accumulate locally over the microbatches
first, so one all-reduce moves them all, instead of one per microbatch.
"""
import torch
import torch.distributed as dist


def average_gradients(grads, pgm, timeline):
    """All-reduce this stage's gradients (the fp32 sums over its microbatches) over its data-parallel
    group, in one flat buffer."""
    if pgm.dp == 1:
        return
    grads = [g for g in grads if g is not None]
    with timeline.span("allreduce"):
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=pgm.dp_group)  # sum over the replicas of this stage
        flat /= pgm.dp
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

"""After the schedule, before the optimizer step: every gradient made the one the optimizer must apply.

Megatron-LM does this in one function, finalize_model_grads (megatron/core/distributed/finalize_model_grads.py),
which train.compute_gradients calls once per optimizer step, after the schedule has run every backward and sent
every gradient. Every reduction here is one all-reduce of one flat buffer (all_reduce_flat): one message, not one
per tensor.

Data parallelism across pipelines: average each stage's gradients over its replicas. Each data-parallel replica of
a stage saw a different shard of the global batch. Averaging their gradients gives the gradient of the mean loss
over the whole global batch (all shards are the same size). Gradients accumulate locally over the microbatches
first, so one all-reduce moves them all, instead of one per microbatch.

Tied embeddings across the pipeline: one matrix, two stages (Megatron-LM's
embedding group). With tied embeddings the LM head multiplies by the embedding
matrix. On one stage the two uses share one parameter, and autograd sums their
gradients. With pp > 1 the embedding lives on the first stage and the head on
the last, so each of them holds a copy (model.Transformer makes the last
stage's copy equal to the first's). Summing the two copies' gradients over the
embedding group, the first and last stage of each pipeline at the same
(dp_rank, tp_rank), gives each copy the gradient of the shared matrix; both
then take the same optimizer step and stay equal. Under tensor parallelism
both copies are the same vocabulary rows, so shard meets shard.
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


def average_gradients(grads, pgm):
    """All-reduce this stage's gradients (the fp32 sums over its microbatches) over its data-parallel
    group and divide by its size."""
    if pgm.dp == 1:
        return
    grads = [g for g in grads if g is not None]
    all_reduce_flat(grads, pgm.dp_group, divide_by=pgm.dp)


def average_expert_gradients(grads, pgm):
    """Step 08, experts.py: an expert's gradient already sums the tokens its expert group (ep replicas) sent it.
    Summed over the dp/ep groups that hold a copy of it, it has every replica's tokens; divided by dp, it is the
    gradient of the global batch's mean loss, as the averaged gradients of the rest of the model are."""
    if pgm.dp // pgm.ep > 1:
        all_reduce_flat(grads, pgm.expert_dp_group, what="expert gradients", divide_by=pgm.dp)
    elif pgm.dp > 1:  # one copy of each expert: nothing to add, only the 1/dp of the mean
        for g in grads:
            g /= pgm.dp


def sum_embedding_grads(model, pgm):
    """All-reduce the tied embedding's gradient between the first and the last stage
    (call it only with tied embeddings: untied, the first stage's embedding has no partner)."""
    weight = dict(model.named_parameters()).get("embed.weight")
    if pgm.embedding_group is None or weight is None:
        return  # pp = 1 (autograd summed the two uses already), or a middle stage
    grad = getattr(weight, "main_grad", weight.grad)  # the fp32 main_grad if half
    all_reduce_flat([grad], pgm.embedding_group, what="tied embedding gradient")


def sum_twin_gradients(named_grads: dict, group):
    """DualPipe: all-reduce (sum) each stage's gradients between its two copies, on ranks r and p-1-r. Each
    copy summed one direction's microbatches; the sum is the whole batch's, so both take the same optimizer
    step and stay equal. Both hold the same parameter names: sorted by name, their flat buffers line up."""
    all_reduce_flat([g for _, g in sorted(named_grads.items())], group, what="twin stage gradients")


def finalize_model_grads(model, grads, pgm, tie_embeddings=False):
    """Every reduction the gradients need once the schedule is done (called once per optimizer step).
    grads: the optimizer's gradient of each parameter of model, in order (main_grads)."""
    if pgm.twin_group is not None:  # DualPipe: each stage's two copies saw one direction each
        names = [name for name, _ in model.named_parameters()]
        sum_twin_gradients(dict(zip(names, grads)), pgm.twin_group)
    experts = [getattr(p, "expert", False) for p in model.parameters()]  # experts.py: held by dp/ep replicas
    average_gradients([g for g, e in zip(grads, experts) if not e], pgm)
    if any(experts):
        average_expert_gradients([g for g, e in zip(grads, experts) if e], pgm)
    if tie_embeddings:  # the embedding's two copies get the shared matrix's gradient
        sum_embedding_grads(model, pgm)

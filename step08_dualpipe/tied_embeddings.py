"""Tied embeddings across the pipeline: one matrix, two stages (Megatron-LM's embedding group).

With tied embeddings the LM head multiplies by the embedding matrix. On one
stage the two uses share one parameter, and autograd sums their gradients.
With pp > 1 the embedding lives on the first stage and the head on the last,
so each of them holds a copy (model.Transformer makes the last stage's copy
equal to the first's). Summing the two copies' gradients over the embedding
group, the first and last stage of each pipeline at the same (dp_rank,
tp_rank), gives each copy the gradient of the shared matrix; both then take
the same optimizer step and stay equal. Under tensor parallelism both copies
are the same vocabulary rows, so shard meets shard.
"""
import torch.distributed as dist


def sum_embedding_grads(model, pgm, timeline):
    """All-reduce the tied embedding's gradient between the first and the last stage
    (call it only with tied embeddings: untied, the first stage's embedding has no partner)."""
    weight = dict(model.named_parameters()).get("embed.weight")
    if pgm.embedding_group is None or weight is None:
        return  # pp = 1 (autograd summed the two uses already), or a middle stage
    with timeline.span("allreduce", what="tied embedding gradient"):  # step 07: the fp32 main_grad if half
        dist.all_reduce(getattr(weight, "main_grad", weight.grad), group=pgm.embedding_group)

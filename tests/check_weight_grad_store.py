"""Step 08's B/W split against one undivided backward, bitwise.

    (2 ranks)  python tests/check_weight_grad_store.py STEP_DIR OUT.json

Each case builds two equal copies of a small model: the whole model on each rank (tp 1), or its TP
shards over both ranks (tp 2), in fp32 or bf16. Both copies run the forwards of two microbatches. One
copy runs each backward whole; the other runs B of both (its Linear weight gradients wait in the
WeightGradStore), then both W's. Every parameter's gradient must be bitwise equal, and the store
empty. Control: the split copy with its W's never run, which must differ (no Linear weight gradients).
"""
import os
import sys

import torch

from harness import write_per_rank

FLAGS = dict(n_layers=2, hidden=32, n_heads=2, seq_len=16)
MICROBATCHES = 2


def build(modules, tp, dtype):
    """A PipelineStage over the whole model (tp 1) or this rank's shard of it (tp 2), with an activation
    meter as train.py gives it (its saved-tensor hooks must not change what W computes)."""
    model, stage, tensor_parallel, memory, dist = modules
    group = tensor_parallel.TPGroup(dist.group.WORLD, dist.get_rank(), 2) if tp == 2 else tensor_parallel.TPGroup()
    net = model.Transformer(model.ModelConfig(**FLAGS), seed=0, tp=group).to(dtype)
    return stage.PipelineStage(net, meter=memory.ActivationMeter(net))


def gradients(stage, batches, split, run_weights=True):
    """Forwards of every microbatch, then their backwards, whole or as B's then W's; returns name -> grad."""
    from weight_grad_store import WeightGradStore
    with WeightGradStore.splittable(split):  # as a splitting schedule's Stash runs its forwards
        outs = [stage.forward(mb, x, y) for mb, (x, y) in enumerate(batches)]
    for mb, ((x, _), out) in enumerate(zip(batches, outs)):
        stage.backward(mb, x, out, torch.full_like(out, 1 / len(batches)), split=split)
    for mb in range(len(batches)) if split and run_weights else []:
        stage.backward_weights(mb)
    return {n: p.grad for n, p in stage.model.named_parameters()}


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(
        (a[n] is None and b[n] is None) or (a[n] is not None and b[n] is not None and torch.equal(a[n], b[n]))
        for n in a)


def main(step_dir, out):
    sys.path.insert(0, os.path.abspath(step_dir))
    torch.set_num_threads(1)
    from support import distributed, memory
    import model
    import stage
    import tensor_parallel
    import torch.distributed as dist
    from weight_grad_store import WeightGradStore

    distributed.init_distributed("cpu", 60)
    modules = (model, stage, tensor_parallel, memory, dist)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (MICROBATCHES, 2, FLAGS["seq_len"] + 1), generator=generator)
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]  # the same on both ranks
    found = {}
    for tp in (1, 2):
        for dtype in (torch.float32, torch.bfloat16):
            whole = gradients(build(modules, tp, dtype), batches, split=False)
            split = gradients(build(modules, tp, dtype), batches, split=True)
            left = len(WeightGradStore.queue)
            unrun = gradients(build(modules, tp, dtype), batches, split=True, run_weights=False)
            WeightGradStore.queue.clear()  # the control's W's, never to run
            found[f"tp{tp} {dtype}"] = dict(equal=same(whole, split), store_empty=left == 0,
                                            control_equal=same(whole, unrun),
                                            deferred=sum(g is None for g in unrun.values()))
    write_per_rank(found, out)
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])

"""The course's schedules beside PyTorch's own pipelining, on the same model, weights and batch.

    torchrun --nproc_per_node 2 tests/torch_pp.py STEP_DIR grads|control OUT.json [train.py flags]
    torchrun --nproc_per_node 2 tests/torch_pp.py STEP_DIR bench OUT.json ROUNDS [train.py flags]

Each rank builds the step's own run (train.build) and, from the step's own
Transformer chunks with the same seed, torch.distributed.pipelining
PipelineStages and the matching schedule:

    afab -> ScheduleGPipe,  1f1b -> Schedule1F1B,  interleaved -> ScheduleInterleaved1F1B,
    zb1p (step 08) -> ScheduleInterleavedZeroBubble (torch's ZB1P, here with one stage per rank)
    dualpipev (step 08) -> ScheduleDualPipeV (rank r holds stages r and 2p-1-r)
    zbv, looped-bfs (step 08, torch_schedules.py's lists) -> ScheduleZBVZeroBubble, ScheduleLoopedBFS
    --schedule-file PATH (step 08, a list of actions) -> torch's schedule class named by the file's
        stem, e.g. ScheduleInterleaved1F1B.csv

grads: one step of each; rank 0 writes, per schedule, whether every gradient is
bitwise equal (and the largest difference). Our last stage seeds its backward with
1/m; torch divides the summed gradients by m after the step. For m a power of two
both are exact scalings, so the gradients can be bitwise equal.

bench: ROUNDS rounds, each one training step of ours and one of torch's, in
alternating order, each timed between barriers; rank 0 writes the step times, and
whether the gradients of the uncounted first round (the same batch and weights for
both) were bitwise equal, as in grads.
Ours is train.py's step as it runs after the first step (timeline on, meter off).
"""
import json
import os
import sys
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import schedules
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                          ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleLoopedBFS,
                                          ScheduleZBVZeroBubble)

TORCH_SCHEDULES = {"afab": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
                   "zb1p": ScheduleInterleavedZeroBubble,  # torch's ZB1P, one stage per rank here
                   "dualpipev": ScheduleDualPipeV, "zbv": ScheduleZBVZeroBubble, "looped-bfs": ScheduleLoopedBFS}


@contextmanager
def plain_linear():
    """Step 08: torch's zero-bubble schedules split the backward themselves (autograd.grad for the inputs,
    then for the weights), so while torch runs, the course's modules call plain F.linear instead of the
    course's Linear, whose backward adds dW itself and hands autograd no weight gradient."""
    modules = [m for m in (sys.modules.get("tensor_parallel"), sys.modules.get("model")) if hasattr(m, "linear")]
    course = [m.linear for m in modules]
    for m in modules:
        m.linear = F.linear
    try:
        yield
    finally:
        for m, linear in zip(modules, course):
            m.linear = linear


def chunk_layout(args, stage):
    """(global chunks of this rank, chunks in all): the step's own layout where it has one (step 08)."""
    config = sys.modules["config"]
    if hasattr(config, "model_chunks"):
        return config.model_chunks(args, stage)
    n_chunks = args.pp * getattr(args, "virtual_stages", 1)
    return list(range(stage, n_chunks, args.pp)), n_chunks


def torch_pipeline(train, model, run):
    """torch's stages over fresh copies of this rank's chunks, its schedule, and an AdamW like ours."""
    args, pgm = run.args, run.pgm
    ids, n_chunks = chunk_layout(args, pgm.stage)
    layers = model.split_layers(args.layers, n_chunks)
    chunks = [model.Transformer(train.model_config(args), layers[g], first=g == 0, last=g == n_chunks - 1,
                                seed=args.seed).to(run.device) for g in ids]
    stages = [PipelineStage(chunk, g, n_chunks, run.device, group=pgm.pp_group) for chunk, g in zip(chunks, ids)]
    listed = getattr(args, "schedule_file", None)  # step 08: a list, compared with the class its file is named after
    kind = getattr(schedules, os.path.basename(listed).split(".")[0]) if listed else TORCH_SCHEDULES[args.schedule]
    several = args.schedule in ("interleaved", "zb1p", "dualpipev", "file", "zbv", "looped-bfs")  # a list of stages
    schedule = kind(stages if several else stages[0], args.microbatches, loss_fn=model.lm_loss)
    params = [p for chunk in chunks for p in chunk.parameters()]
    return chunks, schedule, torch.optim.AdamW(params, lr=args.lr)


def torch_gradients(data, run, chunks, schedule, step):
    """One torch step's forwards and backwards on the same global batch as ours."""
    inputs, targets = data.get_batch(run.tokens, step, run.args.batch_size, run.args.seq_len, run.args.seed)
    for chunk in chunks:
        chunk.zero_grad(set_to_none=True)
    first = [inputs.to(run.device)] if any(chunk.first for chunk in chunks) else []
    last = dict(target=targets.to(run.device), losses=[]) if any(chunk.last for chunk in chunks) else {}
    with plain_linear():
        schedule.step(*first, **last)


def compare(run, chunks):
    ours = {n: p.grad for n, p in run.model.named_parameters()}
    theirs = {n: p.grad for chunk in chunks for n, p in chunk.named_parameters()}
    assert ours.keys() == theirs.keys(), (sorted(ours), sorted(theirs))
    return dict(bitwise=all(torch.equal(ours[n], theirs[n]) for n in ours),
                max_abs_diff=max((ours[n] - theirs[n]).abs().max().item() for n in ours))


def main(step_dir, mode, out, *rest):
    sys.path.insert(0, os.path.abspath(step_dir))
    import data
    import model
    import train
    from support.distributed import init_distributed

    rounds, flags = (int(rest[0]), list(rest[1:])) if mode == "bench" else (0, list(rest))
    args = train.parse_args(flags)
    run = train.build(args, init_distributed(args.device, args.timeout))
    chunks, schedule, optimizer = torch_pipeline(train, model, run)
    if mode in ("grads", "control"):  # control: torch on the next batch, which must not match
        train.compute_gradients(run, 0)
        torch_gradients(data, run, chunks, schedule, int(mode == "control"))
        results = [None] * dist.get_world_size()
        dist.all_gather_object(results, compare(run, chunks))
        if dist.get_rank() == 0:
            json.dump(dict(schedule=args.schedule, ranks=results), open(out, "w"))
    else:
        instrument = getattr(train, "instrument", lambda run, step: None)

        def ours(step):
            instrument(run, max(step, 1))  # as train.py runs every step but the first
            train.train_step(run, step)

        def theirs(step):
            torch_gradients(data, run, chunks, schedule, step)
            optimizer.step()

        times, first_round = {"ours": [], "torch": []}, [None] * dist.get_world_size()
        for r in range(rounds + 1):  # round 0 warms both up and is not counted
            for name in (["ours", "torch"] if r % 2 else ["torch", "ours"]):
                dist.barrier()
                start = time.perf_counter()
                (ours if name == "ours" else theirs)(r)
                dist.barrier()
                if r:
                    times[name].append(time.perf_counter() - start)
            if r == 0:  # both took one step from the same weights on the same batch: their gradients are still there
                dist.all_gather_object(first_round, compare(run, chunks))
        if dist.get_rank() == 0:
            json.dump(dict(schedule=args.schedule, first_round=first_round, **times), open(out, "w"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])

"""Step 08 - the B/W split: input gradients now, weight gradients later; ZB-H1, DualPipe and DualPipeV.

    torchrun --nproc_per_node 2 step08_dualpipe/train.py --schedule zb1p
    torchrun --nproc_per_node 2 step08_dualpipe/train.py --schedule dualpipev

A backward runs in two parts: B, the input's gradient, which the previous stage waits for, and W, the weights'
gradients, which wait until the schedule has idle time. --schedule zb1p is 1F1B with stage s postponing s W's;
dualpipe and dualpipev (DeepSeek-V3) run microbatches both ways through the pipeline, pairing one's forward with
another's backward (--pairs sequential on a CPU). The other schedules run each backward whole, as in step 07.

Opening the course here? This folder is the whole course in one program, and the map below has a line for someone
new to pipelines. New in this step: weight_grad_store.py, then dualpipe.py.

Read in this order (support/ holds what keeps a run measured and safe: a first reading can skip it):
  New to pipelines?     schedule.py's one_f_one_b_forward_backward, then Stash, PipelineStage, PipelineComm.communicate
  model.py              split_layers and Transformer(first, last): the layers one stage holds
  tensor_parallel.py    a stage's layers split over the TP ranks
  weight_grad_store.py  the Linear whose backward splits into B now and W later
  process_groups.py     who is whom: this rank's place in the grid, its neighbours, its groups
  p2p.py                how tensors move: transfers queued and committed; Megatron's verbs
  stage.py              one stage: the forward and backward of one microbatch
  schedule.py           what a rank keeps (the Stash), the schedules, their formulas
  dualpipe.py           DualPipe and DualPipeV: a schedule family of its own
  finalize_grads.py     after the schedule: the gradients' all-reduces
  mixed_precision.py    the optimizer step on fp32 masters, with loss_scaler.py's loss scale
  train.py              this file: build, one step, the training loop
  config.py, data.py    the flags and their rules; a batch from (seed, step)
  pipedream.py          the side road: --schedule pipedream, 1F1B with no flush (step 04)
  schedule_lab.py       another side road: any schedule as a list of actions (--schedule-file, --dump-schedule)
  torch_schedules.py    PyTorch's ZB-V and Looped BFS as such lists (--schedule zbv, --schedule looped-bfs)
  experts.py            another side road: a mixture of experts, spread over replicas (--experts, --ep)
  overlap.py            its pair overlapped: layers as nodes, all-to-alls behind compute (--link-latency-ms)
"""
if __name__ == "__main__":  # first: Ctrl-C while torch loads ends with the course's line (support/progress.py)
    from support.progress import stop_on_ctrl_c
    stop_on_ctrl_c()
import time
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

import experts
import overlap
from support import checkpoint
from config import family, model_chunks, parse_flags
from data import check_same_corpus, get_batch, load_tokens
from support.distributed import (init_distributed, one_line_errors, reset_peak_memory, shutdown, stop_if_diverged,
                                 wait_for_device)
from model import ModelConfig, Transformer, split_layers
from tensor_parallel import TPGroup
from finalize_grads import average_gradients, finalize_model_grads
from mixed_precision import DTYPES, MixedPrecisionOptimizer, make_scaler
from support.memory import ActivationMeter
from p2p import PipelineComm
from process_groups import ProcessGroupManager
from dualpipe import twin_copies
from schedule_lab import dump_schedule
from stage import VirtualStages
from support.report import gather_peaks, log_step, open_log, report
from support.timeline import Timeline, install


def parse_args(argv=None):
    """Parse and check the flags; a broken rule ends every rank with one line from rank 0."""
    return parse_flags(argv, __doc__)


def model_config(args) -> ModelConfig:
    """The whole model's shape, from the flags: every rank builds its part of the same model."""
    return ModelConfig(n_layers=args.layers, hidden=args.hidden, n_heads=args.heads, seq_len=args.seq_len,
                       tie_embeddings=args.tie_embeddings, experts=args.experts, top_k=args.top_k)


@dataclass
class Run:
    """Everything one rank trains with."""
    args: object
    device: torch.device
    pgm: ProcessGroupManager
    model: torch.nn.Module  # all of this rank's parameters, named as in the whole model
    optimizer: MixedPrecisionOptimizer
    stages: list  # this rank's PipelineStages
    comm: PipelineComm
    tokens: torch.Tensor
    timeline: Timeline
    meter: ActivationMeter


def build_model(args, pgm, tp):
    """This rank's TP shard of its model chunks (config.model_chunks: virtual stages stage, stage + pp, ...)."""
    chunks, n_chunks = model_chunks(args, pgm.stage)
    layers_of_chunk = split_layers(args.layers, n_chunks)
    return VirtualStages(Transformer(model_config(args), layers_of_chunk[g], first=g == 0, last=g == n_chunks - 1,
                                     seed=args.seed, tp=tp, ep=experts.ep_group(args, pgm)) for g in chunks)


def build(args, device) -> Run:
    """This rank's place in the grid, its model chunks, optimizer, data, timeline and meters."""
    pgm = ProcessGroupManager(args.pp, args.dp, args.timeout, tp=args.tp, twins=twin_copies(args),
                              ep=args.ep if args.experts else 0)
    timeline = Timeline(dist.get_rank(), device)
    install(timeline)  # the engine records into this process's timeline
    dtype = DTYPES[args.precision]  # the stages compute in it; the norms and the loss upcast to fp32
    model = build_model(args, pgm, TPGroup(pgm.tp_group, pgm.tp_rank, pgm.tp)).to(device, dtype)
    if twin_copies(args):  # the reverse direction's copy of a stage another rank also holds
        for p in model[1].parameters():
            p.shared = True  # count it once in the gradient norm (step 07)
    # AdamW on fp32 masters, defaults but the learning rate; in fp32, the single-device reference's arithmetic.
    optimizer = MixedPrecisionOptimizer(model, args, pgm, make_scaler(args))
    meter = ActivationMeter(model)
    # PipeDream: each update's dp average (fp32: its stages step alone, config.py)
    before_update = lambda: average_gradients([p.grad for p in model.parameters()], pgm)
    stage = family(args).stage_class(args, model, before_update)  # PipeDream's keeps weight versions
    stages = [stage(chunk, chunk=c, recompute=args.recompute, deallocate=args.deallocate,
                    meter=meter, grad_scale_func=optimizer.scale_loss) for c, chunk in enumerate(model)]
    overlap.install(args, stages)  # with experts under DualPipe: the layers as nodes, and the simulated link
    shape = (args.batch_size // (args.dp * args.microbatches), args.seq_len, args.hidden)  # one microbatch
    comm = PipelineComm(pgm, shape, dtype, device, args.p2p, args.scatter_gather)  # pipeline_dtype
    return Run(args, device, pgm, model, optimizer, stages, comm, load_tokens(args.data), timeline, meter)


def replica_microbatches(run, inputs, targets):
    """This data-parallel replica's rows of the global batch, as m (tokens, targets) microbatches.

    Every TP rank of a replica takes the same rows: they compute one stage's slices of the same
    microbatch. get_batch draws the batch from (seed, step) alone, so they agree with no broadcast."""
    rows = run.args.batch_size // run.args.dp
    mine = slice(run.pgm.dp_rank * rows, (run.pgm.dp_rank + 1) * rows)
    return list(zip(inputs[mine].to(run.device).chunk(run.args.microbatches),
                    targets[mine].to(run.device).chunk(run.args.microbatches)))


def share_loss(run, loss):
    """The batch's mean loss on every rank: summed along each pipeline (only the ranks that compute a
    loss hold a nonzero value), then averaged over the replicas."""
    pgm = run.pgm
    value = torch.zeros((), device=run.device) if loss is None else loss.float()
    dist.all_reduce(value, group=pgm.pp_group)
    if pgm.dp > 1:
        dist.all_reduce(value, group=pgm.dp_group)
        value /= pgm.dp
    return value.item()


def compute_gradients(run, step: int) -> float:
    """Forwards and backwards of one global batch; leaves the replica-averaged gradients in run.model."""
    inputs, targets = get_batch(run.tokens, step, run.args.batch_size, run.args.seq_len, run.args.seed)
    run.optimizer.zero_grad()
    experts.start_step(run.args, run.optimizer.loss_scale)  # with experts: the aux losses' seed
    run.comm.begin_step()
    microbatches = replica_microbatches(run, inputs, targets)
    loss = family(run.args).schedule_of(run.args)(run.stages, run.comm, microbatches)
    run.comm.finish_sends()
    # Megatron's finalize_model_grads: one all-reduce per optimizer step, after the schedule, when this
    # rank's last input gradient has been delivered: the previous stage never waits for this all-reduce.
    finalize_model_grads(run.model, run.optimizer.main_grads(), run.pgm, run.args.tie_embeddings)
    return share_loss(run, loss)


def instrument(run, step: int):
    """Measure only what the report shows: the timeline on every step but the first, which pays one-off
    start-up costs, and the activation meter on the last step. Switched off, they cost nothing."""
    run.timeline.enabled = step > 0 or run.args.steps == 1
    run.meter.enabled = step == run.args.steps - 1


def start_recording(run, step: int):
    """While the timeline records, all ranks start a step together, from a barrier."""
    reset_peak_memory(run.device)
    if run.timeline.enabled:
        dist.barrier()
    run.timeline.start_step(step)


def train_step(run, step: int) -> dict:
    """One optimizer step."""
    start_recording(run, step)
    start = time.perf_counter()
    loss = compute_gradients(run, step)
    update = run.optimizer.step()  # loss_scale, skipped, grad_norm: the same on every rank of a replica
    wait_for_device(run.device)  # the step ends when the GPU has run it (outside the schedule)
    elapsed = time.perf_counter() - start  # rank 0's step ends after the last stage's loss has reached it
    run.timeline.end_step()
    tokens = run.args.batch_size * run.args.seq_len
    return dict(step=step, loss=loss, step_time_s=elapsed, tokens_per_s=tokens / elapsed, **update,
                **experts.step_record(run.args, run.device))  # with experts: aux loss, tokens per expert


def flushed_steps(run, start=0):
    """One step per batch: the batch through the pipeline, drained, then the optimizer (from step `start` on: a
    resumed run goes on from its checkpoint's step)."""
    for step in range(start, run.args.steps):
        instrument(run, step)
        yield train_step(run, step)


def train(args):
    """The training loop on this rank: build the run (resumed from --resume), then each optimizer step (rank 0 prints
    it and logs it to --log-json; a diverged loss stops every rank; a checkpoint when --save-every says so), then
    the report."""
    device = init_distributed(args.device, args.timeout)
    run = build(args, device)
    check_same_corpus(run.tokens, args.data)  # before any step: one corpus on every node
    start = checkpoint.load(run, checkpoint.newest(args.resume)) if args.resume else 0  # steps already done
    log = open_log(args, start)
    records = family(args).train_steps(run, partial(flushed_steps, start=start), replica_microbatches, share_loss,
                                       start_recording)
    for step, record in enumerate(records, start):
        if step == args.steps - 1:
            record.update(gather_peaks(run))
        log_step(record, log, run.optimizer.scaler)
        stop_if_diverged(record)
        if checkpoint.due(args, step + 1):
            checkpoint.save(run, step + 1)
    if log:
        log.close()
    if args.dump_schedule:  # the actions of the last step, as a list that --schedule-file runs (schedule_lab.py)
        dump_schedule(run, model_chunks)
    report(run, record)


def main(argv=None):
    """Parse the flags, train, and close the process group; an error ends every rank with one line."""
    args = parse_args(argv)
    with one_line_errors(args.timeout):
        train(args)
    shutdown()


if __name__ == "__main__":
    main()

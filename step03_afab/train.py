"""Step 03 - the all-forward-all-backward engine, with data parallelism.

    torchrun --nproc_per_node 4 step03_afab/train.py --pp 2 --dp 2

The ranks form a (pp x dp) grid: dp replicas of a pp-stage pipeline, each running the AFAB schedule on its shard of
the global batch, split into --microbatches; the replicas of each stage then average their gradients. New here: the
engine, the five files from process_groups.py to finalize_grads.py below, in that order.

Read in this order (support/ holds what keeps a run measured and safe: a first reading can skip it):
  model.py              split_layers and Transformer(first, last): the layers one stage holds
  process_groups.py     who is whom: this rank's place in the grid, its neighbours, its groups
  p2p.py                how tensors move: transfers queued and committed; Megatron's verbs
  stage.py              one stage: the forward and backward of one microbatch
  schedule.py           what a rank keeps (the Stash), the schedules, their formulas
  finalize_grads.py     after the schedule: the gradients' all-reduces
  train.py              this file: build, one step, the training loop
  config.py, data.py    the flags and their rules; a batch from (seed, step)
"""
if __name__ == "__main__":  # first: Ctrl-C while torch loads ends with the course's line (support/progress.py)
    from support.progress import stop_on_ctrl_c
    stop_on_ctrl_c()
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from support import checkpoint
from config import parse_flags
from data import check_same_corpus, get_batch, load_tokens
from support.distributed import (init_distributed, one_line_errors, reset_peak_memory, shutdown, stop_if_diverged,
                                 wait_for_device)
from model import ModelConfig, Transformer, split_layers
from finalize_grads import finalize_model_grads
from support.memory import ActivationMeter
from p2p import PipelineComm
from process_groups import ProcessGroupManager
from schedule import afab_forward_backward
from stage import PipelineStage
from support.report import gather_peaks, log_step, open_log, report
from support.timeline import Timeline, install


def parse_args(argv=None):
    """Parse and check the flags; a broken rule ends every rank with one line from rank 0."""
    return parse_flags(argv, __doc__)


def model_config(args) -> ModelConfig:
    """The whole model's shape, from the flags: every rank builds its part of the same model."""
    return ModelConfig(n_layers=args.layers, hidden=args.hidden, n_heads=args.heads, seq_len=args.seq_len)


@dataclass
class Run:
    """Everything one rank trains with."""
    args: object
    device: torch.device
    pgm: ProcessGroupManager
    model: torch.nn.Module  # all of this rank's parameters, named as in the whole model
    optimizer: torch.optim.Optimizer
    stages: list  # this rank's PipelineStages
    comm: PipelineComm
    tokens: torch.Tensor
    timeline: Timeline
    meter: ActivationMeter


def build_model(args, pgm):
    """This rank's stage of the model."""
    layer_ids = split_layers(args.layers, args.pp)[pgm.stage]
    return Transformer(model_config(args), layer_ids, first=pgm.stage == 0,
                       last=pgm.stage == args.pp - 1, seed=args.seed)


def build(args, device) -> Run:
    """This rank's place in the grid, its stage of the model, optimizer, data, timeline and meters."""
    pgm = ProcessGroupManager(args.pp, args.dp, args.timeout)
    model = build_model(args, pgm).to(device)
    # Plain AdamW, defaults but the learning rate: the tests' single-device reference uses the same.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    timeline, meter = Timeline(dist.get_rank(), device), ActivationMeter(model)
    install(timeline)  # the engine records into this process's timeline
    stages = [PipelineStage(model, recompute=args.recompute, meter=meter)]
    shape = (args.batch_size // (args.dp * args.microbatches), args.seq_len, args.hidden)  # one microbatch
    comm = PipelineComm(pgm, shape, torch.float32, device)
    return Run(args, device, pgm, model, optimizer, stages, comm, load_tokens(args.data), timeline, meter)


def replica_microbatches(run, inputs, targets):
    """This data-parallel replica's rows of the global batch, as m (tokens, targets) microbatches."""
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
    run.optimizer.zero_grad(set_to_none=True)
    run.comm.begin_step()
    microbatches = replica_microbatches(run, inputs, targets)
    loss = afab_forward_backward(run.stages, run.comm, microbatches)
    run.comm.finish_sends()
    # Megatron's finalize_model_grads: one all-reduce per optimizer step, after the schedule, when this
    # rank's last input gradient has been delivered: the previous stage never waits for this all-reduce.
    finalize_model_grads(run.model, run.pgm)
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
    run.optimizer.step()
    wait_for_device(run.device)  # the step ends when the GPU has run it (outside the schedule)
    elapsed = time.perf_counter() - start  # rank 0's step ends after the last stage's loss has reached it
    run.timeline.end_step()
    tokens = run.args.batch_size * run.args.seq_len
    return dict(step=step, loss=loss, step_time_s=elapsed, tokens_per_s=tokens / elapsed)


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
    for step, record in enumerate(flushed_steps(run, start), start):
        if step == args.steps - 1:
            record.update(gather_peaks(run))
        log_step(record, log)
        stop_if_diverged(record)
        if checkpoint.due(args, step + 1):
            checkpoint.save(run, step + 1)
    if log:
        log.close()
    report(run, record)


def main(argv=None):
    """Parse the flags, train, and close the process group; an error ends every rank with one line."""
    args = parse_args(argv)
    with one_line_errors(args.timeout):
        train(args)
    shutdown()


if __name__ == "__main__":
    main()

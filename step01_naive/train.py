"""Step 01 - naive model parallelism.

    torchrun --nproc_per_node 4 step01_naive/train.py

Every rank holds a contiguous slice of the layers (one pipeline stage). Each optimizer step sends the whole batch
forward through the stages and the gradients back, then every rank updates its own parameters.

Read in this order (support/ holds what keeps a run measured and safe: a first reading can skip it):
  model.py              split_layers and Transformer(first, last): the layers one stage holds
  pipeline.py           the idea: a stage, the four verbs, forward and backward steps, the schedule
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

from config import parse_flags
from data import check_same_corpus, get_batch, load_tokens
from support.distributed import (init_distributed, one_line_errors, reset_peak_memory, shutdown, stop_if_diverged,
                                 wait_for_device)
from model import ModelConfig, Transformer, split_layers
from pipeline import Stage, naive_forward_backward
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
    model: torch.nn.Module  # this rank's stage, parameters named as in the whole model
    optimizer: torch.optim.Optimizer
    stage: Stage
    tokens: torch.Tensor
    timeline: Timeline


def build(args, device) -> Run:
    """This rank's stage of the model, its optimizer, the data and a timeline."""
    index = dist.get_rank()
    layer_ids = split_layers(args.layers, args.pp)[index]
    model = Transformer(model_config(args), layer_ids, first=index == 0, last=index == args.pp - 1,
                        seed=args.seed).to(device)
    # Plain AdamW, defaults but the learning rate: the tests' single-device reference uses the same.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    timeline = Timeline(index, device)
    install(timeline)  # the engine records into this process's timeline
    stage = Stage(model, index, args.pp, (args.batch_size, args.seq_len, args.hidden), device)
    return Run(args, device, model, optimizer, stage, load_tokens(args.data), timeline)


def share_loss(run, loss):
    """The loss lives on the last stage; broadcast it so every rank can log it."""
    value = torch.zeros((), device=run.device) if loss is None else loss.float()
    dist.broadcast(value, src=run.args.pp - 1)
    return value.item()


def compute_gradients(run, step: int) -> float:
    """Forward and backward of one global batch; leaves the gradients in run.model."""
    inputs, targets = (t.to(run.device) for t in get_batch(
        run.tokens, step, run.args.batch_size, run.args.seq_len, run.args.seed))
    run.optimizer.zero_grad(set_to_none=True)
    loss = naive_forward_backward(run.stage, inputs, targets)
    return share_loss(run, loss)


def instrument(run, step: int):
    """Measure only what the report shows: the timeline on every step but the first, which pays one-off
    start-up costs. Switched off, they cost nothing."""
    run.timeline.enabled = step > 0 or run.args.steps == 1


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


def flushed_steps(run):
    """One step per batch: the batch through the pipeline, drained, then the optimizer."""
    for step in range(run.args.steps):
        instrument(run, step)
        yield train_step(run, step)


def train(args):
    """The training loop on this rank: build the run, then each optimizer step (rank 0 prints it and logs it to
    --log-json; a diverged loss stops every rank), then the report."""
    device = init_distributed(args.device, args.timeout)
    run = build(args, device)
    check_same_corpus(run.tokens, args.data)  # before any step: one corpus on every node
    log = open_log(args)
    for step, record in enumerate(flushed_steps(run)):
        if step == args.steps - 1:
            record.update(gather_peaks(run))
        log_step(record, log)
        stop_if_diverged(record)
    if log:
        log.close()
    report(run)


def main(argv=None):
    """Parse the flags, train, and close the process group; an error ends every rank with one line."""
    args = parse_args(argv)
    with one_line_errors(args.timeout):
        train(args)
    shutdown()


if __name__ == "__main__":
    main()

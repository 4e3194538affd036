"""Step 01 - naive model parallelism.

    torchrun --nproc_per_node 4 step01_naive/train.py

Every rank holds a contiguous slice of the layers (one pipeline stage). Each
optimizer step sends the whole batch forward through the stages and the
gradients back, then every rank updates its own parameters.
"""
import json
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from config import ConfigError, build_parser, check_config
from data import get_batch, load_tokens
from distributed import init_distributed, peak_memory_bytes, reset_peak_memory, shutdown, world_from_env
from model import ModelConfig, Transformer, split_layers
from pipeline import bubble_formula, forward_backward
from timeline import Timeline, bubble_report, gather_events, write_chrome_trace


def parse_args(argv=None):
    """Parse and check the flags; a broken rule ends every rank with one line from rank 0."""
    args = build_parser().parse_args(argv)
    rank, world, _ = world_from_env()
    try:
        return check_config(args, world, torch.cuda.is_available())
    except ConfigError as err:
        if rank == 0:
            print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def model_config(args) -> ModelConfig:
    return ModelConfig(n_layers=args.layers, hidden=args.hidden, n_heads=args.heads, seq_len=args.seq_len)


def describe_rank(rank: int) -> str:
    return f"stage {rank}"


def build(args, device):
    """This rank's stage of the model, its optimizer, the data and a timeline."""
    stage = dist.get_rank()
    layer_ids = split_layers(args.layers, args.pp)[stage]
    model = Transformer(model_config(args), layer_ids, first=stage == 0, last=stage == args.pp - 1,
                        seed=args.seed).to(device)
    # Plain AdamW, defaults but the learning rate: the tests' single-device reference uses the same.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    return SimpleNamespace(args=args, device=device, stage=stage, model=model, optimizer=optimizer,
                           tokens=load_tokens(args.data), timeline=Timeline(stage, device))


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
    loss = forward_backward(run.model, run.stage, run.args.pp, inputs, targets, run.args,
                            run.device, run.timeline)
    return share_loss(run, loss)


def train_step(run, step: int) -> dict:
    """One optimizer step, timed from a barrier that all ranks leave together."""
    reset_peak_memory(run.device)
    dist.barrier()
    run.timeline.start_step(step)
    start = time.perf_counter()
    loss = compute_gradients(run, step)
    run.optimizer.step()
    dist.barrier()  # the step is over when the slowest rank is done
    elapsed = time.perf_counter() - start
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak_memory_bytes(run.device))
    tokens = run.args.batch_size * run.args.seq_len
    return dict(step=step, loss=loss, step_time_s=elapsed, tokens_per_s=tokens / elapsed,
                peak_mem_bytes=peaks)


def report(run):
    """After training: the bubble per rank beside the formula, and the trace file."""
    events = gather_events(run.timeline)
    if dist.get_rank() != 0:
        return
    text, value = bubble_formula(run.args.pp)
    print("\n".join(bubble_report(events, dist.get_world_size(), text, value, describe_rank)))
    if run.args.trace:
        write_chrome_trace(events, run.args.trace, describe_rank)
        print(f"trace written to {run.args.trace} (open it in https://ui.perfetto.dev)")


def main(argv=None):
    args = parse_args(argv)
    device = init_distributed(args.device, args.timeout)
    run = build(args, device)
    log = open(args.log_json, "w") if args.log_json and dist.get_rank() == 0 else None
    for step in range(args.steps):
        record = train_step(run, step)
        if dist.get_rank() == 0:
            print(f"step {step:3d}  loss {record['loss']:.4f}  {record['step_time_s'] * 1e3:7.1f} ms  "
                  f"{record['tokens_per_s']:9.0f} tokens/s", flush=True)
            if log:
                log.write(json.dumps(record) + "\n")
    if log:
        log.close()
    report(run)
    shutdown()


if __name__ == "__main__":
    main()

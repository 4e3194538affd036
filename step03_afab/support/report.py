"""What rank 0 prints: one line per step (its record also goes to --log-json), and after training each rank's
measured memory and bubble beside the schedule's formulas.

    open_log(args)                  rank 0's --log-json file
    log_step(record, log)           the step's line and its record (train.py calls it after every step)
    gather_peaks(run)               every rank's memory peaks of the last step (all ranks call it, once)
    report(run, last_record)        the memory report, the bubble report and the trace file

train.py calls the last two after its last step. tests/check_formulas.py, tests/test_schedules.py and
tests/harness.py read the printed lines.
"""
import json
from functools import partial

import torch.distributed as dist

from support.distributed import peak_memory_bytes
from process_groups import describe_rank
from schedule import bubble_formula, peak_stored_microbatches
from support.timeline import bubble_report, gather_events, write_chrome_trace


def rank_name(args):
    """rank -> the report's name for it: its stage and replica."""
    return partial(describe_rank, dp=args.dp)


def stage_of(args, rank: int) -> int:
    """The pipeline stage `rank` holds (rank = stage x dp + replica)."""
    return rank // args.dp


def open_log(args):
    """Rank 0's --log-json file (None on the other ranks, or without the flag); a resumed run appends to it.
    Line-buffered: each step's record is on disk when the step ends, also when a stalled peer later ends this rank
    through os._exit, which writes out no buffers."""
    mode = "a" if args.resume else "w"
    return open(args.log_json, mode, buffering=1) if args.log_json and dist.get_rank() == 0 else None


def log_step(record, log):
    """Rank 0 prints the step's line and writes its record to the --log-json file."""
    if dist.get_rank() != 0:
        return
    print(f"step {record['step']:3d}  loss {record['loss']:.4f}  {record['step_time_s'] * 1e3:7.1f} ms  "
          f"{record['tokens_per_s']:9.0f} tokens/s", flush=True)
    if log:
        log.write(json.dumps(record) + "\n")


def gather_peaks(run) -> dict:
    """Every rank's memory peaks of the last step, gathered once after training (all ranks call it)."""
    mine = dict(peak_mem_bytes=peak_memory_bytes(run.device), peak_activation_bytes=run.meter.peak_bytes,
                peak_stored_microbatches=run.meter.peak_stored_microbatches)
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, mine)
    return {key: [p[key] for p in peaks] for key in mine}


def memory_report(args, record):
    """Each rank's peak of stored microbatch activations, measured beside the schedule's formula."""
    text, _ = peak_stored_microbatches(args, 0)
    lines = [f"activation memory: peak stored microbatches, measured vs formula {text}"]
    for rank, (count, size) in enumerate(zip(record["peak_stored_microbatches"], record["peak_activation_bytes"])):
        _, expected = peak_stored_microbatches(args, stage_of(args, rank))
        lines.append(f"  rank {rank} ({rank_name(args)(rank)}): {count} (formula {expected}), "
                     f"{size / 2**20:.2f} MiB")
    return lines


def report(run, last_record):
    """After training: memory and bubble per rank beside their formulas, and the trace file."""
    events = gather_events(run.timeline)
    if dist.get_rank() != 0:
        return
    print("\n".join(memory_report(run.args, last_record)))
    text, value = bubble_formula(run.args)
    print("\n".join(bubble_report(events, dist.get_world_size(), text, value, rank_name(run.args))))
    if run.args.trace:
        write_chrome_trace(events, run.args.trace, rank_name(run.args))
        print(f"trace written to {run.args.trace} (open it in https://ui.perfetto.dev)")

"""What rank 0 prints: one line per step (its record also goes to --log-json), and after training each rank's
measured memory and bubble beside the schedule's formulas.

    open_log(args, start)           rank 0's --log-json file (resumed after `start` steps: keeps their records)
    log_step(record, log, scaler)   the step's line and its record (train.py calls it after every step)
    gather_peaks(run)               every rank's memory peaks of the last step (all ranks call it, once)
    report(run, last_record)        the memory report, the bubble report and the trace file

train.py calls the last two after its last step. tests/check_formulas.py, tests/test_schedules.py and
tests/harness.py read the printed lines.
"""
import json
import os
import threading
import time
import math
from functools import partial

import torch
import torch.distributed as dist

from support import outputs
from support.budget import probe_rates, step_flops
from config import family
from support.distributed import peak_memory_bytes, progress
from dualpipe import twin_copies
from experts import report_lines as expert_lines
from overlap import report_lines as overlap_lines
from process_groups import describe_rank
from support.timeline import bubble_report, gather_events, mean_durations, write_chrome_trace

TICK_S = 10.0  # a step running this long says so, again every TICK_S (watch)


def rank_name(args):
    """rank -> the report's name for it: its stage, replica and TP rank."""
    return partial(describe_rank, dp=args.dp, tp=args.tp)


def stage_of(args, rank: int) -> int:
    """The pipeline stage `rank` holds (rank = (stage x dp + replica) x tp + TP rank)."""
    return rank // (args.dp * args.tp)


def open_log(args, start: int):
    """Rank 0's --log-json file (None on the other ranks, or without the flag). A run resumed after `start` steps
    keeps the earlier log's records of those steps and appends its own (earlier_records).
    Before the first step, rank 0 also says how long that step will take when it is long (announce), and a step
    still running after TICK_S says so every TICK_S (watch).

    The log is written under a temporary name beside the path, renamed over the path once it holds its first
    record (log_step): the path always holds whole records, an earlier run's until then. Line-buffered: each
    step's record is on disk when the step ends, also when a stalled peer later ends this rank through os._exit,
    which writes out no buffers."""
    progress.update(since=time.monotonic())
    if dist.get_rank() != 0:
        return None
    announce(args)
    watch(args.steps)
    if not args.log_json:
        return None
    log = outputs.open_temporary(args.log_json, buffering=1)  # support/outputs.py: the rule of every output
    log.final = args.log_json  # where log_step renames it to
    if args.resume and os.path.isfile(args.log_json):
        kept, redone = earlier_records(args.log_json, start)
        log.write("".join(kept))
        print(f"--log-json {args.log_json}: an earlier run's log; this resumed run keeps its records of steps "
              f"0-{start - 1} and appends to them" + (f", leaving out {redone} later records, of steps it trains "
                                                       "again" if redone else ""), flush=True)
    elif os.path.isfile(args.log_json):
        print(f"--log-json {args.log_json}: an earlier run's log, which this run replaces", flush=True)
    return log


def earlier_records(path: str, start: int):
    """The lines of an earlier run's log that a run resumed after `start` steps keeps, and how many it leaves out.
    It keeps the records of steps before `start`. The earlier run may have gone on past its last checkpoint: the
    resumed run trains those steps again and logs them anew, so that each step has one record. A last line
    without its newline is a record cut short (a full disk): its step is one the resumed run trains again."""
    with open(path) as f:  # config refused a file this course did not write: one JSON record per line
        lines = f.readlines()
    kept = [line for line in lines if line.endswith("\n") and json.loads(line)["step"] < start]
    return kept, len(lines) - len(kept)


def announce(args, long_s: float = 10.0, probe_above: float = 1e10):
    """Rank 0, before the first step: the step's FLOPs (budget.step_flops) at the rates a short probe measures, and
    one line if that is over long_s. A step of under probe_above FLOPs is not probed: it cannot take long_s at
    the 1 GFLOP/s that even a slow CPU kernel reaches."""
    products, attention = step_flops(args)
    if products + attention < probe_above:
        return
    dtype = dict(bf16=torch.bfloat16, fp16=torch.float16).get(getattr(args, "precision", "fp32"), torch.float32)
    device = "cuda" if args.device == "cuda" or args.device == "auto" and torch.cuda.is_available() else "cpu"
    product_rate, attention_rate = probe_rates(args, device, dtype)
    seconds = products / product_rate + attention / attention_rate
    if seconds > long_s:
        print(f"the first step will take about {seconds:.0f} s on the busiest rank: {products:.1e} FLOPs of matrix "
              f"products at {product_rate / 1e9:.1f} GFLOP/s and {attention:.1e} of attention at "
              f"{attention_rate / 1e9:.1f} GFLOP/s, as a short probe measured; a step says every {TICK_S:g} s "
              "that it still runs", flush=True)


def watch(steps: int):
    """Rank 0: a daemon thread that, while a step has run for TICK_S or more, says so every TICK_S, so that a long
    step is never silent (progress, which log_step moves on, says which step runs and since when)."""
    def tick():
        while True:
            time.sleep(TICK_S)
            running = time.monotonic() - progress["since"]
            if progress["step"] < steps and running >= TICK_S:
                print(f"(step {progress['step']} still running after {running:.0f} s)", flush=True)

    threading.Thread(target=tick, name="watch", daemon=True).start()


def log_step(record, log, scaler=None):
    """Rank 0 prints the step's line (with the loss scale, given a scaler) and writes its record to --log-json."""
    progress.update(step=record["step"] + 1, since=time.monotonic())  # for the ticker and an early end
    if dist.get_rank() != 0:
        return
    scaling = f"  scale 2^{math.log2(record['loss_scale']):g}" if scaler else ""
    moe = (f"  aux {record['aux_loss']:.4f}  expert tokens {record['expert_tokens_min']}..{record['expert_tokens_max']}"
           if "aux_loss" in record else "")  # experts.py: the least and the most loaded expert of any layer
    print(f"step {record['step']:3d}  loss {record['loss']:.4f}{moe}  {record['step_time_s'] * 1e3:7.1f} ms  "
          f"{record['tokens_per_s']:9.0f} tokens/s{scaling}{'  skipped' if record.get('skipped') else ''}",
          flush=True)
    if log:
        log.write(json.dumps(record) + "\n")
        if log.final:  # the first record is in: the log replaces the path, whole
            os.replace(log.name, log.final)
            log.final = None


def gather_peaks(run) -> dict:
    """Every rank's memory peaks of the last step, gathered once after training (all ranks call it)."""
    mine = dict(peak_mem_bytes=peak_memory_bytes(run.device), peak_activation_bytes=run.meter.peak_bytes,
                peak_stored_microbatches=run.meter.peak_stored_microbatches,
                param_bytes=sum(p.numel() * p.element_size() for p in run.model.parameters()),  # DualPipe holds 2x
                **family(run.args).peaks(run))
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, mine)
    return {key: [p[key] for p in peaks] for key in mine}


def memory_report(args, record):
    """Each rank's peak of stored microbatch activations, measured beside the schedule's formula."""
    peak_stored_microbatches = family(args).peak_stored_microbatches
    text, _ = peak_stored_microbatches(args, 0)
    lines = [f"activation memory, {args.schedule}: peak stored microbatches, measured vs formula {text}"]
    for rank, (count, size) in enumerate(zip(record["peak_stored_microbatches"], record["peak_activation_bytes"])):
        _, expected = peak_stored_microbatches(args, stage_of(args, rank))
        lines.append(f"  rank {rank} ({rank_name(args)(rank)}): {count} (formula {expected}), "
                     f"{size / 2**20:.2f} MiB")
    twice = " (dualpipe: each pipeline holds every stage twice)" if twin_copies(args) else ""
    lines.append(f"parameters per rank{twice}, MiB: " + " ".join(f"{b / 2**20:.2f}" for b in record["param_bytes"]))
    return lines + family(args).report_lines(args, record, rank_name(args), partial(stage_of, args))


def report(run, last_record):
    """After training: memory and bubble per rank beside their formulas, and the trace file."""
    events = gather_events(run.timeline)
    if dist.get_rank() != 0:
        return
    print("\n".join(memory_report(run.args, last_record)))
    # The split schedules' formulas (zb1p, DualPipe) take the mean F, B and W measured in this run.
    times = mean_durations(events, ("forward", "B", "W")) if any(e["kind"] == "W" for e in events) else None
    text, value = family(run.args).bubble_formula(run.args, times)
    print("\n".join(bubble_report(events, dist.get_world_size(), text, value, rank_name(run.args)) +
                    expert_lines(run.args) + overlap_lines(run.args, events)))
    if run.args.trace:
        replaced = os.path.isfile(run.args.trace)  # config refused a file this course did not write
        write_chrome_trace(events, run.args.trace, rank_name(run.args))
        print(f"trace written to {run.args.trace}" + (", replacing an earlier run's trace" if replaced else "") +
              " (open it in https://ui.perfetto.dev)")

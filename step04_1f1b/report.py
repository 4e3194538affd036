"""What rank 0 prints after training: each rank's measured memory and bubble beside the schedule's formulas.

    gather_peaks(run)          every rank's memory peaks of the last step (all ranks call it, once)
    report(run, last_record)   the memory report, the bubble report and the trace file

train.py calls both after its last step. tests/check_formulas.py, tests/test_schedules.py and
tests/harness.py read the printed lines.
"""
from functools import partial

import torch.distributed as dist

from distributed import peak_memory_bytes
import pipedream
import schedule
from process_groups import describe_rank
from timeline import bubble_report, gather_events, write_chrome_trace


def gather_peaks(run) -> dict:
    """Every rank's memory peaks of the last step, gathered once after training (all ranks call it)."""
    versions = run.stages[0].versions
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, (peak_memory_bytes(run.device), run.meter.peak_bytes,
                                   run.meter.peak_stored_microbatches,
                                   (versions.peak_versions, versions.version_bytes) if versions else None))
    record = dict(peak_mem_bytes=[p[0] for p in peaks], peak_activation_bytes=[p[1] for p in peaks],
                  peak_stored_microbatches=[p[2] for p in peaks])
    if versions:  # PipeDream: weight versions held at once (the live one included), and the bytes of one
        record.update(peak_weight_versions=[p[3][0] for p in peaks], version_bytes=[p[3][1] for p in peaks])
    return record


def formulas(args):
    """The module whose formulas describe this run: pipedream's for a run with no flush, else schedule's."""
    return pipedream if args.schedule in pipedream.SCHEDULES else schedule


def memory_report(args, record):
    """Each rank's peak of stored microbatch activations, measured beside the schedule's formula."""
    peak_stored_microbatches = formulas(args).peak_stored_microbatches
    text, _ = peak_stored_microbatches(args, 0)
    lines = [f"activation memory, {args.schedule}: peak stored microbatches, measured vs formula {text}"]
    for rank, (count, size) in enumerate(zip(record["peak_stored_microbatches"], record["peak_activation_bytes"])):
        _, expected = peak_stored_microbatches(args, rank // args.dp)
        lines.append(f"  rank {rank} ({describe_rank(rank, args.dp)}): {count} (formula {expected}), "
                     f"{size / 2**20:.2f} MiB")
    return lines + (versions_report(args, record) if "peak_weight_versions" in record else [])


def versions_report(args, record):
    """PipeDream: each rank's peak of weight versions held, beside its formula, and what the extra ones cost."""
    text, _ = pipedream.peak_versions(args, 0)
    lines = [f"weight versions, {args.schedule}: peak held (the live one included), measured vs formula {text}"]
    for rank, (count, size) in enumerate(zip(record["peak_weight_versions"], record["version_bytes"])):
        _, expected = pipedream.peak_versions(args, rank // args.dp)
        lines.append(f"  rank {rank} ({describe_rank(rank, args.dp)}): {count} (formula {expected}), "
                     f"{count - 1} stashed x {size / 2**20:.2f} MiB = {(count - 1) * size / 2**20:.2f} MiB")
    return lines


def report(run, last_record):
    """After training: memory and bubble per rank beside their formulas, and the trace file."""
    events = gather_events(run.timeline)
    if dist.get_rank() != 0:
        return
    print("\n".join(memory_report(run.args, last_record)))
    text, value = formulas(run.args).bubble_formula(run.args)
    label = partial(describe_rank, dp=run.args.dp)
    print("\n".join(bubble_report(events, dist.get_world_size(), text, value, label)))
    if run.args.trace:
        write_chrome_trace(events, run.args.trace, label)
        print(f"trace written to {run.args.trace} (open it in https://ui.perfetto.dev)")

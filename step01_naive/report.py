"""What rank 0 prints after training: each rank's measured bubble beside the schedule's formula.

    gather_peaks(run)   every rank's memory peaks of the last step (all ranks call it, once)
    report(run)         the bubble report and the trace file

train.py calls both after its last step. tests/check_formulas.py, tests/test_schedules.py and
tests/harness.py read the printed lines.
"""
import torch.distributed as dist

from distributed import peak_memory_bytes
from pipeline import bubble_formula
from timeline import bubble_report, gather_events, write_chrome_trace


def rank_name(args):
    """rank -> the report's name for it: the stage it holds."""
    return lambda rank: f"stage {rank}"


def gather_peaks(run) -> dict:
    """Every rank's memory peaks of the last step, gathered once after training (all ranks call it)."""
    mine = dict(peak_mem_bytes=peak_memory_bytes(run.device))
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, mine)
    return {key: [p[key] for p in peaks] for key in mine}


def report(run):
    """After training: the bubble per rank beside its formula, and the trace file."""
    events = gather_events(run.timeline)
    if dist.get_rank() != 0:
        return
    text, value = bubble_formula(run.args)
    print("\n".join(bubble_report(events, dist.get_world_size(), text, value, rank_name(run.args))))
    if run.args.trace:
        write_chrome_trace(events, run.args.trace, rank_name(run.args))
        print(f"trace written to {run.args.trace} (open it in https://ui.perfetto.dev)")

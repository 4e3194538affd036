"""Notebook helpers: run this folder's train.py, read back what it recorded, draw it.

train.py writes two files we use here: a JSON log (one object per optimizer
step) and a Chrome trace (one box per forward, backward, recompute, send and
receive of every rank). Reading the trace back gives the same event records
that timeline.py keeps in memory, so the bubble is measured by timeline.py's
own functions rather than by a second implementation that could disagree.
"""
import json
import os
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from timeline import busy_fractions, measured_steps

COLORS = {"forward": "tab:blue", "backward": "tab:orange", "recompute": "tab:green",
          "send": "0.55", "recv": "0.82", "sendrecv": "0.7", "allreduce": "tab:red"}
COMPUTE_HEIGHT, COMM_HEIGHT = 0.7, 0.25  # communication boxes are drawn thin: mostly waiting


def run_train(nproc: int, *flags, workdir: str):
    """Run `train.py` of the current folder on `nproc` ranks under torchrun.

    Each run gets its own subfolder of `workdir` for its trace and log. One
    OpenMP thread per rank, so ranks compete for cores rather than threads.
    Returns stdout (with the bubble report), the log records and the trace events.
    """
    folder = tempfile.mkdtemp(dir=workdir)
    trace, log = os.path.join(folder, "trace.json"), os.path.join(folder, "log.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "train.py", *map(str, flags), "--trace", trace, "--log-json", log]
    try:
        done = subprocess.run(cmd, check=True, capture_output=True, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
    except subprocess.CalledProcessError as err:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err.stderr[-3000:]}") from err
    with open(log) as f:
        records = [json.loads(line) for line in f]
    return SimpleNamespace(stdout=done.stdout, records=records, events=load_trace(trace))


def load_trace(path: str):
    """The trace's boxes as timeline.py's event dicts: times in seconds from their step's start.

    write_chrome_trace lays steps end to end, each shifted by the end of the
    step before, so a step's origin is the latest end of any box of the step before.
    """
    with open(path) as f:
        boxes = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
    events, origin = [], 0.0
    for step in sorted({b["args"]["step"] for b in boxes}):
        step_boxes = [b for b in boxes if b["args"]["step"] == step]
        for b in step_boxes:
            start = (b["ts"] - origin) / 1e6
            events.append(dict(kind=b["cat"], microbatch=b["args"]["microbatch"], step=step,
                               rank=b["tid"], start=start, end=start + b["dur"] / 1e6))
        origin = max(b["ts"] + b["dur"] for b in step_boxes)
    return events


def measured_bubble(events, world_size: int):
    """Idle fraction of each rank, averaged over all steps but the first (see timeline.py)."""
    return [1 - busy for busy in busy_fractions(events, world_size, measured_steps(events))]


def draw_timeline(events, step: int, ax=None, title=None):
    """One row per rank (rank 0 on top) of one step: a coloured box per event.

    Forward, backward and recompute boxes carry their microbatch number.
    """
    ax = ax or plt.subplots(figsize=(11, 0.45 * (1 + max(e["rank"] for e in events)) + 1))[1]
    step_events = [e for e in events if e["step"] == step]
    for e in step_events:
        start_ms, width_ms = e["start"] * 1e3, (e["end"] - e["start"]) * 1e3
        height = COMM_HEIGHT if e["kind"] in ("send", "recv", "sendrecv") else COMPUTE_HEIGHT
        ax.broken_barh([(start_ms, width_ms)], (e["rank"] - height / 2, height),
                       facecolors=COLORS[e["kind"]], edgecolor="white", linewidth=0.5)
        if height == COMPUTE_HEIGHT and e["microbatch"] is not None:
            ax.text(start_ms + width_ms / 2, e["rank"], str(e["microbatch"]), ha="center", va="center",
                    fontsize=7, color="white", clip_on=True)
    ranks = sorted({e["rank"] for e in step_events})
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_ylim(max(ranks) + 0.6, -0.6)
    ax.set_xlabel(f"time since the start of step {step} (ms)")
    kinds = [k for k in COLORS if any(e["kind"] == k for e in step_events)]
    ax.legend(handles=[Patch(color=COLORS[k], label=k) for k in kinds], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.set_title(title or f"step {step}")
    return ax

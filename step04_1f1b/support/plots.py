"""Notebook helpers: run this folder's train.py on several ranks, read back what it recorded, draw it.

train.py writes two files we use here: a JSON log (one object per optimizer
step) and a Chrome trace (one box per forward, backward, recompute, send and
receive of every rank). Reading the trace back gives timeline.py's event
records, each step shifted to start at zero, so the bubble is measured by
timeline.py's own functions rather than by a second implementation that could
disagree.
"""
import importlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import matplotlib.pyplot as plt
from matplotlib.colors import to_rgb
from matplotlib.patches import Patch

from support.timeline import busy_fractions, measured_steps

COLORS = {"forward": "tab:blue", "backward": "tab:orange", "recompute": "tab:green",
          "send": "tab:purple", "recv": "tab:cyan", "sendrecv": "tab:brown", "allreduce": "tab:red"}
COMMUNICATION = ("send", "recv", "sendrecv", "allreduce")
COMPUTE_HEIGHT, COMM_HEIGHT = 0.7, 0.25  # communication boxes are drawn thin: mostly waiting
CHUNK_SHADE = 0.6  # how much lighter the last model chunk of a rank is drawn than the first


def free_port() -> int:
    """A TCP port that is free on this machine now, for the ranks' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc: int, argv, folder: str) -> str:
    """Run `python *argv` as ranks 0..nproc-1 of one job, as `torchrun --standalone --nproc_per_node nproc`
    would: every process gets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, and one
    OpenMP thread, so ranks compete for cores rather than threads. torchrun's own launcher process
    would add about 3 s to every run on a 2-core laptop, longer than many of the runs here.

    Returns what the ranks printed to stdout, in rank order (the course's ranks other than 0 print
    nothing). As under torchrun, the first rank to fail stops the others, which would wait for it
    until --timeout, and the error shows what it printed to stderr.
    """
    port, procs = free_port(), []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        with open(os.path.join(folder, f"rank{rank}.out"), "w") as out, \
                open(os.path.join(folder, f"rank{rank}.err"), "w") as err:
            procs.append(subprocess.Popen([sys.executable, *map(str, argv)], stdout=out, stderr=err, env=env))
    codes = [p.poll() for p in procs]
    while None in codes and not any(codes):  # running, and no rank has failed
        time.sleep(0.02)
        codes = [p.poll() for p in procs]
    for p in procs:
        p.kill()  # a no-op for a rank that has exited
        p.wait()
    failed = next((rank for rank, code in enumerate(codes) if code), None)
    if failed is not None:
        raise RuntimeError(f"{' '.join(map(str, argv))}: rank {failed} failed:\n"
                           f"{Path(folder, f'rank{failed}.err').read_text()[-3000:]}")
    return "".join(Path(folder, f"rank{rank}.out").read_text() for rank in range(nproc))


def run_train(nproc: int, *flags, workdir: str):
    """Run `train.py --device cpu` of the current folder on `nproc` ranks (see launch): the notebooks run on the
    CPU, also where there are GPUs (a --device in flags comes later and wins).

    Each run gets its own subfolder of `workdir` for its trace and log.
    Returns stdout (with the reports; file names relative to the run's folder),
    the log records and the trace events.
    """
    folder = tempfile.mkdtemp(dir=workdir)
    trace, log = os.path.join(folder, "trace.json"), os.path.join(folder, "log.jsonl")
    stdout = launch(nproc, ["train.py", "--device", "cpu", *flags, "--trace", trace, "--log-json", log], folder)
    with open(log) as f:
        records = [json.loads(line) for line in f]
    return SimpleNamespace(stdout=stdout.replace(folder + os.sep, ""), records=records, events=load_trace(trace))


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
            events.append(dict(kind=b["cat"], microbatch=b["args"]["microbatch"], step=step, rank=b["args"]["rank"],
                               start=start, end=start + b["dur"] / 1e6, chunk=b["args"].get("chunk"),
                               what=b["args"].get("what")))
        origin = max(b["ts"] + b["dur"] for b in step_boxes)
    return events


def measured_bubble(events, world_size: int):
    """Idle fraction of each rank, averaged over the recorded steps (see timeline.py)."""
    return [1 - busy for busy in busy_fractions(events, world_size, measured_steps(events))]


def ideal_events(boxes):
    """An ideal timeline's passes as draw_timeline's events, to draw with unit="units of one forward".

    boxes: dicts of rank, kind ("F", "B" or "W"), mb, start and end (in units of one forward), and
    optionally chunk and split, as tests/ideal.py's ideal_passes returns them. A split B is the
    input-gradient half of a backward (step 08); a B that is not split is the whole backward.
    """
    kinds = {"F": "forward", "B": "backward", "W": "W"}
    return [dict(kind="B" if b.get("split") else kinds[b["kind"]], microbatch=b["mb"], step=0, rank=b["rank"],
                 start=float(b["start"]), end=float(b["end"]), chunk=b.get("chunk"), what=None) for b in boxes]


def chunk_color(kind: str, chunk, chunks: int):
    """Later model chunks of a rank are drawn lighter."""
    shade = CHUNK_SHADE * (chunk or 0) / max(chunks - 1, 1)
    return [c + (1 - c) * shade for c in to_rgb(COLORS[kind])], shade


def draw_timeline(events, step: int, ax=None, title=None, unit="ms"):
    """One row per rank (rank 0 on top) of one step: a coloured box per event.

    Forward, backward and recompute boxes carry their microbatch number where it fits; when a
    rank holds several model chunks (virtual stages), they read chunk:microbatch and later chunks
    are drawn lighter. Times are seconds, drawn in ms; with any other unit (ideal_events'), they
    are drawn as they are.
    """
    ax = ax or plt.subplots(figsize=(11, 0.45 * (1 + max(e["rank"] for e in events)) + 1))[1]
    step_events = [e for e in events if e["step"] == step]
    chunks = 1 + max((e["chunk"] or 0 for e in step_events), default=0)  # virtual stages per rank
    scale = 1e3 if unit == "ms" else 1  # "ms" below means the drawn unit
    span_ms = scale * max(e["end"] for e in step_events)
    char_ms = span_ms / 130  # about one character of a 7-point label on an 11-inch-wide figure
    for e in step_events:
        start_ms, width_ms = e["start"] * scale, (e["end"] - e["start"]) * scale
        height = COMM_HEIGHT if e["kind"] in COMMUNICATION else COMPUTE_HEIGHT
        color, shade = chunk_color(e["kind"], e["chunk"], chunks)
        ax.broken_barh([(start_ms, width_ms)], (e["rank"] - height / 2, height),
                       facecolors=[color], edgecolor="white", linewidth=0.5)
        label = f"{e['chunk']}:{e['microbatch']}" if chunks > 1 else str(e["microbatch"])
        if height == COMPUTE_HEIGHT and e["microbatch"] is not None and width_ms > char_ms * (len(label) + 1):
            ax.text(start_ms + width_ms / 2, e["rank"], label, ha="center", va="center",
                    fontsize=7, color="white" if shade < 0.3 else "black", clip_on=True)
    ranks = sorted({e["rank"] for e in step_events})
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_ylim(max(ranks) + 0.6, -0.6)
    ax.set_xlabel(f"time since the start of step {step} (ms)" if unit == "ms" else f"time ({unit})")
    # a kind is named only if one of its boxes is wide enough to see (a quarter of a character)
    kinds = [k for k in COLORS if any(e["kind"] == k and scale * (e["end"] - e["start"]) >= char_ms / 4
                                      for e in step_events)]
    handles = [Patch(color=COLORS[k], label=k) for k in kinds]
    if chunks > 1:
        handles += [Patch(color=chunk_color("forward", c, chunks)[0], label=f"chunk {c} (label {c}:mb)")
                    for c in range(chunks)]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.set_title(title or f"step {step}")
    return ax


def draw_rank_grid(ranks, pp: int, dp: int, ax):
    """The pp x dp grid of ranks: a row per stage, a column per replica, an arrow from each rank to the next
    stage's, and each data-parallel group (red) and pipeline (blue) named by its ranks. `ranks` holds what each
    rank reported: rank, stage, dp_rank, next, dp_group, pp_group."""
    from process_groups import describe_rank  # this step's names: the notebooks run in the step's folder

    for g in ranks:
        x, y = g["dp_rank"], g["stage"]
        ax.add_patch(plt.Rectangle((x - 0.4, y - 0.27), 0.8, 0.54, facecolor="tab:blue", alpha=0.15))
        ax.text(x, y, f"rank {g['rank']}\n{describe_rank(g['rank'], dp)}", ha="center", va="center", fontsize=9)
        if g["stage"] < pp - 1:  # the ring's wrap-around is not used by AFAB
            nxt = ranks[g["next"]]
            ax.annotate("", xy=(nxt["dp_rank"], nxt["stage"] - 0.27), xytext=(x, y + 0.27),
                        arrowprops=dict(arrowstyle="->", color="tab:blue"))
    for s in range(pp):
        ax.add_patch(plt.Rectangle((-0.47, s - 0.35), dp - 0.06, 0.7, fill=False, linestyle="--", edgecolor="tab:red"))
        ax.text(dp - 0.45, s, f"dp group\n{ranks[s * dp]['dp_group']}", color="tab:red", va="center", fontsize=8)
    for r in range(dp):
        ax.text(r, pp - 0.45, f"pipeline\n{ranks[r]['pp_group']}", color="tab:blue", ha="center", va="top", fontsize=8)
    ax.set_xlim(-0.55, dp + 0.25)
    ax.set_ylim(pp + 0.15, -0.5)
    ax.set_axis_off()
    ax.set_title(f"pp = {pp}, dp = {dp}")


def import_replay():
    """tests/replay.py of the course this folder sits in (the notebooks replay schedules with it)."""
    for folder in [Path.cwd(), *Path.cwd().parents]:
        if (folder / "tests" / "replay.py").is_file():
            sys.path.insert(0, str(folder / "tests"))
            return importlib.import_module("replay")
    raise FileNotFoundError("no tests/replay.py above this folder: keep your copy of the step inside the course")

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
from matplotlib.patches import FancyBboxPatch, Patch, Rectangle

from support.timeline import busy_fractions, measured_steps

COLORS = {"forward": "tab:blue", "backward": "tab:orange", "recompute": "tab:green",
          "B": "tab:pink", "W": "tab:olive",  # step 08: a backward split into input and weight gradients
          "send": "tab:purple", "recv": "tab:cyan", "sendrecv": "tab:brown", "allreduce": "tab:red",
          "tp allreduce": "black", "tp allgather": "tab:gray",  # TP boxes sit inside forwards and backwards
          "all-to-all": "gold",  # step 08's experts: dispatch, combine and their counts, inside F, B and W
          # step 08's overlapped pair (overlap.py): an all-to-all posted, and the wait of the node that reads it
          "all-to-all post": "darkgoldenrod", "all-to-all wait": "crimson"}
COMMUNICATION = ("send", "recv", "sendrecv", "allreduce", "tp allreduce", "tp allgather", "all-to-all",
                 "all-to-all post", "all-to-all wait")
COMPUTE_HEIGHT, COMM_HEIGHT = 0.7, 0.25  # communication boxes are drawn thin: mostly waiting
PAIR = "F&B"  # step 08: DualPipe's forward-and-backward pair, drawn as a bracket around its two boxes
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
                               what=b["args"].get("what"), bytes=b["args"].get("bytes")))
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
        if e["kind"] == PAIR:
            ax.add_patch(Rectangle((start_ms, e["rank"] - 0.45), width_ms, 0.9, fill=False, edgecolor="black",
                                   linewidth=1.0, zorder=5))
            continue
        height = COMM_HEIGHT if e["kind"] in COMMUNICATION else COMPUTE_HEIGHT
        color, shade = chunk_color(e["kind"], e["chunk"], chunks)
        ax.broken_barh([(start_ms, width_ms)], (e["rank"] - height / 2, height),
                       facecolors=[color], edgecolor="white", linewidth=0.5,
                       zorder=3 if height == COMM_HEIGHT else 2)  # TP collectives lie inside compute boxes
        label = f"{e['chunk']}:{e['microbatch']}" if chunks > 1 else str(e["microbatch"])
        if height == COMPUTE_HEIGHT and e["microbatch"] is not None and width_ms > char_ms * (len(label) + 1):
            ax.text(start_ms + width_ms / 2, e["rank"], label, ha="center", va="center",
                    fontsize=7, color="white" if shade < 0.3 else "black", clip_on=True, zorder=4)
    ranks = sorted({e["rank"] for e in step_events})
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_ylim(max(ranks) + 0.6, -0.6)
    ax.set_xlabel(f"time since the start of step {step} (ms)" if unit == "ms" else f"time ({unit})")
    # a kind is named only if one of its boxes is wide enough to see (a quarter of a character)
    kinds = [k for k in COLORS if any(e["kind"] == k and scale * (e["end"] - e["start"]) >= char_ms / 4
                                      for e in step_events)]
    handles = [Patch(color=COLORS[k], label=k) for k in kinds]
    if any(e["kind"] == PAIR for e in step_events):
        handles.append(Patch(fill=False, edgecolor="black", label="F&B pair"))
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


def draw_group_grid(ax, tp: int, pp: int, dp: int, kind: str):
    """The tp x pp x dp grid of ranks at (column: replica, tp_rank; row: stage), coloured by their group of
    `kind` (a key of process_groups.grid_groups); dashed: the TP groups."""
    from process_groups import grid_coordinates, grid_groups  # this step's grid: the notebooks run in its folder

    group_of = {r: i for i, members in enumerate(grid_groups(tp, pp, dp)[kind]) for r in members}
    for rank in range(tp * pp * dp):
        stage, dp_rank, tp_rank = grid_coordinates(rank, dp, tp)
        x = dp_rank * (tp + 0.5) + tp_rank
        color = plt.cm.tab10(group_of[rank]) if rank in group_of else "white"
        ax.add_patch(Rectangle((x + 0.08, stage + 0.1), 0.84, 0.8, facecolor=color, alpha=0.6, edgecolor="gray"))
        ax.text(x + 0.5, stage + 0.5, f"rank {rank}\n({stage},{dp_rank},{tp_rank})", ha="center", va="center",
                fontsize=8)
    for stage in range(pp):
        for dp_rank in range(dp):
            ax.add_patch(Rectangle((dp_rank * (tp + 0.5) + 0.02, stage + 0.04), tp - 0.04, 0.92, fill=False,
                                       linestyle="--", edgecolor="black"))
    ax.set_xlim(-0.1, dp * (tp + 0.5) - 0.4)
    ax.set_ylim(pp + 0.05, -0.05)
    ax.set_yticks([s + 0.5 for s in range(pp)], [f"stage {s}" for s in range(pp)])
    ax.set_xticks([d * (tp + 0.5) + tp / 2 for d in range(dp)], [f"replica {d}" for d in range(dp)])
    ax.set_title(f"{kind} groups")


TP_STRIP = (0.18, 0.36)  # below each row's centre, where the microbatch numbers are written


def draw_tp_timeline(events, step: int, ax, title):
    """draw_timeline without the TP collectives, which are then drawn as black strips along the boxes' lower
    edge, inside the compute they belong to."""
    draw_timeline([e for e in events if e["kind"] != "tp allreduce"], step, ax=ax, title=title)
    boxes = [(e["rank"], 1e3 * e["start"], 1e3 * (e["end"] - e["start"]))
             for e in events if e["step"] == step and e["kind"] == "tp allreduce"]
    for rank in {r for r, _, _ in boxes}:
        ax.broken_barh([(s, w) for r, s, w in boxes if r == rank], (rank + TP_STRIP[0], TP_STRIP[1] - TP_STRIP[0]),
                       facecolors="black", zorder=3)
    handles = [*ax.get_legend().legend_handles, Patch(color="black", label="tp allreduce")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)


def import_replay():
    """tests/replay.py of the course this folder sits in (the notebooks replay schedules with it)."""
    for folder in [Path.cwd(), *Path.cwd().parents]:
        if (folder / "tests" / "replay.py").is_file():
            sys.path.insert(0, str(folder / "tests"))
            return importlib.import_module("replay")
    raise FileNotFoundError("no tests/replay.py above this folder: keep your copy of the step inside the course")


# ------------------------------------------------------------------------------------- step 06's picture

TP_COLORS = (plt.cm.tab10(0), plt.cm.tab10(1))  # rank 0, rank 1
TP_WHOLE = "0.85"  # the same on both ranks


def _box(ax, x, y, w, h, label="", color=TP_WHOLE, name=""):
    """A box with its top-left corner at (x, y), a label inside and a name under it."""
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="black", alpha=0.75))
    ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=10)
    ax.text(x + w / 2, y + h + 0.12, name, ha="center", va="top", fontsize=9)


def _matrix(ax, x, y, w, h, name, split=None, labels=("",), colors=(TP_WHOLE,)):
    """A w x h matrix cut into equal parts along its rows or its columns, one part per rank."""
    n = len(colors)
    for i, (color, label) in enumerate(zip(colors, labels)):
        _box(ax, *((x, y + i * h / n, w, h / n) if split == "rows" else
                   (x + i * w / n, y, w / n, h) if split == "cols" else (x, y, w, h)), label, color)
    ax.text(x + w / 2, y + h + 0.15, name, ha="center", va="top", fontsize=9)


def draw_tensor_parallel():
    """Step 06's picture: a column-parallel and a row-parallel layer on 2 ranks, then one block with f and g."""
    fig, axes = plt.subplot_mosaic([["col", "row"], ["block", "block"]], figsize=(12, 6.4),
                                   gridspec_kw=dict(height_ratios=[1, 0.9]))
    IN, OUT, T = 2.4, 3.0, 2.0  # box sizes: input features, output features, tokens
    ax = axes["col"]
    _matrix(ax, 0, 0.5, IN, T, "x [tokens, in]\nwhole, on both ranks", labels=("$x$",))
    _matrix(ax, 3.4, 0, IN, OUT, "W [out, in]\nsplit by rows", "rows", ("$W_0$", "$W_1$"), TP_COLORS)
    _matrix(ax, 6.8, 0.5, OUT, T, "y = x W$^T$ [tokens, out]\nsplit by columns", "cols",
           ("$x W_0^T$", "$x W_1^T$"), TP_COLORS)
    ax.set_title("column-parallel: no communication")
    ax = axes["row"]
    _matrix(ax, 0, 0.5, IN, T, "x [tokens, in]\nsplit by columns", "cols", ("$x_0$", "$x_1$"), TP_COLORS)
    _matrix(ax, 3.4, 0, IN, OUT, "W [out, in]\nsplit by columns", "cols", ("$W_0$", "$W_1$"), TP_COLORS)
    _matrix(ax, 6.8, 0.5, OUT, T, "y = x W$^T$ [tokens, out], on both ranks\n"
           "g: all-reduce of the partial outputs", labels=("$x_0 W_0^T + x_1 W_1^T$",))
    ax.set_title("row-parallel: one all-reduce")
    for ax in (axes["col"], axes["row"]):
        ax.text(2.9, 1.5, "·", fontsize=22, ha="center", va="center")
        ax.text(6.3, 1.5, "=", fontsize=16, ha="center", va="center")
        ax.set_xlim(-0.2, 10.0)
        ax.set_ylim(3.9, -0.2)

    ax = axes["block"]  # one block: f, a column-parallel layer, an element-wise function, a row-parallel layer, g
    for r in range(2):
        labels = ("$x$", f"$h_{r} = x A_{r}^T$", f"silu$(h_{r})$", f"silu$(h_{r}) B_{r}^T$", "$y$")
        for i, label in enumerate(labels):
            _box(ax, 2.2 * i, 1.1 * r, 1.5, 0.7, label, TP_WHOLE if i in (0, 4) else TP_COLORS[r])
            if i:
                ax.annotate("", (2.2 * i, 1.1 * r + 0.35), (2.2 * i - 0.8, 1.1 * r + 0.35),
                            arrowprops=dict(arrowstyle="->"))
        ax.text(-0.2, 1.1 * r + 0.35, f"rank {r}", ha="right", va="center", fontsize=10)
    for x, text in ((1.8, "$f$: forward identity,\nbackward all-reduce"),
                    (8.4, "$g$: forward all-reduce,\nbackward identity")):
        ax.add_patch(Rectangle((x - 0.07, -0.15), 0.14, 2.1, color="black"))
        ax.text(x, 2.05, text, ha="center", va="top", fontsize=10)
    ax.set_xlim(-1.2, 10.4)
    ax.set_ylim(2.6, -0.3)
    ax.set_title("one block, column-parallel $A$ then row-parallel $B$: all-reduces only at its two ends")
    for ax in axes.values():
        ax.axis("off")
    fig.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c, alpha=0.75) for c in (*TP_COLORS, TP_WHOLE)],
               labels=["held by rank 0", "held by rank 1", "the same on both ranks"], loc="lower center", ncol=3,
               frameon=False)
    plt.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


# ------------------------------------------------------------------------------------- step 07's picture


def draw_mixed_precision_flow():
    """Step 07's picture: one step's path from half-precision stages to the fp32 optimizer and back."""
    BOXES = [  # (x, y, text, color): half precision in orange, fp32 in blue
        (0.0, 2.0, "stage weight $w$\n(bf16/fp16)", "tab:orange"),
        (3.2, 2.0, "forward, backward\nof microbatch $i$\n(half)", "tab:orange"),
        (6.4, 2.0, "$w$.grad\n(half)", "tab:orange"),
        (9.6, 2.0, "main_grad\n$+{=}$ grad.float()\n(fp32, $m$ times)", "tab:blue"),
        (9.6, 0.0, "DP all-reduce; $\\times 1/S$;\nfound_inf? norm, clip\n(fp32)", "tab:blue"),
        (4.8, 0.0, "master $w_{32}$\nAdamW step\n(fp32)", "tab:blue"),
        (0.0, 0.0, "copy back:\n$w \\leftarrow$ cast($w_{32}$)", "tab:orange")]
    ARROWS = [(0, 1, "weights"), (1, 2, "scaled by $S$"), (2, 3, "hook, then\ngrad = None"), (3, 4, "after $m$"),
              (4, 5, "unless skipped"), (5, 6, ""), (6, 0, "next step")]
    W, H = 2.4, 1.1
    fig, ax = plt.subplots(figsize=(12, 3.6))
    for x, y, text, color in BOXES:
        ax.add_patch(FancyBboxPatch((x, y), W, H, boxstyle="round,pad=0.05", facecolor=color, alpha=0.3,
                                    edgecolor="black"))
        ax.text(x + W / 2, y + H / 2, text, ha="center", va="center", fontsize=9)
    for a, b, label in ARROWS:
        (xa, ya, *_), (xb, yb, *_) = BOXES[a], BOXES[b]
        if ya == yb:  # horizontal
            start, end = (((xa + W, ya + H / 2), (xb, yb + H / 2)) if xb > xa else
                          ((xa, ya + H / 2), (xb + W, yb + H / 2)))
        else:  # vertical
            start, end = (((xa + W / 2, ya), (xb + W / 2, yb + H)) if ya > yb else
                          ((xa + W / 2, ya + H), (xb + W / 2, yb)))
        ax.annotate("", end, start, arrowprops=dict(arrowstyle="->", lw=1.5))
        ax.text((start[0] + end[0]) / 2 + (0.1 if ya != yb else 0), (start[1] + end[1]) / 2 + 0.12, label,
                ha="center" if ya == yb else "left", va="bottom", fontsize=8)
    ax.set_xlim(-0.3, 12.3)
    ax.set_ylim(-0.3, 3.5)
    ax.axis("off")
    fig.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c, alpha=0.3) for c in ("tab:orange", "tab:blue")],
               labels=["half precision (the stages)", "fp32 (the optimizer)"], loc="lower center", ncol=2,
               frameon=False)
    plt.tight_layout(rect=(0, 0.08, 1, 1))
    return fig

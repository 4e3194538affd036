"""Drawings of step 08's side roads, for its notebook: DualPipe's chunk layout, its F&B pairs framed on a
timeline, and the overlapped pair of experts' nodes on two ideal lanes (compute and link), with the node times a
run measured. support/plots.py draws everything else."""
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from support.plots import COLORS, COMM_HEIGHT, COMPUTE_HEIGHT, PAIR


def draw_lanes(boxes, ax, title, unit="units"):
    """Step 08's overlapped pair on its two ideal lanes (tests/overlap_lanes.py's boxes: lane, "F.node layer",
    start, end): the compute on top, a box per node coloured by its pass, and the time it waits (exposed);
    below, the link, one all-to-all at a time, from its post to its arrival."""
    short = {"attention": "attn", "experts W": "exp W", "experts": "exp", "combine": "comb", "dispatch": "disp"}
    char = max(end for *_, end in boxes) / 170  # about one character of a 7-point label on a 13-inch figure
    for lane, label, start, end in boxes:
        name, layer = label.rsplit(" ", 1)
        side, node = name.split(".", 1)
        row, height = (1, COMM_HEIGHT * 2) if lane == "link" else (0, COMPUTE_HEIGHT)
        color = COLORS["all-to-all wait"] if lane == "wait" else COLORS["forward" if side == "F" else "backward"]
        ax.broken_barh([(start, end - start)], (row - height / 2, height), facecolors=[color], edgecolor="white",
                       alpha=0.55 if lane == "link" else 1.0)
        text = f"{side}.{short[node]}"
        if lane != "wait" and end - start > char * (len(text) + 1):
            ax.text((start + end) / 2, row, text, ha="center", va="center", fontsize=7, clip_on=True)
    ax.set_yticks([0, 1], ["compute", "link"])
    ax.set_ylim(1.6, -0.6)
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title)
    handles = [Patch(color=COLORS["forward"], label="F node"), Patch(color=COLORS["backward"], label="B node"),
               Patch(color=COLORS["all-to-all wait"], label="waiting (exposed)"),
               Patch(color="0.6", alpha=0.55, label="all-to-all on the link")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    return ax


def node_times(events, rank):
    """Step 08's overlapped pair: the mean time of each node of a layer on one rank, {("F" | "B", node): s},
    from a run's compute boxes named "forward attention", "backward experts W", "B combine", ..."""
    found = {}
    for e in events:
        kind, _, node = (e["what"] or "").partition(" ")
        if e["rank"] == rank and e["kind"] in ("forward", "backward", "B") and kind == e["kind"] and node:
            found.setdefault(("F" if kind == "forward" else "B", node), []).append(e["end"] - e["start"])
    return {key: sum(times) / len(times) for key, times in found.items()}


def with_pair_frames(events, logs):
    """An ideal timeline's events (ideal_events) with step 08's F&B pairs framed: in a replayed log, a pair is the
    F and the B logged right after an ("F&B",) marker."""
    framed = list(events)
    for rank, log in enumerate(logs):
        mine = [e for e in events if e["rank"] == rank]
        passes = [e for e in log if e[0] in ("F", "B", "W", "F&B")]
        paired = [i - n for n, i in enumerate(j for j, e in enumerate(passes) if e[0] == "F&B")]
        framed += [dict(mine[i], kind=PAIR, end=mine[i + 1]["end"]) for i in paired]
    return framed


def draw_chunk_layout(ax, layout, title):
    """Step 08's placement of model chunks: one row per rank, a box per chunk numbered by its stage (layout[rank]:
    the stages of its chunks 0 and 1), the forward direction's flow in blue, the reverse one's in red."""
    pp = len(layout)
    for rank, stages in enumerate(layout):
        for chunk, stage in enumerate(stages):
            color = "tab:blue" if chunk == 0 else "tab:red"
            ax.add_patch(plt.Rectangle((chunk * 1.3, rank - 0.35), 1, 0.7, color=color, alpha=0.8))
            ax.text(chunk * 1.3 + 0.5, rank, f"stage {stage}", ha="center", va="center", color="white", fontsize=8)
    ax.annotate("", xy=(-0.3, pp - 0.6), xytext=(-0.3, -0.4), arrowprops=dict(arrowstyle="->", color="tab:blue"))
    ax.annotate("", xy=(2.6, -0.4), xytext=(2.6, pp - 0.6), arrowprops=dict(arrowstyle="->", color="tab:red"))
    ax.set_xlim(-0.6, 2.9)
    ax.set_ylim(pp - 0.4, -0.6)
    ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    ax.set_xticks([0.5, 1.8], ["chunk 0", "chunk 1"])
    ax.set_title(title, fontsize=10)
    return ax

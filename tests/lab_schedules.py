"""Two of PyTorch's schedules as generators of action lists, built the way torch builds them, for the lab.

    python tests/lab_schedules.py zbv|looped-bfs PP MICROBATCHES OUT.csv

looped_bfs: ScheduleLoopedBFS (Lamy-Poirier 2023, "Breadth-First Pipeline Parallelism"), the interleaved
placement (rank r holds stages r, r+p, ...): every forward of the rank's first stage, then of its next,
then the backwards, last stage first, each over the microbatches in reverse. It stores all v*m
(stage, microbatch) pairs at once; with m >= p it idles as GPipe does, (p-1)(F+B+W) in passes of one stage.

zbv: ScheduleZBVZeroBubble (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", its ZB-V), the V placement
of DualPipeV (rank r holds stages r and 2p-1-r): a warm-up of forwards down the V, then F, I, W of
the up stage alternating with F, I, W of the down stage, then a cool-down of I's whose W's fill the drain.
Its idle and peak are measured by the lab's ideal timeline (tests/test_schedule_lab.py holds them to the
formulas in idle_formula and peak_formula).

Each is bitwise equal to torch's own order (tests/test_schedule_lab.py) and, run by step 08's runtime,
gives bitwise torch's gradients (tests/torch_pp.py).
"""
import sys


def looped_bfs(pp: int, microbatches: int, virtual: int = 2):
    """[[(stage, kind, mb)]] per rank: torch's ScheduleLoopedBFS._calculate_single_rank_operations."""
    plan = []
    for rank in range(pp):
        stages = range(rank, pp * virtual, pp)
        forwards = [(s, "F", mb) for s in stages for mb in range(microbatches)]
        backwards = [(s, "B", mb) for s in reversed(stages) for mb in reversed(range(microbatches))]
        plan.append(forwards + backwards)
    return plan


def zbv(pp: int, microbatches: int):
    """[[(stage, kind, mb)]] per rank: torch's ScheduleZBVZeroBubble._calculate_single_rank_operations. It
    plans max(2p-1, m) microbatches and drops those past m."""
    return [[a for a in zbv_rank(pp, rank, max(2 * pp - 1, microbatches)) if a[2] < microbatches]
            for rank in range(pp)]


def zbv_rank(pp: int, rank: int, n: int):
    """One rank's ZB-V over n microbatches: chunk 0 is the down stage (rank), chunk 1 the up stage (2p-1-rank)."""
    stage = (rank, 2 * pp - 1 - rank)
    count = {(c, kind): 0 for c in (0, 1) for kind in "FIW"}
    ops = []

    def act(chunk, kind):
        ops.append((stage[chunk], kind, count[chunk, kind]))
        count[chunk, kind] += 1

    for _ in range(2 * (pp - rank) - 1):  # warm-up: forwards down the V
        act(0, "F")
    for _ in range(rank):  # the first microbatches come back up
        act(1, "F")
        act(0, "F")
    for _ in range(pp - rank):  # the up stage's first backwards, each W at once
        act(1, "F"), act(1, "I"), act(1, "W")
    while count[1, "F"] < count[0, "F"] or count[0, "F"] < n:  # steady: both stages, F I W each
        if count[0, "F"] < n:
            act(0, "F")
        act(0, "I"), act(0, "W"), act(1, "F"), act(1, "I"), act(1, "W")
    for _ in range(rank):  # cool-down: I's first, their W's later
        act(0, "I"), act(1, "I")
    for _ in range(pp - rank):
        act(0, "I"), act(0, "W")
    while count[1, "W"] < count[1, "I"]:
        act(1, "W")
    while count[0, "W"] < count[0, "I"]:
        act(0, "W")
    return ops


GENERATORS = {"zbv": zbv, "looped-bfs": looped_bfs}


def write(path, plan):
    """One CSV row per rank, in PyTorch's notation."""
    with open(path, "w") as out:
        out.writelines(",".join(f"{s}{kind}{mb}" for s, kind, mb in row) + "\n" for row in plan)


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[1] not in GENERATORS:
        sys.exit("usage: python tests/lab_schedules.py zbv|looped-bfs PP MICROBATCHES OUT.csv")
    write(sys.argv[4], GENERATORS[sys.argv[1]](int(sys.argv[2]), int(sys.argv[3])))

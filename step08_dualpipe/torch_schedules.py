"""Two of PyTorch's schedules as lists of actions, built the way torch builds them, run by schedule_lab.py.

Read this after schedule_lab.py: it shows that a schedule is only its list. Each function returns,
per rank, the (stage, kind, microbatch) computes of torch.distributed.pipelining's class, in its order
(tests/test_schedule_lab.py compares them action for action, and the gradients bitwise):

    --schedule looped-bfs   ScheduleLoopedBFS (Lamy-Poirier 2023, "Breadth-First Pipeline Parallelism")
    --schedule zbv          ScheduleZBVZeroBubble (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ZB-V)

Their bubbles are in pass times of one stage (the model has 2p of them): F a forward, B a backward's
input-gradient pass, W its weight-gradient pass, a full backward B + W.
"""


def looped_bfs(pp: int, microbatches: int, virtual: int = 2):
    """The interleaved placement (rank r holds stages r, r+p, ...): every forward of the rank's first stage,
    then of its next, then the backwards, last stage first, each over the microbatches in reverse.
    torch's ScheduleLoopedBFS._calculate_single_rank_operations."""
    plan = []
    for rank in range(pp):
        stages = range(rank, pp * virtual, pp)
        forwards = [(s, "F", mb) for s in stages for mb in range(microbatches)]
        backwards = [(s, "B", mb) for s in reversed(stages) for mb in reversed(range(microbatches))]
        plan.append(forwards + backwards)
    return plan


def zbv(pp: int, microbatches: int):
    """The V placement of DualPipeV (rank r holds stages r and 2p-1-r), each backward split into I and W.
    torch's ScheduleZBVZeroBubble._calculate_single_rank_operations: it plans max(2p-1, m) microbatches
    and drops those past m."""
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


GENERATORS = {"looped-bfs": looped_bfs, "zbv": zbv}


def idle_formula(name: str, pp: int, microbatches: int, f, b, w):
    """(text, each rank's idle time) of the ideal timeline, or None where the formula does not hold.

    Looped BFS, m >= p: (p-1)(F+B+W), GPipe's. Rank r waits r*F for its first input, (p-1-r)(F+B+W)
    between its last forward and its first backward (the last stage's backward must come back down),
    and r(B+W) after its last backward. Nothing else: with m >= p, a microbatch comes back to rank r
    for its second stage (after p+r forwards) once the rank's m first-stage forwards are done.
    ZB-V, m >= 2p-1, F <= B and W <= B: (p-1) max(B, 2(B-W)). Found exact by the ideal timeline for
    p from 2 to 6 and F, B, W on a grid (tests/test_schedule_lab.py); not derived here.
    """
    if name == "looped-bfs" and microbatches >= pp:
        return "(p-1)(F+B+W)", (pp - 1) * (f + b + w)
    if name == "zbv" and microbatches >= 2 * pp - 1 and f <= b and w <= b:
        return "(p-1) max(B, 2(B-W))", (pp - 1) * max(b, 2 * (b - w))
    return None


def peak_formula(name: str, pp: int, microbatches: int):
    """(text, the most (stage, microbatch) pairs a rank holds). Looped BFS holds every pair until the
    backwards begin: 2m. ZB-V holds 2p (p whole microbatches of activations, 1F1B's first stage) once
    m >= 2p-1, for its warm-up sends 2p-1 forwards down the V before the first backward comes back."""
    if name == "looped-bfs":
        return "2m", 2 * microbatches
    return ("2p", 2 * pp) if microbatches >= 2 * pp - 1 else None

"""The schedules' formulas, written here from the papers, independently of the steps' code.

Tests hold what train.py prints (and what the replay measures) to these.
"""


def bubble(schedule: str, pp: int, m: int, virtual: int = 1, times=None, sequential_pairs=False) -> float:
    """Idle fraction of a rank's step: p-1 fill-and-drain slots beside the work slots.

    naive: one slot (the whole batch); GPipe, AFAB and 1F1B: m slots; interleaved: v*m slots.
    zb1p: the idle time (p-1)(F+B-W) beside the work m(F+B+W), with times = (F, B, W); DualPipe and
    DualPipeV: two_way_idle (two_way_sequential_idle with sequential_pairs) beside the rank's passes.
    PyTorch's Looped BFS (m >= p) and ZB-V (m >= 2p-1, F <= B, W <= B), two stages per rank of times (F, B, W):
    (p-1)(F+B+W) and (p-1)max(B, 2(B-W)) beside 2m(F+B+W); None where they make no claim.
    """
    if schedule in ("looped-bfs", "zbv"):
        f, b, w = times
        holds = m >= pp if schedule == "looped-bfs" else m >= 2 * pp - 1 and f <= b and w <= b
        idle = (pp - 1) * ((f + b + w) if schedule == "looped-bfs" else max(b, 2 * (b - w)))
        return idle / (2 * m * (f + b + w) + idle) if holds else None
    if schedule == "zb1p":
        idle = zb1p_idle(pp, *times)
        return idle / (m * sum(times) + idle)
    if schedule in ("dualpipe", "dualpipev"):  # each rank runs 2 chunks x m (DualPipe: x m/2) of each pass
        idle = (two_way_sequential_idle if sequential_pairs else two_way_idle)(two_way_stages(schedule, pp), *times)
        passes = m if schedule == "dualpipe" else 2 * m
        return idle / (passes * sum(times) + idle)
    slots = {"naive": 1, "interleaved": virtual * m}.get(schedule, m)
    return (pp - 1) / (slots + pp - 1)


def pipedream_bubble(pp: int, m: int, steps: int) -> float:
    """PipeDream and 2BW never flush: one fill and one drain of p-1 slots beside the run's steps x m."""
    return bubble("1f1b", pp, steps * m)


def peak_versions(schedule: str, vertical_sync: bool, pp: int, stage: int, steps: int, stashing=True) -> int:
    """Weight versions a stage holds at once, the live one included, in a run long enough for its steady state.

    PipeDream (2019): one per microbatch in flight, p - stage, as 1F1B holds activations. Vertical sync: stage
    s runs on stage 0's version, p-1 behind, and keeps every version from that one to its live one, p. 2BW
    (2021): the live W(t+1) and the W(t) the batch in flight runs on, once there has been an update. Without
    stashing, only the live one."""
    if not stashing:
        return 1
    if schedule == "pipedream-2bw":
        return min(2, steps)
    return pp if vertical_sync else pp - stage


def zb1p_idle(pp: int, f, b, w):
    """ZB-H1's idle time per rank (Qi et al. 2024, section 3): 1F1B's (p-1)(F+B+W) less 2(p-1)W."""
    return (pp - 1) * (f + b - w)


def warmup(schedule: str, pp: int, stage: int, m: int, virtual: int = 1) -> int:
    """Forwards a stage runs before its first backward."""
    if schedule in ("gpipe", "afab"):
        return m
    if schedule in ("1f1b", "zb1p", "pipedream", "pipedream-2bw"):  # PipeDream: m is the run's steps x m
        return min(pp - stage - 1, m)
    return min((pp - stage - 1) * 2 + (virtual - 1) * pp, m * virtual)  # Megatron's interleaved warm-up


def peak_stored(schedule: str, pp: int, stage: int, m: int, virtual: int = 1) -> int:
    """(Virtual) microbatches whose activations a stage holds at once: the warm-up, plus the steady state's one."""
    if schedule == "zb1p":  # 1F1B's p - stage, and the stage's W's wait for `stage` more microbatches
        return min(pp, m)
    if schedule in ("looped-bfs", "zbv"):  # (stage, microbatch) pairs: BFS holds every forward; ZB-V its warm-up's
        return 2 * m if schedule == "looped-bfs" else 2 * pp if m >= 2 * pp - 1 else None
    if schedule in ("dualpipe", "dualpipev"):
        return two_way_peak(two_way_stages(schedule, pp))
    return m if schedule in ("gpipe", "afab") else min(warmup(schedule, pp, stage, m, virtual) + 1, m * virtual)


def two_way_phases(n: int, i: int, k: int) -> list:
    """DualPipe's eight phase counts (DeepSeek's dualpipe.py, step_1 .. step_8) at place i of a V of n ranks
    that k microbatches cross: DualPipeV n = p, i = rank, k = m; DualPipe n = p/2, i = min(r, p-1-r), k = m/2."""
    return [2 * (n - 1 - i), i + 1, n - 1 - i, k - 2 * n + i + 1, n - 1 - i, i + 1, n - 1 - i, i + 1]


def two_way_peak(stages: int) -> int:
    """DualPipe and DualPipeV: (chunk, microbatch) pairs a rank holds at once, DeepSeek's table's PP + 1."""
    return stages + 1


def two_way_idle(stages: int, f, b, w):
    """DualPipe and DualPipeV's idle time per rank in the order DeepSeek's code runs, with a pair's outputs
    sent when the pair ends and a pair started once all its inputs are there: the longest of six chains of
    n = PP/2-1 links, found by laying the replayed order out on exact pass times (tests/ideal.py) and held to
    it there for every allowed configuration.
    n(2F+B-W) is the longest for F <= B <= (1+1/n)F and W <= B. DeepSeek's table writes (PP/2-1)(F&B+B-3W)
    with B a whole backward; a pair run one pass after the other is F&B = F+B+W, which gives n(F+2B-W)."""
    n = stages // 2 - 1
    if n <= 0:
        return 0
    return max(n * (2 * f + b - w), (2 * n + 1) * f + (n - 1) * b - n * w, (n - 1) * f + 2 * n * b - n * w,
               2 * n * f, (2 * n + 1) * f - b, (n - 1) * f + n * b)


def two_way_sequential_idle(stages: int, f, b, w):
    """The same, with each pair run as its forward and then its backward, each with its own commit (step 08's
    --pairs sequential): the forward's output leaves before the backward, whose gradient is waited for only
    then. The longest of ten chains of n = PP/2-1 links, found the same way; n(F+B-W), ZB-H1's, for
    F <= B <= (1+1/n)F and W <= B. At n = 1 some chains coincide."""
    n = stages // 2 - 1
    if n <= 0:
        return 0
    return max(n * (f + b - w), n * f, n * b - f, 2 * n * b - n * w - f, (n + 1) * f - b,
               (n + 1) * f + (n - 1) * b - n * w, 2 * n * f - n * b - (n - 1) * w, 2 * n * f - (2 * n - 1) * w,
               (2 * n + 1) * f - 2 * b - (2 * n + 1) * w, (2 * n + 1) * f - (n + 2) * b - (n + 1) * w)


def two_way_stages(schedule: str, pp: int) -> int:
    """DualPipe cuts the model into p stages (each held twice), DualPipeV into 2p."""
    return pp if schedule == "dualpipe" else 2 * pp

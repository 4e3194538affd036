"""Step 08's DualPipe and DualPipeV, replayed without a model (replay.py calls check_two_way).

For every configuration the step's rules allow, DualPipe with p in {2, 4, 6, 8} and DualPipeV with
p in 1..8, m from 2p to 2p + 12 (odd m included where allowed), the step's own schedule runs on the
fake transport of replay.py, and:

  * each rank's passes follow the eight phases, with the counts of formulas.two_way_phases;
  * every (model chunk, microbatch) runs F, then B, then W if its B was split; W's in FIFO order,
    none left in the store;
  * every send meets its receive with no deadlock, and every pass consumed the right tensor;
  * the peak number of (chunk, microbatch) pairs a rank holds is formulas.two_way_peak;
  * the ideal timeline, each message leaving where the code commits it, idles formulas.two_way_idle on
    every rank, in exact arithmetic, for pass times that make each of its six chains the longest; at
    near-equal times, sending each output as its pass ends or waiting for each receive only where it is
    used leaves that idle as it is, and doing both gives ZB-H1's (PP/2-1)(F+B-W) (pair_problems);
  * with --pairs sequential (each pair run as F, then B, each with its own commit): the same passes and
    tensors, messages matched as gloo matches them, its batches deadlocking on in-order streams, and its
    ideal idle formulas.two_way_sequential_idle at times that make each of its ten chains the longest.

DualPipeV's per-rank order, pairs included, must equal torch.distributed.pipelining's
ScheduleDualPipeV.pipeline_order for p <= 4. Negative controls, which must be caught: an activation
of one direction and a gradient of the other swapped inside one batch between two ranks; every
rank posting its sends first, one at a time; the ideal-timeline check on DualPipeV's order with
nothing split (every backward whole), and on an ideal timeline that sends each output as its pass
ends and waits for each receive only where it is used; the sequential pairs' formula held against the
default order; the phase check on a table with two phases' counts swapped.
"""
from collections import defaultdict
from fractions import Fraction

import formulas
from ideal import ideal_idle, is_split
from replay import FakeDist, check_consumed, check_weight_order, match

TWO_WAY = {"dualpipe": (2, 4, 6, 8), "dualpipev": tuple(range(1, 9))}
EXTRA_M = 12
PATTERNS = [["F0"], ["F0", "F1"], ["B1", "W", "F1"], ["F0", "B1", "F1", "B0"], ["B1", "F1", "B0"], ["B1", "B0"],
            ["W", "B0"], ["W"]]  # the eight phases, in the order DeepSeek's code names them
# Pass times (F, B, W): equal; then, for each of the six chains of formulas.two_way_idle, times where it
# alone is the longest (n(2F+B-W) first) for every n = PP/2-1 up to 7.
HALF = Fraction(1, 2)
TIMES = [dict(zip("FBW", map(Fraction, t))) for t in
         [(1, 1, 1), (1, Fraction(11, 10), HALF), (Fraction(3, 2), 1, HALF), (1, 2, HALF), (1, Fraction(11, 10), 2),
          (3, 1, 2), (1, 3, 4)]]
# The same for --pairs sequential's ten chains (formulas.two_way_sequential_idle, n(F+B-W) first), each
# alone the longest for every n from 2 to 7 (at n = 1 some chains coincide).
TIMES_SEQUENTIAL = [dict(F=Fraction(1), B=Fraction(b), W=Fraction(w)) for b, w in
                    [(1, 1), ("11/10", "1/10"), ("11/10", "6/5"), ("8/5", "7/4"), ("8/5", "1/10"), ("1/10", 1),
                     ("3/5", "1/2"), ("1/10", "1/2"), ("3/10", "1/4"), ("1/5", "1/10"), ("1/10", "1/5")]]


def place(name, pp, rank):
    """(n, i, mirrored): the rank's V of n ranks, its place i in it, and whether its phase 0 goes up."""
    if name == "dualpipev":
        return pp, rank, False
    return pp // 2, min(rank, pp - 1 - rank), rank >= pp // 2


def expected_passes(name, pp, rank, m, counts=None):
    """The rank's passes as the phase table says: F0, F1, B0, B1 (by phase) and W."""
    n, i, _ = place(name, pp, rank)
    counts = counts or formulas.two_way_phases(n, i, m if name == "dualpipev" else m // 2)
    return [p for pattern, count in zip(PATTERNS, counts) for _ in range(count) for p in pattern]


def observed_passes(name, pp, rank, log):
    """The rank's logged passes in the same words: chunk c is phase c, or 1 - c on DualPipe's lower half."""
    mirrored = place(name, pp, rank)[2]
    return ["W" if e[0] == "W" else f"{e[0]}{e[1][0] ^ mirrored}" for e in log if e[0] in ("F", "B", "W")]


def check_rank(name, pp, rank, m, log):
    """Problems in one rank's log: phases, per-pair order, W's, the peak."""
    passes = [e for e in log if e[0] in ("F", "B", "W")]
    problems = [] if observed_passes(name, pp, rank, log) == expected_passes(name, pp, rank, m) else [
        f"the passes {' '.join(observed_passes(name, pp, rank, log))} do not follow the eight phases"]
    problems += check_weight_order(passes)
    forwards, backwards = [e[1] for e in passes if e[0] == "F"], [e[1] for e in passes if e[0] == "B"]
    half = m // 2
    mine = {(c, mb) for c in (0, 1) for mb in
            (range(m) if name == "dualpipev" else range(half) if c == 0 else range(half, m))}
    if sorted(forwards) != sorted(mine) or sorted(backwards) != sorted(mine):
        problems.append(f"forwards {forwards} and backwards {backwards} are not each of {sorted(mine)} once")
    order = {}
    for index, e in enumerate(passes):
        order.setdefault((e[0], e[1]), index)
    problems += [f"B of {key} before its F" for key in mine if order.get(("B", key), -1) < order.get(("F", key), 0)]
    in_flight = peak = 0
    for e in passes:
        in_flight += 1 if e[0] == "F" else -1 if e[0] == "W" or e[0] == "B" and not is_split(e) else 0
        peak = max(peak, in_flight)
    stages = formulas.two_way_stages(name, pp)
    if peak != formulas.two_way_peak(stages):
        problems.append(f"peak {peak} (chunk, microbatch) pairs held, expected {formulas.two_way_peak(stages)}")
    return problems


def configurations(step):
    for name, pps in TWO_WAY.items():
        for pp in pps:
            for m in range(2 * pp, 2 * pp + EXTRA_M + 1):
                if step.allowed(name, pp, m, 1, "batched"):
                    yield name, pp, m


def check_configuration(step, name, pp, m):
    logs, dist = step.replay(name, pp, m, "batched")
    problems = match(dist.streams, pp)
    for rank, log in enumerate(logs):
        problems += [f"rank {rank}: {p}" for p in check_rank(name, pp, rank, m, log)]
        if not problems:
            problems += [f"rank {rank}: {p}" for p in check_consumed(log)]
    problems += idle_problems(name, pp, [ideal_idle(logs, times) for times in TIMES])
    problems += pair_problems(step, name, pp, m, logs)
    problems += sequential_problems(step, name, pp, m)
    return [f"{name} pp={pp} m={m}: {p}" for p in problems]


def sequential_problems(step, name, pp, m):
    """--pairs sequential: the same passes and tensors, its ideal idle the ten chains' longest; and on
    in-order streams its batches deadlock whenever the pipeline has messages (why config.py keeps it
    off CUDA). gloo matches each send with its receive whatever else was posted first (fill_in_pairs)."""
    logs, dist = step.replay(name, pp, m, "batched", sequential_pairs=True)
    deadlocks = any("deadlock" in p for p in match(dist.streams, pp))
    problems = [] if deadlocks == (pp > 1) else [f"sequential pairs: deadlock on in-order streams {deadlocks}, "
                                                 f"expected {pp > 1}"]
    fill_in_pairs(dist.streams)
    for rank, log in enumerate(logs):
        problems += [f"sequential pairs, rank {rank}: {p}" for p in check_rank(name, pp, rank, m, log)]
        problems += [f"sequential pairs, rank {rank}: {p}" for p in check_consumed(log)]
    return problems + [f"sequential pairs: {p}" for p in idle_problems(
        name, pp, [ideal_idle(logs, times) for times in TIMES_SEQUENTIAL], TIMES_SEQUENTIAL,
        formulas.two_way_sequential_idle)]


def fill_in_pairs(streams):
    """Give every receive its send's content as gloo pairs them: the k-th send from rank r to q meets the
    k-th receive on q from r, whatever else either rank posted before it."""
    sends, recvs = defaultdict(list), defaultdict(list)
    for rank, groups in streams.items():
        for op in (op for group in groups for op in group):
            (sends[rank, op.peer] if op.is_send else recvs[op.peer, rank]).append(op)
    for key, ops in recvs.items():
        for send, recv in zip(sends[key], ops):
            recv.content = send.tensor


def pair_problems(step, name, pp, m, logs):
    """Why the pair costs one F per link over ZB-H1 at near-equal pass times (TIMES[1]): it is one unit both
    ways, started once every input of its commit is there and sending when both passes are done. Either
    rule of another code alone (each output sent as its pass ends; each receive waited for by the pass that
    uses it) leaves the idle as it is; both together give ZB-H1's (PP/2-1)(F+B-W)."""
    layouts = [step.layout(name, pp, m, 1, rank)[0] for rank in range(pp)]
    times, stages = TIMES[1], formulas.two_way_stages(name, pp)
    zb1p_like = max(stages // 2 - 1, 0) * (times["F"] + times["B"] - times["W"])
    problems = []
    for rules, expected in ((dict(sends_at_pass_end=True), formulas.two_way_idle(stages, *times.values())),
                            (dict(waits_at_use=True), formulas.two_way_idle(stages, *times.values())),
                            (dict(sends_at_pass_end=True, waits_at_use=True), zb1p_like)):
        idle = ideal_idle(logs, times, layouts=layouts, **rules)
        problems += [f"ideal timeline with {rules}: rank {r} idles {i}, expected {expected}"
                     for r, i in enumerate(idle) if i != expected]
    return problems


def idle_problems(name, pp, idles, all_times=TIMES, formula=formulas.two_way_idle):
    """Where each rank's idle time, one list per entry of all_times, differs from the formula."""
    problems, stages = [], formulas.two_way_stages(name, pp)
    for times, idle in zip(all_times, idles):
        expected = formula(stages, times["F"], times["B"], times["W"])
        problems += [f"ideal timeline with {times}: rank {r} idles {i}, expected {expected}"
                     for r, i in enumerate(idle) if i != expected]
    return problems


def torch_order(pp, m):
    """ScheduleDualPipeV's pipeline_order as our log entries: F, B (whole), B split, W, with pairs marked."""
    from torch.distributed.pipelining import schedules as ts

    schedule = ts.ScheduleDualPipeV.__new__(ts.ScheduleDualPipeV)  # the order needs no stages or processes
    schedule.pp_group_size, schedule._n_microbatches = pp, m
    words = {ts.FORWARD: ("F",), ts.FULL_BACKWARD: ("B",), ts.BACKWARD_INPUT: ("B", "split"),
             ts.BACKWARD_WEIGHT: ("W",)}
    orders = []
    for rank in range(pp):
        order = []

        def add(action):
            if action.computation_type == ts.OVERLAP_F_B:
                order.append(("F&B",))
                for sub in action.sub_actions:
                    add(sub)
                return
            kind, *split = words[action.computation_type]
            order.append((kind, (int(action.stage_index != rank), action.microbatch_index), *split))

        for action in schedule._calculate_single_rank_operations(rank):
            add(action)
        orders.append(order)
    return orders


def compare_with_torch(step):
    """(configurations compared, differences) for DualPipeV with p <= 4."""
    compared, differences = 0, []
    for name, pp, m in configurations(step):
        if name == "dualpipev" and pp <= 4:
            logs, _ = step.replay(name, pp, m, "batched")
            ours = [[e for e in log if e[0] in ("F", "B", "W", "F&B")] for log in logs]
            compared += 1
            differences += [f"p={pp} m={m} rank {r}" for r, (a, b) in enumerate(zip(ours, torch_order(pp, m)))
                            if a != b]
    return compared, differences


def controls(step):
    """Each broken variant must be caught."""
    logs, dist = step.replay("dualpipev", 2, 4, "batched", dist=FakeDist(swap_on=1))
    swapped = bool(match(dist.streams, 2) or [p for log in logs for p in check_consumed(log)])
    _, dist = step.replay("dualpipe", 4, 8, "batched", dist=FakeDist(send_first=True))
    deadlocks = any("deadlock" in p for p in match(dist.streams, 4))
    logs, _ = step.replay("dualpipev", 4, 8, "batched")
    whole = [[("B", e[1]) if is_split(e) else e for e in log if e[0] != "W"] for log in logs]  # each B with its W
    unsplit = bool(idle_problems("dualpipev", 4, [ideal_idle(whole, TIMES[1])]))
    layouts = [step.layout("dualpipev", 4, 8, 1, rank)[0] for rank in range(4)]
    at_pass_end = bool(idle_problems("dualpipev", 4, [ideal_idle(logs, times, layouts=layouts, sends_at_pass_end=True,
                                                                 waits_at_use=True) for times in TIMES]))
    sequential = bool(idle_problems("dualpipev", 4, [ideal_idle(logs, times) for times in TIMES_SEQUENTIAL],
                                    TIMES_SEQUENTIAL, formulas.two_way_sequential_idle))
    counts = formulas.two_way_phases(4, 1, 8)
    counts[0], counts[1] = counts[1], counts[0]
    phases = observed_passes("dualpipev", 4, 1, logs[1]) != expected_passes("dualpipev", 4, 1, 8, counts)
    return dict(two_way_swapped_in_batch_caught=swapped, two_way_send_first_deadlocks=deadlocks,
                two_way_unsplit_bubble_caught=unsplit, two_way_sent_at_pass_end_caught=at_pass_end,
                two_way_overlapped_pairs_as_sequential_caught=sequential,
                two_way_wrong_phases_caught=phases)


def check_two_way(step):
    """The report's two-way part: counts, problems, the torch comparison and the controls."""
    problems, count = [], 0
    for name, pp, m in configurations(step):
        problems += check_configuration(step, name, pp, m)
        count += 1
    compared, differences = compare_with_torch(step)
    return dict(two_way_configurations=count, two_way_problems=problems[:50], torch_dualpipev_compared=compared,
                torch_dualpipev_differences=differences[:20], **controls(step))

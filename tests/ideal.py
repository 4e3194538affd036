"""Ideal timelines of replayed schedules: every pass as early as the code's messages allow, in exact arithmetic.

replay.py records each rank's forwards (F), backwards (B) and weight-gradient passes (W), and where
the rank posts each message and waits for each receive. Laid out with given pass times and messages
that take no time, they show a schedule's own bubble, apart from unequal stages and message time:
a message leaves when the code posts it, not when the pass that made it ends (DualPipe's pair sends
its outputs after both its passes). Notebook 08 draws them; test_schedules.py holds them to the
formulas, with the rules of another code (each output sent as its pass ends, each receive waited
for only by the pass that uses it) as the control.
"""
from collections import Counter, defaultdict
from fractions import Fraction

import formulas


def is_split(entry) -> bool:
    """A logged B whose W comes later (step 08); a whole backward logs as ("B", (chunk, mb))."""
    return entry[0] == "B" and entry[-1] == "split"


def ideal_passes(logs, times, layouts=None, sends_at_pass_end=False, waits_at_use=False):
    """Each rank's replayed passes, each run as early as the code's messages allow: dicts of rank, kind,
    chunk (this rank's), mb, start, end, split.

    times: exact durations {"F", "B", "W"} (a backward that is not split takes B + W), or a list of
    them, one per rank, for stages of unequal cost; a rank's entry may also be a list of each of its
    passes' durations, in the order it runs them (a measured run's own, pass by pass). A rank runs its log in order. Messages take no
    time, but leave where the code posts them: a send leaves at the rank's clock when its group is
    posted (DualPipe's commit, right before the rank's next compute, so a pair's outputs leave when
    the pair ends), and a rank that waits for a receive (logged where the code waits: DualPipe's
    commit waits for every receive of its batch) resumes when the matching send has left: the k-th
    send from rank r to q meets the k-th receive on q from r. A wait for a send costs nothing.

    Two rules of other codes, to measure what each costs: sends_at_pass_end, every output leaves as
    the pass that made it ends (layouts[rank][chunk]: the global model chunk a rank's chunk is, to
    know which pass made it); waits_at_use, a rank waits for a receive only right before the pass
    that consumes it.
    """
    assert layouts or not sends_at_pass_end, "sends_at_pass_end needs the layouts, to know which pass made a send"
    per_rank = [list(t) if isinstance(t, list) else t for t in times] if isinstance(times, list) \
        else [times] * len(logs)
    match_of = _receive_keys(logs)
    left = defaultdict(list)  # (from, to) -> when each send left, in posting order
    made = {}  # (rank, tag kind, global chunk, mb) -> when the pass that made that tensor ended
    clock, done, boxes = [Fraction(0)] * len(logs), [0] * len(logs), []

    def arrived(rank, op):
        """When a receive's send left, or None if it has not been posted yet."""
        key, k = match_of[id(op)]
        return left[key][k] if len(left[key]) > k else None

    progress = True
    while progress:
        progress = False
        for rank, log in enumerate(logs):
            while done[rank] < len(log):
                entry = log[done[rank]]
                if entry[0] == "post":
                    for op in entry[1]:
                        if op.is_send:
                            tag = tuple(int(x) for x in op.tensor.tolist())
                            left[rank, op.peer].append(made.get((rank, *tag), clock[rank]) if sends_at_pass_end
                                                       else clock[rank])
                elif entry[0] == "wait" and not entry[1].is_send and not waits_at_use:
                    if arrived(rank, entry[1]) is None:
                        break  # the sender has not posted it yet
                    clock[rank] = max(clock[rank], arrived(rank, entry[1]))
                elif entry[0] in ("F", "B", "W"):
                    needs = _consumed(log, done[rank]) if waits_at_use else None
                    if needs is not None and arrived(rank, needs) is None:
                        break
                    boxes.append(_box(rank, entry, max(clock[rank], arrived(rank, needs) if needs else 0),
                                      per_rank[rank]))
                    clock[rank] = boxes[-1]["end"]
                    if layouts and entry[0] != "W":  # what the pass made: an activation (1) or a gradient (2)
                        made[rank, 1 if entry[0] == "F" else 2, layouts[rank][entry[1][0]], entry[1][1]] = clock[rank]
                done[rank] += 1
                progress = True
    assert all(d == len(log) for d, log in zip(done, logs)), "the replayed order deadlocks even with free messages"
    return boxes


def _consumed(log, index):
    """The receive that the pass at log[index] consumes (its fake stage logs it next), or None."""
    following = log[index + 1] if index + 1 < len(log) else None
    source = following[2] if following and following[0] == "expect" else None
    return source if source is not None and hasattr(source, "is_send") else None


def _receive_keys(logs):
    """id(receive) -> ((from, to), k): it is the k-th receive rank `to` posted from `from`."""
    keys, count = {}, Counter()
    for rank, log in enumerate(logs):
        for entry in log:
            if entry[0] == "post":
                for op in entry[1]:
                    if not op.is_send:
                        keys[id(op)] = ((op.peer, rank), count[op.peer, rank])
                        count[op.peer, rank] += 1
    return keys


def _box(rank, entry, start, t):
    """One pass, started at `start`, with the rank's pass times t (or its next measured duration, taken from t)."""
    kind, (chunk, mb), *_ = entry
    split = is_split(entry)
    end = start + (t.pop(0) if isinstance(t, list) else t["B"] + t["W"] if kind == "B" and not split else t[kind])
    return dict(rank=rank, kind=kind, chunk=chunk, mb=mb, start=start, end=end, split=split)


def ideal_timeline(logs, times):
    """ideal_passes as (rank, kind, mb, start, end) tuples."""
    return [(b["rank"], b["kind"], b["mb"], b["start"], b["end"]) for b in ideal_passes(logs, times)]


def idle_of(boxes, ranks):
    """Per rank, the timeline's length minus the rank's compute."""
    length = max(b["end"] for b in boxes)
    return [length - sum(b["end"] - b["start"] for b in boxes if b["rank"] == rank) for rank in range(ranks)]


def ideal_idle(logs, times, **rules):
    """Per rank, the ideal timeline's idle time (rules: those of ideal_passes)."""
    return idle_of(ideal_passes(logs, times, **rules), len(logs))


def check_zb1p_bubble(step, most=(None, None)):
    """For every zb1p configuration the rules allow (pp and m up to `most`, if given): each rank's ideal idle
    time equals (p-1)(F+B-W) exactly, for equal and for unequal pass times. Control: 1F1B's order must fail
    the same check."""
    problems, checked, control_caught = [], 0, True
    for times in ({"F": Fraction(1), "B": Fraction(1), "W": Fraction(1)},
                  {"F": Fraction(1), "B": Fraction(6, 5), "W": Fraction(3, 5)}):
        expected = lambda pp: formulas.zb1p_idle(pp, times["F"], times["B"], times["W"])  # noqa: E731
        for name, pp, m, _, ordering in step.configurations():
            small = (most[0] or pp) >= pp and (most[1] or m) >= m
            if name == "zb1p" and ordering == "batched" and small:
                idle = ideal_idle(step.replay(name, pp, m, ordering)[0], times)
                checked += 1
                problems += [f"zb1p pp={pp} m={m} {times}: rank {r} idles {i}, (p-1)(F+B-W) = {expected(pp)}"
                             for r, i in enumerate(idle) if i != expected(pp)]
        control_caught &= ideal_idle(step.replay("1f1b", 4, 8, "batched")[0], times) != [expected(4)] * 4
    return dict(zb1p_bubble_configurations=checked, zb1p_bubble_problems=problems[:50],
                one_f_one_b_bubble_caught=control_caught)

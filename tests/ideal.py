"""Ideal timelines of replayed schedules: every pass as early as its data allows, in exact arithmetic.

replay.py records each rank's forwards (F), backwards (B) and weight-gradient passes (W); laid out
with given pass times and free messages, they show a schedule's own bubble, apart from unequal
stages and message time. Notebooks 05 and 08 draw them; test_schedules.py holds them to the formulas.
"""
from fractions import Fraction

import formulas


def is_split(entry) -> bool:
    """A logged B whose W comes later (step 08); a whole backward logs as ("B", (chunk, mb))."""
    return entry[0] == "B" and entry[-1] == "split"


def ideal_passes(logs, times, layouts=None):
    """Each rank's replayed passes, each run as early as its data allows: dicts of rank, kind, chunk
    (this rank's), mb, start, end, split.

    times: exact durations {"F", "B", "W"} (a backward that is not split takes B + W), or a list of
    them, one per rank, for stages of unequal cost. layouts[rank][chunk]: the global model chunk that
    a rank's chunk is (default: one chunk per rank, rank r holding chunk r). Messages take no time:
    the forward of mb on global chunk g waits only for the forward of mb on g-1, a backward for the
    backward on g+1.
    """
    per_rank = times if isinstance(times, list) else [times] * len(logs)
    layouts = layouts or [[rank] for rank in range(len(logs))]
    last = max(g for layout in layouts for g in layout)
    passes = [[e for e in log if e[0] in ("F", "B", "W")] for log in logs]
    ends, clock, boxes = {}, [Fraction(0)] * len(logs), []
    progress = True
    while progress:
        progress = False
        for rank, todo in enumerate(passes):
            while todo:
                kind, (chunk, mb), *_ = todo[0]
                g = layouts[rank][chunk]
                needs = ("F", g - 1, mb) if kind == "F" and g > 0 else ("B", g + 1, mb) if kind == "B" and g < last \
                    else None
                if needs and needs not in ends:
                    break
                start, t, split = max(clock[rank], ends.get(needs, 0)), per_rank[rank], is_split(todo[0])
                clock[rank] = start + (t["B"] + t["W"] if kind == "B" and not split else t[kind])
                ends[kind, g, mb] = clock[rank]
                boxes.append(dict(rank=rank, kind=kind, chunk=chunk, mb=mb, start=start, end=clock[rank],
                                  split=split))
                todo.pop(0)
                progress = True
    assert not any(passes), "the replayed order deadlocks even with free messages"
    return boxes


def ideal_timeline(logs, times, layouts=None):
    """ideal_passes as (rank, kind, mb, start, end) tuples."""
    return [(b["rank"], b["kind"], b["mb"], b["start"], b["end"]) for b in ideal_passes(logs, times, layouts)]


def ideal_idle(logs, times, layouts=None):
    """Per rank, the ideal timeline's length minus the rank's compute."""
    boxes = ideal_timeline(logs, times, layouts)
    length = max(end for *_, end in boxes)
    return [length - sum(end - start for r, *_, start, end in boxes if r == rank) for rank in range(len(logs))]


def check_zb1p_bubble(step):
    """For every zb1p configuration the rules allow: each rank's ideal idle time equals (p-1)(F+B-W)
    exactly, for equal and for unequal pass times. Control: 1F1B's order must fail the same check."""
    problems, checked, control_caught = [], 0, True
    for times in ({"F": Fraction(1), "B": Fraction(1), "W": Fraction(1)},
                  {"F": Fraction(1), "B": Fraction(6, 5), "W": Fraction(3, 5)}):
        expected = lambda pp: formulas.zb1p_idle(pp, times["F"], times["B"], times["W"])  # noqa: E731
        for name, pp, m, _, ordering in step.configurations():
            if name == "zb1p" and ordering == "batched":
                idle = ideal_idle(step.replay(name, pp, m, ordering)[0], times)
                checked += 1
                problems += [f"zb1p pp={pp} m={m} {times}: rank {r} idles {i}, (p-1)(F+B-W) = {expected(pp)}"
                             for r, i in enumerate(idle) if i != expected(pp)]
        control_caught &= ideal_idle(step.replay("1f1b", 4, 8, "batched")[0], times) != [expected(4)] * 4
    return dict(zb1p_bubble_configurations=checked, zb1p_bubble_problems=problems[:50],
                one_f_one_b_bubble_caught=control_caught)

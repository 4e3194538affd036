"""Design challenges that tests/lab.py grades: each states a target; the lab's measures decide.

    python tests/lab.py MY.csv --pp 4 --microbatches 8 --challenge stage0-two

Each grader takes (plan, pp, m, idle, peaks, lists, times): the list, the shape, the ideal idle per rank
at the lab's F:B:W, the peak stored microbatches per rank, step 08's action_lists module and the times
(f, b, w); it returns None when the target is met, else one line saying why not.
"""


def shape(pp, m, want_pp, want_m):
    """Why the list's shape is not the challenge's, or None."""
    return None if (pp, m) == (want_pp, want_m) else f"the challenge is for --pp {want_pp} --microbatches {want_m}"


def stage0_two(plan, pp, m, idle, peaks, lists, times):
    """p 4, m 8: a schedule that stores at most 2 microbatches on the rank of stage 0 (1F1B stores 4)."""
    rank = lists.placement(plan)[0]
    return shape(pp, m, 4, 8) or (None if peaks[rank] <= 2 else
                                  f"rank {rank} (stage 0) stores {peaks[rank]} microbatches, more than 2")


def beat_1f1b(plan, pp, m, idle, peaks, lists, times):
    """Any p and m >= p, one stage per rank: idle less than 1F1B's (p-1)(F+B+W) on every rank, at most
    1F1B's min(p-s, m) microbatches stored on stage s."""
    f, b, w = times
    if any(len(lists.stages_of(plan, r)) != 1 for r in range(pp)):
        return "the challenge is for one stage per rank"
    over = [r for r in range(pp) if idle[r] >= (pp - 1) * (f + b + w)]
    heavy = [s for s in range(pp) if peaks[lists.placement(plan)[s]] > min(pp - s, m)]
    if over:
        return f"ranks {over} idle at least 1F1B's (p-1)(F+B+W) = {float((pp - 1) * (f + b + w)):g}"
    return f"stages {heavy} store more than 1F1B's min(p-s, m)" if heavy else None


def interleaved_m6(plan, pp, m, idle, peaks, lists, times):
    """p 4, m 6 (not a multiple of p) on the interleaved placement (rank r holds stages r and r+4): every rank
    idles at most (p-1)(F+B+W), F, B and W the passes of one chunk (half a rank's layers): interleaved 1F1B's
    idle, which Megatron-LM's schedule reaches only for m a multiple of p."""
    f, b, w = times
    if shape(pp, m, 4, 6):
        return shape(pp, m, 4, 6)
    if any(lists.stages_of(plan, r) != [r, r + 4] for r in range(pp)):
        return "the challenge is for the interleaved placement: rank r holds stages r and r+4"
    bound = (pp - 1) * (f + b + w)
    over = [r for r in range(pp) if idle[r] > bound]
    return f"ranks {over} idle more than (p-1)(F+B+W) = {float(bound):g}" if over else None


CHALLENGES = {"stage0-two": stage0_two, "beat-1f1b": beat_1f1b, "interleaved-m6": interleaved_m6}

"""The checks of one rank's log in a replay (tests/replay.py): the order of its forwards, backwards and W's,
the warm-up and the peak, and (from step 04) the deallocation of every sent output."""
from ideal import is_split


def check_weight_order(compute):
    """Step 08: the W's run in the order of their split B's (the store is a FIFO), each after its own B,
    and none is left waiting at the end."""
    split = [e[1] for e in compute if is_split(e)]
    weights = [e[1] for e in compute if e[0] == "W"]
    if weights != split:
        return [f"W's {weights} are not the split B's {split} in the same order"]
    position = {(e[0], e[1]): i for i, e in enumerate(compute)}
    return [f"W of {key} before its B" for key in weights if position["W", key] < position["B", key]]


def check_backward_order(log):
    """Each model chunk's backwards run in microbatch order, as its forwards do (the gradients of a chunk come
    back in the order its activations went out)."""
    problems = []
    for chunk in sorted({e[1][0] for e in log if e[0] == "B"}):
        order = [e[1][1] for e in log if e[0] == "B" and e[1][0] == chunk]
        if order != sorted(order):
            shown = ", ".join(map(str, order))
            problems.append(f"chunk {chunk}'s backwards ran for microbatches {shown}, not in microbatch order")
    return problems


def check_deallocated(log):
    """From step 04: after its forward, each sent output (every chunk's but the model's last, whose output is
    the loss) is handed to the stage's deallocate_output (stash.deallocate) once, or --deallocate frees nothing."""
    layout = next((e for e in log if e[0] == "layout"), None)
    if layout is None or not layout[2]:
        return []
    sent = [e[1] for e in log if e[0] == "F" and not layout[1][e[1][0]]]
    freed = [e[1] for e in log if e[0] == "D"]
    missing = [key for key in sent if key not in freed]
    if missing:
        return [f"{len(missing)} sent outputs were never deallocated, first (chunk, microbatch) {missing[0]}: "
                f"--deallocate frees nothing (call stash.deallocate(mb) once the output is sent)"]
    twice = sorted({key for key in freed if freed.count(key) > 1})
    return [f"the output of (chunk, microbatch) {twice[0]} deallocated twice"] if twice else []


def check_compute_order(log, expected_count, expected_warmup, expected_peak):
    """Problems in one rank's sequence of forwards, backwards and (step 08) weight-gradient passes."""
    compute = [e for e in log if e[0] in ("F", "B", "W")]
    forwards = [e[1] for e in compute if e[0] == "F"]
    backwards = [e[1] for e in compute if e[0] == "B"]
    problems = check_weight_order(compute)
    if not (len(forwards) == len(set(forwards)) == len(backwards) == len(set(backwards)) == expected_count
            and set(forwards) == set(backwards)):
        problems.append(f"forwards {forwards} and backwards {backwards} are not each microbatch once")
    done, in_flight, peak = set(), 0, 0
    for kind, *rest in compute:
        if kind == "F":
            done.add(rest[0])
            in_flight += 1
        elif kind == "B" and rest[0] not in done:
            problems.append(f"backward of {rest[0]} before its forward")
        if kind == "W" or kind == "B" and len(rest) == 1:  # a microbatch holds activations until its last pass
            in_flight -= 1
        peak = max(peak, in_flight)
    # The warm-up forwards, then the steady state's first forward, come before the first backward.
    before_first_backward = next((i for i, e in enumerate(compute) if e[0] == "B"), len(compute))
    if before_first_backward != min(expected_warmup + 1, expected_count):
        problems.append(f"{before_first_backward} forwards before the first backward, expected warm-up "
                        f"{expected_warmup} + 1 (at most {expected_count})")
    if peak != expected_peak:
        problems.append(f"peak {peak} microbatches in flight, expected {expected_peak}")
    return problems

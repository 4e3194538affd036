"""Negative controls for tests/replay.py: broken variants of a step's own schedule that the replay must catch.

Every rank posting its sends first, one at a time (1F1B), must deadlock. Two sends
from one rank to its neighbour posted in swapped order, the first activation and the
first gradient a rank sends to its one neighbour swapped (pp 2, interleaved), and one
backward run for the wrong microbatch must each be caught by the matching or by what
the fake stages consumed. Every rank posting each receive before the send ahead of it,
in an order of its own instead of the one all ranks share (interleaved), must deadlock.
A rank's backwards in reverse microbatch order must fail check_backward_order, and (from step 04) its
outputs never deallocated check_deallocated. Step 08's zb1p: two W's swapped, a W before its B and the last W left in the store must
each fail check_weight_order.
"""
from replay import (ACTIVATION, GRADIENT, FakeDist, check_backward_order, check_consumed, check_deallocated,
                    check_weight_order, match)


def swap_first_two_sends(stream):
    """A broken rank for a negative control: its first two posted groups that send swap places."""
    first, second = [i for i, group in enumerate(stream) if any(op.is_send for op in group)][:2]
    stream[first], stream[second] = stream[second], stream[first]


def swap_activation_and_gradient(stream):
    """A broken rank for a negative control: its first posted group that sends an activation and its first
    that sends a gradient swap places."""
    def first(kind):
        return next(i for i, group in enumerate(stream) if any(op.is_send and op.tensor[0] == kind for op in group))
    a, g = first(ACTIVATION), first(GRADIENT)
    stream[a], stream[g] = stream[g], stream[a]


def post_receives_first(stream):
    """A broken rank for a negative control: each receive posted just before the send that preceded it."""
    for i in range(1, len(stream)):
        if all(op.is_send for op in stream[i - 1]) and not any(op.is_send for op in stream[i]):
            stream[i - 1], stream[i] = stream[i], stream[i - 1]


def negative_controls(step):
    """Each broken variant must be caught; returns {control: caught}."""
    name = next(n for n in ("interleaved", "1f1b", "afab") if n in step.schedules)  # step 03 has AFAB alone
    virtual, ordering = (2 if name == "interleaved" else 1), step.orderings[0]

    def caught(pp, logs, dist):
        return bool(match(dist.streams, pp) or [p for log in logs for p in check_consumed(log)])

    def deadlocks(pp, dist):
        return any("deadlock" in p for p in match(dist.streams, pp))

    controls = {}
    if "1f1b" in step.schedules:  # (AFAB's sends never wait for a neighbour's send: it cannot deadlock so)
        controls["send_first_deadlocks"] = deadlocks(4, step.replay("1f1b", 4, 8, "batched",
                                                                    dist=FakeDist(send_first=True))[1])
    logs, dist = step.replay(name, 4, 8, ordering, virtual)
    swap_first_two_sends(dist.streams[1])  # rank 1 sends microbatch 1 before microbatch 0
    controls["swapped_sends_caught"] = caught(4, logs, dist)
    if name == "interleaved":  # pp 2: an activation and a gradient between the same two ranks
        logs, dist = step.replay(name, 2, 4, "batched", virtual)
        swap_activation_and_gradient(dist.streams[1])
        controls["activation_gradient_swap_caught"] = caught(2, logs, dist)
        logs, dist = step.replay(name, 4, 8, "batched", virtual)
        for stream in dist.streams.values():
            post_receives_first(stream)
        controls["receives_first_deadlocks"] = deadlocks(4, dist)
    logs, dist = step.replay(name, 4, 8, ordering, virtual, wrong_backward_on=1)
    controls["wrong_backward_caught"] = caught(4, logs, dist)
    controls.update(log_controls(step.replay(name, 4, 8, ordering, virtual)[0][1], step.deallocates))
    if "zb1p" in step.schedules:
        controls.update(weight_order_controls(step))
    return controls


def log_controls(log, deallocates):
    """Rank 1's log of a passing replay, with its backwards in reverse order and (from step 04) with its
    deallocations left out: check_backward_order and check_deallocated must catch each."""
    backwards = [i for i, e in enumerate(log) if e[0] == "B"]
    reversed_log = list(log)
    for i, j in zip(backwards, reversed(backwards)):
        reversed_log[i] = log[j]
    controls = dict(reversed_backwards_caught=bool(check_backward_order(reversed_log)))
    if deallocates:
        controls["kept_outputs_caught"] = bool(check_deallocated([e for e in log if e[0] != "D"]))
    return controls


def weight_order_controls(step):
    """Step 08: rank 1's replayed zb1p passes with two W's swapped, with a W moved before its B, and with
    the last W left out (the store not empty at the end): check_weight_order must catch each."""
    passes = [e for e in step.replay("zb1p", 4, 8, "batched")[0][1] if e[0] in ("F", "B", "W")]
    w = [i for i, e in enumerate(passes) if e[0] == "W"]
    swapped = list(passes)
    swapped[w[0]], swapped[w[1]] = passes[w[1]], passes[w[0]]
    early = list(passes)
    early.insert(0, early.pop(w[0]))
    return dict(swapped_weights_caught=bool(check_weight_order(swapped)),
                weight_before_its_b_caught=bool(check_weight_order(early)),
                weight_left_in_store_caught=bool(check_weight_order(passes[:w[-1]])))

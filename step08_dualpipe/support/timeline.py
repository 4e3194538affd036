"""Record what each rank did and when, and turn it into a trace and a bubble measurement.

Each rank appends one event per forward, backward, recompute, send and receive
(a receive's length is mostly time spent waiting for the peer), and from step 06
on per tensor-parallel collective (nested in the forward or backward that made
it; in step 08 also per all-to-all of the experts, whose share the bubble report
prints): its kind, rank, step, microbatch (None for messages, which carry no label),
model chunk, what travelled and the bytes this rank sent, where they apply, and
its start and end in seconds of wall-clock time, a clock that all processes of
a machine share (and that NTP keeps close across machines), so events of
different ranks lie on one time axis. A step starts at its earliest event on
any rank.

On CUDA a span records a pair of CUDA events instead of reading the clock, so
timing adds no synchronisation inside the step: the GPU stamps the events as it
reaches them, and end_step turns them into wall-clock times after the step,
from one synchronize at the step's start that pins GPU time to the wall clock.

The bubble of a rank is the fraction of the step's pipeline window in which it
did no compute: 1 - (forward + backward (or its B and W) + recompute time) / window, where the window runs
from the step's start to the end of the last compute event on any rank.

A Timeline made with enabled=False records nothing and costs nothing. The engine
records into this process's Timeline (install, span) without being handed one.
"""
import json
import os
import time
from collections import Counter
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

from support import outputs

COMPUTE = ("forward", "backward", "recompute", "B", "W")  # B and W: a backward split in two (step 08)
ALL_TO_ALL = "all-to-all"  # step 08's experts: dispatch, combine and their counts, nested in F, B or W
WRITER = "pipeline parallelism from scratch, timeline.py"  # a trace's first key says the course wrote it
TRACE_MARK = json.dumps({"otherData": {"written_by": WRITER}})[:-2].encode()  # how such a trace begins (config.py)


class Timeline:
    """One rank's record of what it did and when: a list of events, one per span. start_step and end_step
    bracket an optimizer step; span(kind, microbatch, ...) records its body as one event. Each rank
    (process) keeps one, made by train.py. Made with enabled=False, or switched off, it records nothing
    and a span costs nothing."""

    def __init__(self, rank: int = 0, device=None, enabled: bool = True):
        self.rank, self.enabled = rank, enabled
        self.on_cuda = device is not None and torch.device(device).type == "cuda"
        self.events, self.step = [], 0
        self.pending = []  # CUDA: (event, start stamp, end stamp) until end_step reads them

    def start_step(self, step: int):
        """Events from now on belong to optimizer step `step`."""
        self.step = step
        if self.enabled and self.on_cuda:  # GPU time of `origin` is the wall-clock time `origin_s`
            torch.cuda.synchronize()
            self.origin_s, self.origin = time.time(), torch.cuda.Event(enable_timing=True)
            self.origin.record()

    def span(self, kind: str, microbatch=None, **info):
        """Record the body as one event; info (chunk, what) goes into the event as it is."""
        return self._record(kind, microbatch, info) if self.enabled else nullcontext()

    @contextmanager
    def _record(self, kind, microbatch, info):
        event = dict(kind=kind, microbatch=microbatch, step=self.step, rank=self.rank, **info)
        if self.on_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.pending.append((event, start, end))
        else:
            event["start"] = time.time()
            yield
            event["end"] = time.time()
            self.events.append(event)

    def end_step(self):
        """CUDA: read this step's stamps, once the GPU has passed them (one synchronize, after the step)."""
        if self.pending:
            torch.cuda.synchronize()
        for event, start, end in self.pending:
            event["start"] = self.origin_s + self.origin.elapsed_time(start) / 1e3
            event["end"] = self.origin_s + self.origin.elapsed_time(end) / 1e3
            self.events.append(event)
        self.pending.clear()


# This process's recorder. Each rank is its own process, so one Timeline serves the whole rank, read where
# events happen, as torch.profiler.record_function reads the profiler that is running: train.build installs
# the run's, and the engine (the verbs and the stages' compute, from step 03 the gradient reductions, from
# step 06 TP's collectives) records through span(). Until one is installed it is off: a span costs nothing.
# A test installs its own.
_recorder = Timeline(enabled=False)


def install(timeline: Timeline) -> Timeline:
    """Make `timeline` this process's recorder; returns the one it replaces."""
    global _recorder
    previous, _recorder = _recorder, timeline
    return previous


def recorder() -> Timeline:
    """This process's recorder."""
    return _recorder


def span(kind: str, microbatch=None, **info):
    """Timeline.span on this process's recorder: the body as one event, or nothing while it is off."""
    return _recorder.span(kind, microbatch, **info)


def gather_events(timeline: Timeline):
    """Every rank's events, on every rank (a collective: all ranks must call it)."""
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, timeline.events)
    return [e for events in per_rank for e in events]


def step_start(events, step: int) -> float:
    """When a step began: its earliest event on any rank."""
    return min(e["start"] for e in events if e["step"] == step)


def busy_fractions(events, world_size: int, steps, kinds=COMPUTE):
    """Mean over `steps` of each rank's time in `kinds` (compute) / pipeline window."""
    fractions = [0.0] * world_size
    for step in steps:
        window = max(e["end"] for e in events if e["step"] == step and e["kind"] in COMPUTE) - \
            step_start(events, step)
        step_events = [e for e in events if e["step"] == step and e["kind"] in kinds]
        for r in range(world_size):
            busy = sum(e["end"] - e["start"] for e in step_events if e["rank"] == r)
            fractions[r] += busy / window / len(steps)
    return fractions


def mean_durations(events, kinds):
    """The mean duration of one pass of each kind (step 08's bubble formula takes F, B and W from the run): a
    pass is one event, or, with the experts' layers as nodes (overlap.py), its nodes' events summed."""
    def passes(kind):
        return max(1, len({(e["step"], e["rank"], e.get("chunk"), e["microbatch"]) for e in events
                           if e["kind"] == kind}))

    return [sum(e["end"] - e["start"] for e in events if e["kind"] == kind) / passes(kind) for kind in kinds]


def measured_steps(events):
    """Steps used for the bubble: all that were recorded (train.py does not record the first step,
    which pays one-off start-up costs, unless it is the only one)."""
    return sorted({e["step"] for e in events})


def bubble_report(events, world_size: int, formula_text: str, formula_value: float, describe_rank):
    """Lines that put each rank's measured bubble beside the schedule's formula."""
    steps = measured_steps(events)
    busy = busy_fractions(events, world_size, steps)
    lines = [f"bubble, measured over steps {steps[0]}..{steps[-1]} "
             f"vs formula {formula_text} = {formula_value:.3f}"]
    a2a = busy_fractions(events, world_size, steps, (ALL_TO_ALL,)) if any(e["kind"] == ALL_TO_ALL for e in events) \
        else None  # inside the busy time: a layer's compute waits for its all-to-all
    for r, b in enumerate(busy):
        lines.append(f"  rank {r} ({describe_rank(r)}): busy {b:.3f}  bubble {1 - b:.3f}" +
                     (f"  of which all-to-all {a2a[r]:.3f}" if a2a else ""))
    return lines


MESSAGES = ("send", "recv", "sendrecv")  # kinds of an exchange's box; its `what` lists what travelled


def message_numbers(step_events) -> dict:
    """{id(event): [k, ...]} for each message box of one step: for every part of its `what` ('send activation',
    'recv gradient'), that part's place among the rank's parts of the same name in the step, from 0, as the
    timeout line counts. Messages carry no label; in GPipe, afab and 1f1b they go in microbatch order, so
    the k-th activation or gradient a rank sends or receives in a step is microbatch k's."""
    counts, numbers = Counter(), {}
    for e in sorted(step_events, key=lambda e: e["start"]):
        if e["kind"] in MESSAGES and e.get("what"):
            parts = [(e["rank"], part) for part in e["what"].split(" + ")]
            numbers[id(e)] = [counts[part] for part in parts]
            counts.update(parts)
    return numbers


def box_name(event, numbers=None, chunks=True) -> str:
    """What a trace box says: forward 3, backward 3 chunk 1 (chunks=False leaves the chunk out, in a run
    with one), recv activation 2, send activation 3 + recv gradient 1 (numbers: message_numbers')."""
    if numbers is not None:
        return " + ".join(f"{part} {k}" for part, k in zip(event["what"].split(" + "), numbers))
    parts = [event.get("what") or event["kind"], event["microbatch"]]
    if chunks and event.get("chunk") is not None:
        parts.append(f"chunk {event['chunk']}")
    return " ".join(str(p) for p in parts if p is not None)


def write_chrome_trace(events, path: str, describe_rank):
    """One row per rank (thread rank + 1 of process 1); opens in Perfetto (ui.perfetto.dev) or chrome://tracing.

    Within a step every rank's boxes lie on one wall-clock axis. The recorded steps are laid end to end:
    each starts where the previous one's last box ended, so what happens between steps (the optimizer, the
    barrier that starts the next one) is left out, and the trace's time is not wall-clock time across steps.
    A compute box names its chunk only where the run has more than one.
    """
    trace, offset = [], 0.0
    chunks = len({e.get("chunk") for e in events} - {None}) > 1
    for step in sorted({e["step"] for e in events}):
        step_events = [e for e in events if e["step"] == step]
        origin, numbers = step_start(events, step), message_numbers(step_events)
        for e in step_events:
            trace.append(dict(name=box_name(e, numbers.get(id(e)), chunks), cat=e["kind"], ph="X", pid=1,
                              tid=e["rank"] + 1, ts=(offset + e["start"] - origin) * 1e6,
                              dur=(e["end"] - e["start"]) * 1e6,
                              args=dict(step=step, rank=e["rank"], microbatch=e["microbatch"],
                                        chunk=e.get("chunk"), what=e.get("what"), bytes=e.get("bytes"))))
        offset += max(e["end"] for e in step_events) - origin
    ranks = sorted({e["rank"] for e in events})
    trace.append(dict(name="process_name", ph="M", pid=1, args=dict(name=f"{len(ranks)} ranks, steps end to end")))
    trace += [dict(name="thread_name", ph="M", pid=1, tid=r + 1, args=dict(name=f"rank {r} ({describe_rank(r)})"))
              for r in ranks]
    with outputs.open_temporary(path) as f:  # support/outputs.py: the rule of every file the course writes
        json.dump({"otherData": {"written_by": WRITER}, "traceEvents": trace, "displayTimeUnit": "ms"}, f)
    os.replace(f.name, path)  # whole or not at all: a killed run leaves the path as it was

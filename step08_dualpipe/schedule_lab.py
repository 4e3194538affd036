"""Schedules as data: any schedule, written as a list of actions per rank, run by one runtime.

Read this after dualpipe.py and action_lists.py: a side road, like pipedream.py. The course's schedules are
functions that a learner reads; here a schedule is data that a learner writes, a list of actions in PyTorch's
notation (action_lists.py reads and checks it: 0F1, 2B3, 1I0, 0W0).

    torchrun --nproc_per_node 4 step08_dualpipe/train.py --schedule-file my.csv --microbatches 8
    torchrun --nproc_per_node 4 step08_dualpipe/train.py --schedule zb1p --steps 1 --dump-schedule zb1p.csv

Lowering. A list names only computes. Before it runs, one simulation inserts every transfer by the
course's rule (schedule.interleaved_actions): the ranks run their computes in lockstep rounds, each
as soon as its input has been made; a send goes right after the compute that made it, and the
receive that takes it goes at once to the end of the receiver's list: posted about when its sender
computes, long before it is needed. A list whose computes cannot all run this way deadlocks on any
runtime: the simulation names where each rank waits. A stage's neighbour on the same rank (the V's
turn) gets its input with no message.
"""
import torch.distributed as dist

from action_lists import (Action, ScheduleError, layout_problems, order_problems, placement, read_schedule,
                          stages_of, write_schedule)
from schedule import Stash, peaks, report_lines, stage_class, train_steps  # noqa: F401 (the family's names)
from support.timeline import gather_events
from torch_schedules import GENERATORS, idle_formula, peak_formula
from weight_grad_store import WeightGradStore


def needs(action, last: int):
    """What `action` waits for: the previous stage's activation (F), the next stage's input gradient (B, I),
    its own I (W, on the same rank); None where the model begins for it (the tokens, or the loss)."""
    if action.kind == "F":
        return ("F", action.stage - 1, action.mb) if action.stage > 0 else None
    if action.kind == "W":
        return ("I", action.stage, action.mb)
    return ("B", action.stage + 1, action.mb) if action.stage < last else None


def makes(action) -> list:
    """What `action` makes that another action may wait for: an activation (F), an input gradient (B, I)."""
    return {"F": [("F",)], "B": [("B",)], "I": [("B",), ("I",)], "W": []}[action.kind]


def lower(plan) -> list:
    """Every rank's actions with its transfers: ("compute", Action), ("recv F" | "recv B", stage, mb), the
    receive of the input of that compute. Raises ScheduleError naming where each rank waits if the computes
    cannot all run (a deadlock on any runtime)."""
    where, last = placement(plan), max(placement(plan))
    todo, lowered = [list(reversed(actions)) for actions in plan], [[] for _ in plan]
    made = set()  # (kind, stage, mb) of every output made so far
    while any(todo):
        ran = False
        for rank in range(len(plan)):
            if not todo[rank] or needs(todo[rank][-1], last) not in made | {None}:
                continue  # this rank idles this round
            action = todo[rank].pop()
            lowered[rank].append(("compute", action))
            ran = True
            made.update((kind, action.stage, action.mb) for kind, in makes(action))
            to_stage = action.stage + 1 if action.kind == "F" else action.stage - 1
            if action.kind != "W" and 0 <= to_stage <= last and where[to_stage] != rank:
                lowered[where[to_stage]].append(("recv " + action.kind.replace("I", "B"), to_stage, action.mb))
        if not ran:
            waits = [f"rank {rank} waits at {todo[rank][-1]}" for rank in range(len(plan)) if todo[rank]]
            raise ScheduleError("deadlock: " + "; ".join(waits) + " (each for an input no rank will make)")
    return lowered


def peak_stored(actions) -> int:
    """The most microbatches a rank's actions hold at once: from each F until its B, or until its W."""
    held = peak = 0
    for action in actions:
        held += {"F": 1, "B": -1, "I": 0, "W": -1}[action.kind]
        peak = max(peak, held)
    return peak


def costs(times) -> dict:
    """Each kind's duration from times (f, b, w): a full B is an I and a W."""
    f, b, w = times
    return {"F": f, "I": b, "W": w, "B": b + w}


def ideal_idle(plan, times=(1, 1, 1)) -> list:
    """Each rank's idle time when every compute starts as soon as its rank is free and its input is made,
    messages taking no time: F, I and W take times (f, b, w), a full B takes b + w."""
    cost, last = costs(times), max(placement(plan))
    ends, clock, done = {None: 0}, [0] * len(plan), [0] * len(plan)  # ends: (kind, stage, mb) -> when made
    progress = True
    while progress:
        progress = False
        for rank, actions in enumerate(plan):
            while done[rank] < len(actions) and needs(actions[done[rank]], last) in ends:
                action = actions[done[rank]]
                clock[rank] = max(clock[rank], ends[needs(action, last)]) + cost[action.kind]
                ends.update({(kind, action.stage, action.mb): clock[rank] for kind, in makes(action)})
                done[rank] += 1
                progress = True
    if any(done[rank] < len(actions) for rank, actions in enumerate(plan)):
        raise ScheduleError("the list deadlocks: its ideal timeline cannot finish")
    return [max(clock) - sum(cost[a.kind] for a in actions) for actions in plan]


class ListRunner:
    """One rank running its lowered list: the receives posted where the lowering put them, each waited
    for only just before the compute that needs it; each output sent right after the compute that made it."""

    def __init__(self, stash, comm, plan):
        self.stash, self.comm = stash, comm
        self.where, self.last = placement(plan), max(placement(plan))
        self.chunk = {stage: c for c, stage in enumerate(stages_of(plan, comm.stage))}
        self.arriving = {}  # (direction, stage, mb) -> (wait, buffer), or (None, tensor) from this rank

    def rank_at(self, position: int) -> int:
        """The global rank at pipeline position `position` of this rank's pipeline (the list's row). A pipeline's
        ranks lie dp x tp apart (process_groups.grid_rank): this rank's two ring neighbours give that stride."""
        comm, pp = self.comm, self.comm.num_stages
        if pp == 2:  # the other position is both neighbours
            return comm.next_rank
        end = comm.stage in (0, pp - 1)  # its ring neighbours: one next to it, one at the pipeline's far end
        stride = (comm.prev_rank - comm.next_rank) // (pp - 2) if end else (comm.next_rank - comm.prev_rank) // 2
        mine = comm.prev_rank + stride if comm.stage == pp - 1 else comm.next_rank - stride
        return mine + (position - comm.stage) * stride

    def receive(self, direction: str, stage: int, mb: int):
        """Post the receive of stage's input: an activation from stage-1, or a gradient from stage+1."""
        peer = self.rank_at(self.where[stage - 1 if direction == "F" else stage + 1])
        buffer = self.comm.queue_recv(peer, "activation" if direction == "F" else "gradient")
        self.arriving[direction, stage, mb] = (self.comm.commit(wait=False), buffer)

    def take(self, direction: str, stage: int, mb: int):
        """The input of a compute, waited for now; None where the model begins for it (tokens, or the loss)."""
        if (direction == "F" and stage == 0) or (direction == "B" and stage == self.last):
            return None
        wait, tensor = self.arriving.pop((direction, stage, mb))
        if wait:
            wait()
        return tensor

    def hand_on(self, direction: str, stage: int, mb: int, tensor):
        """Send a compute's output to the stage that needs it next, or keep it if that stage is on this rank."""
        to_stage = stage + 1 if direction == "F" else stage - 1
        if not 0 <= to_stage <= self.last:
            return
        if self.where[to_stage] == self.comm.stage:
            self.arriving[direction, to_stage, mb] = (None, tensor.detach())
        else:
            what = "activation" if direction == "F" else "gradient"
            self.comm.queue_send(tensor, self.rank_at(self.where[to_stage]), what)
            self.comm.commit()

    def compute(self, action: Action):
        """Run one action on this rank's chunk of its stage."""
        chunk, mb = self.chunk[action.stage], action.mb
        if action.kind == "F":
            out = self.stash.forward(mb, self.take("F", action.stage, mb), chunk)
            self.hand_on("F", action.stage, mb, out)
            self.stash.deallocate(mb, chunk)
        elif action.kind == "W":
            bring_to_front((chunk, mb))
            self.stash.backward_weights(mb, chunk)
        else:
            input_grad = self.stash.backward(mb, self.take("B", action.stage, mb), chunk, split=action.kind == "I")
            if input_grad is not None:
                self.hand_on("B", action.stage, mb, input_grad)


def bring_to_front(key):
    """Let the W of key run next: the store keeps W's in the order of their I's, a list may run them in
    another order across chunks (PyTorch's ZB-V does)."""
    queue = WeightGradStore.queue
    entry = next(item for item in queue if item[0] == key)
    queue.remove(entry)
    queue.appendleft(entry)


def run_plan(stages, comm, microbatches, plan):
    """One step of `plan` on this rank; returns the rank's share of the loss."""
    split = any(action.kind == "I" for actions in plan for action in actions)  # splittable forwards, as zb1p's
    runner = ListRunner(Stash(stages, comm, microbatches, split=split), comm, plan)
    for step in lower(plan)[comm.stage]:
        if step[0] == "compute":
            runner.compute(step[1])
        else:
            runner.receive(step[0][-1], *step[1:])
    assert not WeightGradStore.queue, "every W of the step has run"
    return runner.stash.loss


def events_to_plan(events, chunks_of) -> list:
    """The computes a run's timeline recorded in its last step, as [[Action]] per rank (rank = stage: --dp 1
    --tp 1); chunks_of(rank) gives the global stage of each of the rank's chunks (config.model_chunks)."""
    kinds = {"forward": "F", "backward": "B", "B": "I", "W": "W"}
    last_step = max(e["step"] for e in events)
    plan = [[] for _ in range(1 + max(e["rank"] for e in events))]
    for e in sorted(events, key=lambda e: e["start"]):  # one rank's spans never overlap: start order is run order
        if e["step"] == last_step and e["kind"] in kinds:
            plan[e["rank"]].append(Action(chunks_of(e["rank"])[e.get("chunk") or 0], kinds[e["kind"]],
                                          e["microbatch"]))
    return plan


# The family's interface (config.family): --schedule-file runs as --schedule file; zbv and looped-bfs are
# PyTorch's, as lists (torch_schedules.py).
SCHEDULES = {"file": None, **{name: None for name in GENERATORS}}  # each runs the flags' list (schedule_of)


def schedule_of(args):
    """The function that runs one step of the list of --schedule-file."""
    return lambda stages, comm, microbatches: run_plan(stages, comm, microbatches, args.plan)


def model_chunks(args, stage: int):
    """(the stages rank `stage`'s actions name, how many stages the list has)."""
    return stages_of(args.plan, stage), len(placement(args.plan))


def bubble_formula(args, times=None):
    """(text, value): the list's ideal idle fraction (ideal_idle) on its worst rank, named by torch_schedules'
    formula where one holds; at the run's mean F, B (the I pass), W (equal if None); a full B is B + W."""
    f, b, w = times or (1, 1, 1)
    idle = ideal_idle(args.plan, (f, b, w))
    worst = max(range(len(idle)), key=idle.__getitem__)
    total = idle[worst] + sum(costs((f, b, w))[a.kind] for a in args.plan[worst])
    ratios = f", F:B:W = 1:{b / f:.2f}:{w / f:.2f} measured" if times else ", F:B:W = 1:1:1"
    formula = idle_formula(args.schedule, args.pp, args.microbatches, f, b, w)
    if formula:  # torch's schedule, where its closed form holds: the same number, named
        text = f"idle {formula[0]} beside 2m(F+B+W)" + (ratios if times else "")  # Looped BFS: no W to measure
        return text, formula[1] / (formula[1] + total - idle[worst])
    return f"ideal timeline of the list (worst rank {worst}){ratios}, full B = B+W", idle[worst] / total


def peak_stored_microbatches(args, stage: int):
    """(text, value): the most (stage, microbatch) pairs the rank's actions hold at once (peak_stored)."""
    if args.schedule in GENERATORS and peak_formula(args.schedule, args.pp, args.microbatches):
        return peak_formula(args.schedule, args.pp, args.microbatches)
    return "the list's peak (F until B or W)", peak_stored(args.plan[stage])


def add_flags(group):
    """The lab's flags, in the pipeline group of train.py's --help (config.py)."""
    group.add_argument("--schedule-file", default=None,
                       help="run this list of actions (PyTorch's compute-only CSV, one row per rank: 0F1, 1I0, 0W0, "
                       "2B3; schedule_lab.py)")
    group.add_argument("--dump-schedule", default=None,
                       help="after the run, write the actions its last step ran as such a CSV (--dp 1 --tp 1)")


def check_flags(args, cuda_available: bool):
    """The lab's rules, refused before any work with a ValueError of one line (config.py): the list is read or
    built (--schedule-file; zbv, looped-bfs), checked against --pp and --microbatches; sets --virtual-stages."""
    if args.dump_schedule and (args.dp > 1 or args.tp > 1):
        raise ValueError(f"--dump-schedule needs --dp 1 --tp 1 (here --dp {args.dp} --tp {args.tp}): "
                         "its rows are the pipeline's ranks")
    if args.dump_schedule and args.schedule in ("pipedream", "pipedream-2bw", "dualpipe"):
        raise ValueError(f"--dump-schedule cannot write --schedule {args.schedule}: PyTorch's format has one "
                         "flushed step, each stage on one rank")
    if (args.schedule == "file") != bool(args.schedule_file):
        raise ValueError(f"--schedule {args.schedule} does not fit --schedule-file {args.schedule_file}: "
                         "a list runs as --schedule file (the default with --schedule-file)")
    if args.schedule in GENERATORS:
        args.plan = [[Action(*a) for a in row] for row in GENERATORS[args.schedule](args.pp, args.microbatches)]
    elif not args.schedule_file:
        return
    else:
        args.plan = read_list(args.schedule_file)
    problems = layout_problems(args.plan, args.pp, args.microbatches) or order_problems(args.plan, args.microbatches)
    if problems:
        more = f" (and {len(problems) - 1} more: python tests/lab.py lists them)" if len(problems) > 1 else ""
        raise ValueError(f"--schedule-file {args.schedule_file}: {problems[0]}{more}")
    lower(args.plan)  # a deadlock is refused here, naming where each rank waits
    args.virtual_stages = len(stages_of(args.plan, 0))
    if args.scatter_gather:
        raise ValueError(f"--scatter-gather does not fit --schedule {args.schedule}: a list's transfers carry whole "
                         "tensors")


def read_list(path: str):
    """--schedule-file's list, or a ValueError of one line."""
    try:
        return read_schedule(path)
    except OSError as err:
        why = {FileNotFoundError: "does not exist", IsADirectoryError: "is a directory: give a file"}.get(type(err))
        raise ValueError(f"--schedule-file {path} " + (why or f"cannot be read: {err.strerror}")) from None
    except ScheduleError as err:
        raise ValueError(f"--schedule-file {path}: {err}") from None


def dump_schedule(run, chunks_of):
    """--dump-schedule: the computes every rank ran in the last step (a collective), written by rank 0.
    chunks_of(args, rank): config.model_chunks."""
    events = gather_events(run.timeline)
    if dist.get_rank() == 0:
        write_schedule(run.args.dump_schedule, events_to_plan(events, lambda rank: chunks_of(run.args, rank)[0]))

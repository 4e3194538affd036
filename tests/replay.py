"""Replay a step's pipeline schedules without a model, and check their order of operations.

    python tests/replay.py STEP_DIR          ->  prints a summary; exit status 1 if anything failed
    python tests/replay.py --json STEP_DIR   ->  prints the whole report as JSON (what the tests read)

The step's own code runs: its ProcessGroupManager, PipelineComm and schedule
functions, for every simulated rank of a pipeline. Two things are fake:

  * torch.distributed's point-to-point calls underneath (FakeDist, installed as
    the `dist` of the step's p2p.py and process_groups.py): posting an operation
    only records it;
  * the stages (FakeStage): a forward or backward records itself and returns a
    tensor that says what it is, (kind, model chunk, microbatch).

Each rank runs its schedule to the end alone. Then the ranks' posted operations
are matched under the model of NCCL this code runs on, exact, not a bound: the
steps pass device_id to init_process_group (distributed.py), so NCCL starts
eagerly, and then a lone isend/irecv runs on the group's one communicator, as a
batch does (PyTorch PR #132900): a rank's transfers are serialised.

  * a rank's operations complete in the order they were posted, as if on one
    stream; the operations of one batch_isend_irecv are one fused group;
  * the k-th send from rank r to rank q meets the k-th receive on q from r;
  * a send and its receive can meet only when both are in the group at the head
    of their rank's stream. No head can move while operations remain: deadlock.

Matching fills every receive with what its send carried. Each fake stage then
checks what it consumed: the forward of microbatch mb on model chunk g must have
received chunk g-1's activation of mb, its backward chunk g+1's gradient of mb.
So a swapped message or a backward of the wrong microbatch is caught, although
no message carries a label.

Negative controls, broken variants of the step's own schedule that the checker
must catch, are in tests/replay_controls.py; the command's report, in tests/replay_report.py. Step 08's zb1p also logs each W: the
W's must follow their split B's in FIFO order, none left over; and its ideal
timeline (tests/ideal.py, exact rational times) must idle (p-1)(F+B-W) on every
rank, which 1F1B's order must fail. Step 08's DualPipe and DualPipeV have checks
of their own (tests/two_way.py), and so do PipeDream's weight versions
(tests/weight_versions.py, step 04 on). The configurations are independent, so
they are replayed on all of the machine's cores.
"""
import os
import sys
from argparse import Namespace
from collections import defaultdict, deque

import torch

import formulas
# The checks of a rank's log; two_way.py and replay_controls.py import them from here
from replay_order import (check_backward_order, check_compute_order, check_deallocated,  # noqa: F401
                          check_weight_order)
from replay_report import describe_exception

MAX_PP, MAX_M, MAX_V = 8, 32, 4
ACTIVATION, GRADIENT, TOKENS = 1.0, 2.0, 3.0


def tag(kind, chunk, mb):
    return torch.tensor([kind, float(chunk), float(mb)])


class Op:
    """One posted send or receive."""

    def __init__(self, is_send, tensor, peer, rank):
        self.is_send, self.peer, self.rank = is_send, peer, rank
        self.tensor = tensor.clone() if is_send else tensor  # a send's content as it was when posted
        self.content = None  # a receive's content, once matched


class Work:
    """What posting an operation returns; waiting for it logs ("wait", op) in the rank's log, so that the
    ideal timeline (ideal.py) knows where the code waits for each receive."""

    def __init__(self, op, log):
        self.op, self.log = op, log

    def wait(self, timeout=None):
        self.log.append(("wait", self.op))
        return True


class FakeDist:
    """What p2p.py and process_groups.py see of torch.distributed during a replay.

    send_first: every batch is posted as single operations, sends first (the deadlocking foil).
    swap_on: on this rank, every batch is posted in reverse order (messages swapped between a pair).
    """

    def __init__(self, send_first=False, swap_on=None):
        self.send_first, self.swap_on = send_first, swap_on
        self.rank, self.streams = 0, defaultdict(list)  # rank -> posted groups, in order
        self.log = []  # the current rank's log: each posted group goes in as ("post", group)

    # process groups
    def get_rank(self):
        return self.rank

    def new_group(self, ranks, timeout=None):
        return tuple(ranks)

    # point-to-point
    def P2POp(self, op, tensor, peer, group=None):  # noqa: N802 (torch's name)
        return Namespace(op=op, tensor=tensor, peer=peer)

    def isend(self, tensor, dst, group=None):
        return self._post([Op(True, tensor, dst, self.rank)])[0]

    def irecv(self, tensor, src, group=None):
        return self._post([Op(False, tensor, src, self.rank)])[0]

    def batch_isend_irecv(self, ops):
        posted = [Op(op.op == self.isend, op.tensor, op.peer, self.rank) for op in ops]
        if self.rank == self.swap_on:
            posted.reverse()
        if self.send_first:
            return [w for op in sorted(posted, key=lambda o: not o.is_send) for w in self._post([op])]
        return self._post(posted)

    def _post(self, group):
        self.streams[self.rank].append(group)
        self.log.append(("post", group))
        return [Work(op, self.log) for op in group]

    def last_receive_into(self, tensor):
        """The latest receive this rank posted into `tensor` (buffers may be reused)."""
        for group in reversed(self.streams[self.rank]):
            for op in reversed(group):
                if not op.is_send and op.tensor is tensor:
                    return op
        return None


def match(streams, n_ranks):
    """Complete the ranks' posted groups as NCCL would; return a list of problems (empty: all completed)."""
    heads = [0] * n_ranks
    unmatched = {r: [list(g) for g in streams[r]] for r in range(n_ranks)}
    sends, recvs = defaultdict(deque), defaultdict(deque)  # (from, to) -> ops in posting order
    group_of = {}
    for r in range(n_ranks):
        for i, group in enumerate(streams[r]):
            for op in group:
                group_of[id(op)] = i
                (sends[r, op.peer] if op.is_send else recvs[op.peer, r]).append(op)
    progress = True
    while progress:
        progress = False
        for r in range(n_ranks):
            while heads[r] < len(streams[r]) and not unmatched[r][heads[r]]:
                heads[r] += 1  # a completed group lets the next one start
                progress = True
            if heads[r] == len(streams[r]):
                continue
            for op in [o for o in unmatched[r][heads[r]] if o.is_send]:
                q = op.peer
                if sends[r, q][0] is not op or not recvs[r, q]:
                    continue  # an older send to q is still waiting, or q posted no receive yet
                recv = recvs[r, q][0]
                if heads[q] < len(streams[q]) and group_of[id(recv)] == heads[q]:
                    recv.content = op.tensor
                    sends[r, q].popleft()
                    recvs[r, q].popleft()
                    unmatched[r][heads[r]].remove(op)
                    unmatched[q][heads[q]].remove(recv)
                    progress = True
    stuck = {r: [("send to" if o.is_send else "recv from", o.peer) for o in unmatched[r][heads[r]]]
             for r in range(n_ranks) if heads[r] < len(streams[r]) and unmatched[r][heads[r]]}
    return [f"deadlock: each rank waits at the head of its stream for {stuck} (operations complete in posting "
            f"order, as on NCCL's streams)"] if stuck else []


class FakeStage:
    """Records its forwards and backwards, checks what it was given, returns tagged tensors."""

    def __init__(self, log, dist, chunk, global_chunk, n_chunks, microbatches, store=None):
        self.log, self.dist, self.chunk, self.g, self.store = log, dist, chunk, global_chunk, store
        self.is_first, self.is_last = global_chunk == 0, global_chunk == n_chunks - 1
        self.recompute, self.microbatches = False, microbatches
        self.grad_scale_func = lambda loss: loss  # step 07: the last stage's seed is grad_scale_func(1) / m

    def _given(self, tensor, expected, what):
        """Remember what a consumed tensor should hold; a received one is judged after matching."""
        received = self.dist.last_receive_into(tensor)
        self.log.append(("expect", what, received if received is not None else tensor, expected))

    def forward(self, mb, x, target):
        self.log.append(("F", (self.chunk, mb)))
        expected = tag(TOKENS, 0, mb) if self.is_first else tag(ACTIVATION, self.g - 1, mb)
        self._given(x, expected, f"forward of chunk {self.g} microbatch {mb}")
        return tag(ACTIVATION, self.g, mb)

    def backward(self, mb, x, out, out_grad, split=False):
        self.log.append(("B", (self.chunk, mb), "split") if split else ("B", (self.chunk, mb)))  # step 08: W later
        if split:  # a W with nothing to compute, filed where the schedule will look for it
            with self.store.split((self.chunk, mb)):
                pass
        if self.is_last:  # the schedule seeds the loss's backward with 1/m
            expected = torch.full_like(out_grad, 1 / self.microbatches)
        else:
            expected = tag(GRADIENT, self.g + 1, mb)
        self._given(out_grad, expected, f"backward of chunk {self.g} microbatch {mb}")
        return tag(GRADIENT, self.g, mb)

    def forward_steps(self, mb, x, target):  # step 08: a pass as a generator, here of no node
        return self.forward(mb, x, target)
        yield

    def backward_steps(self, mb, x, out, out_grad, split=False):
        return self.backward(mb, x, out, out_grad, split)
        yield

    def backward_weights(self, mb):
        self.log.append(("W", (self.chunk, mb)))
        self.store.pop((self.chunk, mb))

    def deallocate_output(self, mb, out):
        """Logged: from step 04 every sent output must be freed (with --deallocate), once."""
        self.log.append(("D", (self.chunk, mb)))

    def overlapped_forward_backward(self, forward, backward):
        """DualPipe's pair (step 08): logged as a marker before its F and its B (each a generator)."""
        self.log.append(("F&B",))
        for steps in (forward(), backward()):
            for _ in steps:
                pass


def check_consumed(log):
    """After matching: every tensor a fake stage consumed held what it expected."""
    problems = []
    for entry in log:
        if entry[0] != "expect":
            continue
        _, what, source, expected = entry
        got = source.content if isinstance(source, Op) else source
        if got is None:
            problems.append(f"{what} consumed a receive that no send matched")
        elif not torch.equal(got, expected):
            problems.append(f"{what} got {got.tolist()}, expected {expected.tolist()}")
    return problems


class Step:
    """A step folder's modules, loaded once, and how to replay its schedules."""

    def __init__(self, step_dir):
        self.folder = os.path.abspath(step_dir)  # where a raising schedule's frames are looked for
        sys.path.insert(0, os.path.abspath(step_dir))
        import config
        import p2p
        import process_groups
        import schedule
        from support import timeline
        self.config, self.p2p, self.groups = config, p2p, process_groups
        self.schedule, self.timeline = schedule, timeline
        # Every flushed schedule by name: schedule.py's, and step 08's DualPipe family's (dualpipe.py); step 03
        # has one schedule and no --schedule flag
        own = getattr(schedule, "SCHEDULES", None) or {"afab": schedule.afab_forward_backward}
        self.schedules = {**own, **getattr(sys.modules.get("dualpipe"), "SCHEDULES", {})}
        self.names = getattr(config, "SCHEDULE_NAMES", list(own))
        self.orderings = getattr(p2p, "ORDERINGS", (None,))  # step 03 posts every exchange one way
        # From step 04 the stash frees each sent output (--deallocate): the replay checks that it is asked to
        self.deallocates = hasattr(getattr(schedule, "Stash", None), "deallocate")
        self.parser = config.build_parser()
        # Step 08: the store of pending W's, which the fake stages fill and empty as real ones do
        self.store = sys.modules["weight_grad_store"].WeightGradStore if "weight_grad_store" in sys.modules else None

    def args(self, name, pp, m, virtual, ordering, extra=()):
        flags = ["--device", "cpu", "--pp", str(pp), "--microbatches", str(m), "--batch-size", str(m),
                 "--layers", str(MAX_PP * MAX_V), *extra]
        flags += ["--schedule", name] if "--schedule" in self.parser._option_string_actions else []
        flags += ["--p2p", ordering] if ordering else []
        if virtual > 1:
            flags += ["--virtual-stages", str(virtual)]
        return self.parser.parse_args(flags)

    def layout(self, name, pp, m, virtual, rank):
        """(global chunks of a rank, chunks in all): the step's own model_chunks (step 08), else interleaved."""
        if hasattr(self.config, "model_chunks"):
            return self.config.model_chunks(self.args(name, pp, m, virtual, "batched"), rank)
        return [c * pp + rank for c in range(virtual)], pp * virtual

    def allowed(self, name, pp, m, virtual, ordering):
        """Whether the step's own rules (its config.check_config) accept this configuration."""
        return self.allowed_args(self.args(name, pp, m, virtual, ordering), pp)

    def allowed_args(self, args, world):
        try:
            self.config.check_config(args, world, False)
            return True
        except self.config.ConfigError:
            return False

    def replay(self, name, pp, m, ordering, virtual=1, dist=None, wrong_backward_on=None, **options):
        """Every rank's log for one configuration, and the fake transport that holds their streams.
        options go to the schedule function (step 08's DualPipe: sequential_pairs)."""
        dist = dist or FakeDist()
        real = self.p2p.dist
        self.p2p.dist = self.groups.dist = dist
        try:
            logs = [self._replay_rank(name, pp, m, ordering, virtual, dist, rank, rank == wrong_backward_on, options)
                    for rank in range(pp)]
        finally:
            self.p2p.dist = self.groups.dist = real
        return logs, dist

    def _replay_rank(self, name, pp, m, ordering, virtual, dist, rank, wrong_backward, options):
        """One rank's schedule, run to the end on the fake transport; returns its log."""
        log = []
        dist.rank, dist.log = rank, log
        pgm = self.groups.ProcessGroupManager(pp, 1, timeout_s=1)
        kwargs = {} if ordering is None else {"ordering": ordering}
        comm = self.p2p.PipelineComm(pgm, (3,), torch.float32, "cpu", **kwargs)  # its timeline: the process's, off
        chunks, n_chunks = self.layout(name, pp, m, virtual, rank)
        stages = [FakeStage(log, dist, c, g, n_chunks, m, self.store) for c, g in enumerate(chunks)]
        log.append(("layout", {c: stage.is_last for c, stage in enumerate(stages)}, self.deallocates))
        if self.store:
            self.store.queue.clear()  # a schedule that failed before leaves its W's behind
        if wrong_backward:
            swap_first_two_backwards(stages)
        microbatches = [(tag(TOKENS, 0, mb), None) for mb in range(m)]
        self.schedules[name](stages, comm, microbatches, **options)
        return log

    def check(self, name, pp, m, ordering, virtual=1):
        label = f"{name} pp={pp} m={m} v={virtual}" + (f" p2p={ordering}" if ordering else "")
        try:
            logs, dist = self.replay(name, pp, m, ordering, virtual)
        except Exception as error:  # noqa: BLE001 (a learner's schedule may raise anything: report, do not crash)
            return [f"{label}: the schedule raised {describe_exception(error, self.folder)}"]
        problems = match(dist.streams, pp)
        for stage, log in enumerate(logs):
            warmup = formulas.warmup(name, pp, stage, m, virtual)
            peak = formulas.peak_stored(name, pp, stage, m, virtual)
            problems += [f"stage {stage}: {p}" for p in check_compute_order(log, m * virtual, warmup, peak)]
            problems += [f"stage {stage}: {p}" for p in check_backward_order(log) + check_deallocated(log)]
            if not problems:
                problems += [f"stage {stage}: {p}" for p in check_consumed(log)]
        return [f"{label}: {p}" for p in problems]

    def configurations(self, allowed=True):
        """All (schedule, pp, m, v, ordering) the step's rules allow (or refuse), up to MAX_PP, MAX_M, MAX_V."""
        for name in self.schedules:
            if name in ("dualpipe", "dualpipev"):
                continue  # step 08's two-way schedules have checks of their own (two_way.py)
            for pp in range(1, MAX_PP + 1):
                for m in range(1, MAX_M + 1):
                    for virtual in range(2, MAX_V + 1) if name == "interleaved" else [1]:
                        for ordering in self.orderings:
                            if self.allowed(name, pp, m, virtual, ordering) == allowed:
                                yield name, pp, m, virtual, ordering


def swap_first_two_backwards(stages):
    """A broken schedule for a negative control: the first two backwards of chunk 0 swap microbatches."""
    stage = stages[0]
    original, calls = stage.backward, []

    def backward(mb, x, out, out_grad, split=False):
        calls.append(mb)
        wrong = {0: 1, 1: 0}.get(mb, mb) if len(calls) <= 2 else mb
        return original(wrong, x, out, out_grad, split)

    stage.backward = backward


if __name__ == "__main__":
    import replay_report  # whose main imports this file as `replay`, the module two_way.py imports: one Op, one FakeDist

    arguments = [a for a in sys.argv[1:] if a != "--json"]
    if len(arguments) != 1 or not os.path.isdir(arguments[0]):
        sys.exit("usage: python tests/replay.py [--json] STEP_DIR (a step folder with a schedule.py)")
    if not os.path.isfile(os.path.join(arguments[0], "schedule.py")):  # steps 01-02: pipeline.py, no engine
        sys.exit(f"{arguments[0]} has no schedule.py to replay (steps 01-02 run pipeline.py on blocking sends): "
                 f"its pipeline is checked by runs against the single device: "
                 f"pytest tests/test_equivalence.py -k {os.path.basename(os.path.normpath(arguments[0]))}")
    sys.exit(replay_report.main(arguments[0], as_json="--json" in sys.argv[1:]))

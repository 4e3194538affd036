"""Replay a step's pipeline schedules without a model, and check their order of operations.

    python tests/replay.py STEP_DIR   ->  prints a JSON report

The step's own schedule functions run against a fake stage (forward/backward
only record themselves) and its own PipelineComm, whose `post` is replaced so
that it records each group of point-to-point operations instead of sending.
Then, for every allowed configuration:

  * every microbatch (and model chunk) runs forward once and backward once, forward first;
  * the number of forwards before the first backward is the warm-up count plus one;
  * gradients are synchronised exactly once, right after the rank's last backward;
  * the peak number of microbatches in flight is the schedule's memory formula;
  * the ranks' operation groups, executed as rendezvous (a send completes only when the
    peer's matching receive is posted, as with large NCCL messages), all complete, and
    every send meets a receive for the same tensor (kind and microbatch): no deadlock.

A schedule that posts both neighbours' sends first must be found to deadlock:
that shows the simulator can fail.
"""
import json
import os
import sys
import time
from types import SimpleNamespace

import torch

MAX_PP, MAX_M, MAX_V = 8, 32, 4


class FakeStage:
    """Records forwards and backwards; returns placeholder tensors."""

    def __init__(self, log, is_first, is_last, chunk=None):
        self.log, self.is_first, self.is_last, self.chunk = log, is_first, is_last, chunk
        self.recompute = False

    def forward(self, mb, x, target):
        self.log.append(("F", mb if self.chunk is None else (self.chunk, mb)))
        return torch.zeros(1)

    def backward(self, mb, x, out, out_grad):
        self.log.append(("B", mb if self.chunk is None else (self.chunk, mb)))
        return torch.zeros(1)

    def deallocate_output(self, mb, out):
        pass


def recording_comm(p2p, pgm, log, send_first=False):
    """The step's PipelineComm, posting into `log` instead of the network."""

    class RecordingComm(p2p.PipelineComm):
        def post(self, ops, labels):
            log.append(("P2P", [(direction, op.peer, what, mb) for op, (direction, what, mb) in zip(ops, labels)]))

        if send_first:  # the broken ordering: every rank sends before it receives, as an even stage does
            def _exchange(self, sends, recvs):
                real, self.pgm = self.pgm, SimpleNamespace(**{**vars(self.pgm), "stage": 0})
                try:
                    super()._exchange(sends, recvs)
                finally:
                    self.pgm = real

    return RecordingComm(pgm, (1,), torch.float32, "cpu", timeline=None)


def p2p_groups(log):
    return [entry[1] for entry in log if entry[0] == "P2P"]


def simulate(groups_per_rank):
    """Run every rank's P2P groups as rendezvous; return a list of problems (empty: all fine)."""
    pos = [0] * len(groups_per_rank)
    pending = [list(g[0]) if g else [] for g in groups_per_rank]
    problems, progress = [], True
    while progress:
        progress = False
        for r, ops in enumerate(pending):
            for op in list(ops):
                direction, peer, what, mb = op
                want = "recv" if direction == "send" else "send"
                match = next((o for o in pending[peer] if o[0] == want and o[1] == r), None)
                if match is None:
                    continue
                if (match[2], match[3]) != (what, mb):
                    problems.append(f"rank {r} {direction} {what} {mb} met rank {peer} {want} {match[2:]}")
                ops.remove(op)
                pending[peer].remove(match)
                progress = True
        for r in range(len(pending)):
            while not pending[r] and pos[r] < len(groups_per_rank[r]):
                pos[r] += 1
                pending[r] = list(groups_per_rank[r][pos[r]]) if pos[r] < len(groups_per_rank[r]) else []
                progress = True
    stuck = {r: ops for r, ops in enumerate(pending) if ops}
    if stuck:
        problems.append(f"deadlock: waiting {stuck}")
    return problems


def check_compute_order(log, expected_count, expected_warmup, expected_peak):
    """Problems in one rank's sequence of forwards, backwards and gradient syncs."""
    compute = [e for e in log if e[0] in ("F", "B", "sync")]
    forwards = [e[1] for e in compute if e[0] == "F"]
    backwards = [e[1] for e in compute if e[0] == "B"]
    problems = []
    if not (len(forwards) == len(set(forwards)) == len(backwards) == len(set(backwards)) == expected_count
            and set(forwards) == set(backwards)):
        problems.append(f"forwards {forwards} and backwards {backwards} are not each microbatch once")
    done, in_flight, peak = set(), 0, 0
    for kind, *rest in compute:
        if kind == "F":
            done.add(rest[0])
            in_flight += 1
        elif kind == "B":
            if rest[0] not in done:
                problems.append(f"backward of {rest[0]} before its forward")
            in_flight -= 1
        peak = max(peak, in_flight)
    # The warm-up forwards, then the steady state's first forward, come before the first backward.
    before_first_backward = next((i for i, e in enumerate(compute) if e[0] == "B"), len(compute))
    if before_first_backward != min(expected_warmup + 1, expected_count):
        problems.append(f"{before_first_backward} forwards before the first backward, expected warm-up "
                        f"{expected_warmup} + 1 (at most {expected_count})")
    if peak != expected_peak:
        problems.append(f"peak {peak} microbatches in flight, expected {expected_peak}")
    syncs = [i for i, e in enumerate(compute) if e[0] == "sync"]
    if len(syncs) != 1 or syncs[0] != len(compute) - 1:
        problems.append(f"gradient sync at positions {syncs} of {len(compute)} operations, expected once, last")
    return problems


def replay(step, pp, microbatches, schedule, ordering, virtual=1, send_first=False):
    """Every rank's log (compute and P2P groups) for one configuration."""
    logs = []
    for stage in range(pp):
        log = []
        pgm = SimpleNamespace(pp=pp, dp=1, stage=stage, dp_rank=0, is_first=stage == 0, is_last=stage == pp - 1,
                              prev_rank=stage - 1 if stage > 0 else None,
                              next_rank=stage + 1 if stage < pp - 1 else None,
                              prev_rank_ring=(stage - 1) % pp, next_rank_ring=(stage + 1) % pp)
        comm = recording_comm(step.p2p, pgm, log, send_first)
        comm.ordering = "ordered" if send_first else ordering
        step.run_schedule(schedule, comm, pgm, log, microbatches, virtual)
        logs.append(log)
    return logs


def check(step, pp, m, schedule, ordering, virtual=1):
    logs = replay(step, pp, m, schedule, ordering, virtual)
    label = f"{schedule} pp={pp} m={m} v={virtual} p2p={ordering}"
    problems = simulate([p2p_groups(log) for log in logs])
    for stage, log in enumerate(logs):
        warmup, peak = step.expected(schedule, pp, stage, m, virtual)
        problems += [f"stage {stage}: {p}" for p in check_compute_order(log, m * virtual, warmup, peak)]
    return [f"{label}: {p}" for p in problems]


def load_step(step_dir):
    """The step's modules, and how to drive its schedules (steps with virtual stages take chunks)."""
    sys.path.insert(0, os.path.abspath(step_dir))
    import config
    import p2p
    import schedule as sched

    def run_schedule(name, comm, pgm, log, m, virtual):
        sync = lambda: log.append(("sync",))  # noqa: E731
        inputs = [torch.zeros(1)] * m
        if virtual == 1 and name in ("afab", "1f1b"):
            stage = FakeStage(log, pgm.is_first, pgm.is_last)
            sched.SCHEDULES[name](stage, comm, inputs, inputs, sync)
        else:
            stages = [FakeStage(log, pgm.stage == 0 and c == 0, pgm.stage == pgm.pp - 1 and c == virtual - 1, c)
                      for c in range(virtual)]
            sched.SCHEDULES[name](stages, comm, inputs, inputs, sync)

    def expected(name, pp, stage, m, virtual):
        """Warm-up count and peak in flight, written here from the papers' formulas."""
        if name == "afab":
            return m, m
        if name == "1f1b":
            return min(pp - stage - 1, m), min(pp - stage, m)
        warmup = min((pp - stage - 1) * 2 + (virtual - 1) * pp, m * virtual)
        return warmup, min(warmup + 1, m * virtual)

    return SimpleNamespace(config=config, parser=config.build_parser(), p2p=p2p, sched=sched,
                           run_schedule=run_schedule, expected=expected)


def allowed(step, name, pp, m, virtual, ordering):
    """Whether the step's own rules (its config.check_config) accept this configuration."""
    flags = ["--device", "cpu", "--pp", str(pp), "--microbatches", str(m), "--batch-size", str(m),
             "--layers", str(MAX_PP * MAX_V), "--schedule", name, "--p2p", ordering]
    if virtual > 1:
        flags += ["--virtual-stages", str(virtual)]
    try:
        step.config.check_config(step.parser.parse_args(flags), pp, False)
        return True
    except step.config.ConfigError:
        return False


def configurations(step):
    """All (schedule, pp, m, v, ordering) the step's rules allow, up to MAX_PP, MAX_M, MAX_V."""
    for name in step.sched.SCHEDULES:
        for pp in range(1, MAX_PP + 1):
            for m in range(1, MAX_M + 1):
                for virtual in range(2, MAX_V + 1) if name == "interleaved" else [1]:
                    for ordering in step.p2p.ORDERINGS:
                        if allowed(step, name, pp, m, virtual, ordering):
                            yield name, pp, m, virtual, ordering


def main(step_dir):
    # P2POp objects are built (never posted) against a default group: a one-process one will do.
    torch.distributed.init_process_group("gloo", rank=0, world_size=1, store=torch.distributed.HashStore())
    step = load_step(step_dir)
    start, problems, count = time.perf_counter(), [], 0
    for name, pp, m, v, ordering in configurations(step):
        problems += check(step, pp, m, name, ordering, v)
        count += 1
    broken_name = "interleaved" if "interleaved" in step.sched.SCHEDULES else "1f1b"
    broken = replay(step, 4, 8, broken_name, "ordered", 2 if broken_name == "interleaved" else 1, send_first=True)
    naive_problems = simulate([p2p_groups(log) for log in broken])
    print(json.dumps(dict(configurations=count, seconds=time.perf_counter() - start, problem_count=len(problems),
                          problems=problems[:50],
                          send_first_deadlocks=any("deadlock" in p for p in naive_problems))))


if __name__ == "__main__":
    main(sys.argv[1])

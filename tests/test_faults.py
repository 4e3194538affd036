"""A rank stopped (kill -STOP) or killed (kill -9) mid-run, as a user would: each survivor ends with one line
that names the rank that stalled or is gone, and what it was doing (faults.py).

The ranks start with the environment torchrun gives them (fault_runs.fault_run); the runs of this file go
RUNS_AT_ONCE at a time, and each must log two steps within START_DEADLINE before the signal."""
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import STEPS
from fault_runs import fault_run
from harness import REPO, agent_store, rank_env, torchrun_argv

# The machinery that notices a stalled or dead peer is the same file in every step (FAULT_FILES, checked by
# test_the_fault_machinery_is_the_same_in_every_step). What differs is where each step waits. So every step's
# pipeline waits are tested (--pp 3), and the waits a later step adds in its first step and in the last:
# data parallelism's all-reduce (step 03), tensor parallelism's (step 06), DualPipeV's (step 08).
FAULT_FILES = ("support/faults.py", "support/distributed.py")


def first_and_last(since):
    return sorted({min(s for s in STEPS if s >= since), STEPS[-1]})


# Stop (SIGSTOP) the last rank mid-run: with --pp 3 its neighbour rank 1 is not the stalled one, and rank 0 two away.
STALLS = [(step, ["--pp", "3"]) for step in STEPS]
STALLS += [(step, ["--pp", "1", "--dp", "2"]) for step in first_and_last("step03")]
STALLS += [(step, ["--tp", "2"]) for step in first_and_last("step06")]
STALLS += [(step, ["--pp", "2", "--schedule", "dualpipev", "--layers", "4"]) for step in STEPS if step >= "step08"]
# kill -9 of the last rank, rank 2: rank 1 ends on it, then rank 0. Where it waits is the stalls' concern.
DEATHS = [(step, ["--pp", "3"]) for step in (STEPS[0], STEPS[-1])]
STALL_TIMEOUT, DEATH_TIMEOUT, RUNS_AT_ONCE = 4, 60, 4
START_DEADLINE = 300  # seconds for a launch to log two steps: start-up alone can take a minute on a loaded 2-core machine


def test_the_fault_machinery_is_the_same_in_every_step(step_dirs):
    """The reason the fault runs cover a later step's waits in two steps only: FAULT_FILES are byte-identical
    in every step folder."""
    for name in FAULT_FILES:
        texts = {step: (folder / name).read_bytes() for step, folder in step_dirs.items()}
        differ = [step for step, text in texts.items() if text != texts[STEPS[0]]]
        assert not differ, f"{name} differs from {STEPS[0]}'s in {differ}: test_faults.py's cases assume one copy"


def world_of(layout) -> int:
    flags = dict(zip(layout[::2], layout[1::2]))
    return int(flags.get("--pp", 1)) * int(flags.get("--dp", 1)) * int(flags.get("--tp", 1))


def fault(step_dir, layout, folder, signal_number, timeout):
    """fault_runs.fault_run of a small model on world_of(layout) ranks: the last rank gets `signal_number` once
    two steps are logged; the survivors have --timeout and 60 s more to exit."""
    cmd = [sys.executable, str(step_dir / "train.py"), "--device", "cpu", "--steps", "10000", "--layers", "3",
           "--hidden", "32", "--heads", "2", "--seq-len", "16", "--timeout", str(timeout),
           "--log-json", str(folder / "log.jsonl"), *layout]
    world = world_of(layout)
    return fault_run(cmd, world, folder, signal_number, world - 1, START_DEADLINE, timeout + 60)


@pytest.fixture(scope="module")
def fault_runs(step_dirs, tmp_path_factory):
    """{(kind, step, layout): FaultRun} for every STALLS case ('stall') and DEATHS case ('death'). A stalled run
    spends most of its time waiting out --timeout, so RUNS_AT_ONCE of them run side by side (the ranks of a
    run start together, so their start-up is slowed alike and their own rendezvous is not). A run that could
    not be made fails its own tests, with its command and every rank's last output."""
    cases = [("stall", step, layout, signal.SIGSTOP, STALL_TIMEOUT) for step, layout in STALLS]
    cases += [("death", step, layout, signal.SIGKILL, DEATH_TIMEOUT) for step, layout in DEATHS]
    with ThreadPoolExecutor(RUNS_AT_ONCE) as pool:
        futures = {(kind, step, tuple(layout)): pool.submit(fault, step_dirs[step], layout,
                                                            tmp_path_factory.mktemp(f"{kind}_{step}"), number, timeout)
                   for kind, step, layout, number, timeout in cases}
        return {key: future.result() for key, future in futures.items()}


def made(run):
    if run.problem:
        pytest.fail(run.problem, pytrace=False)
    return run


@pytest.mark.parametrize("step, layout", STALLS, ids=[f"{s}:{' '.join(f)}" for s, f in STALLS])
def test_a_stalled_peer_ends_the_run_with_one_line(step, layout, fault_runs):
    """Stop the last rank mid-run: rank 0 must exit non-zero within about --timeout, saying what it waited for.
    With --dp 2 rank 0 waits in the data-parallel group's all-reduce, with --tp 2 in a tensor-parallel
    all-reduce inside a forward or backward: every group needs the timeout. The log keeps every step the
    rank printed: nothing is lost in a buffer when the rank ends without teardown."""
    run = made(fault_runs["stall", step, tuple(layout)])
    err, waited = run.text(0, "err"), run.exited_after[0]
    assert run.returncodes[0] != 0, err
    assert waited < STALL_TIMEOUT + 20, f"rank 0 took {waited:.0f} s to give up, with --timeout {STALL_TIMEOUT}"
    last = err.strip().splitlines()[-1]  # rank 0 timed out, or its neighbour timed out and ended first
    assert last.startswith("error: ") and "rank 0" in last and f"--timeout {STALL_TIMEOUT} s" in last, err[-2000:]
    printed = [line for line in run.text(0, "out").splitlines() if line.startswith("step ")]
    records = run.records()
    assert len(records) == len(printed) >= 2, f"{len(printed)} steps printed, {len(records)} in the log"


def naming_problem(stderr: str, rank: int, culprit: int, kind: str):
    """Where a survivor's stderr is not one line that names `culprit` as the rank that stalled (kind 'stalled':
    after the --timeout it waited, 'rank 2 stalled (...)') or is gone (kind 'gone': 'error: rank 2 is gone
    (...), no timeout expired: rank 0 ...', what this rank was doing); None if it is."""
    lines = stderr.strip().splitlines()
    if len(lines) != 1:
        return f"rank {rank} printed {len(lines)} lines on stderr, not one: {stderr[-1500:]}"
    line, t = lines[0], STALL_TIMEOUT
    patterns = [rf"error: rank {culprit} is gone \([^)]*\), no timeout expired: rank {rank} \S.*"]
    if kind == "stalled":  # it timed out itself, or found a peer's connection closed when that peer gave up
        patterns = [rf"error: rank {rank} .*\(--timeout {t} s\); rank {culprit} stalled \(silent for [^)]*\)",
                    rf"error: rank {culprit} stalled \([^)]*--timeout {t} s[^)]*\): rank {rank} \S.*"]
    if any(re.fullmatch(pattern, line) for pattern in patterns):
        return None
    return f"rank {rank}: {line!r} matches none of {patterns}"


STALLED_3 = [(step, layout) for step, layout in STALLS if layout == ["--pp", "3"]]


@pytest.mark.parametrize("step, layout", STALLED_3, ids=[f"{s}:{' '.join(f)}" for s, f in STALLED_3])
def test_the_stalled_rank_is_named(step, layout, fault_runs):
    """Stop rank 2 of a 3-stage pipeline: rank 1 waits for rank 2, and rank 0 for rank 1. Each must print one line
    naming rank 2 as the rank that stalled, read from the ranks' heartbeats in the rendezvous store (faults.py),
    not its own neighbour. Controls: the line as it was before (naming only the neighbour rank 0 waited for),
    and the same line blaming rank 1, must fail the check."""
    run = made(fault_runs["stall", step, tuple(layout)])
    for rank in (0, 1):
        assert naming_problem(run.text(rank, "err"), rank, 2, "stalled") is None, \
            naming_problem(run.text(rank, "err"), rank, 2, "stalled")
    line = run.text(0, "err").strip()
    neighbour_only = (f"error: rank 0 (stage 0) waited in vain for gradient 1 of this step from rank 1 "
                      f"(--timeout {STALL_TIMEOUT} s)")  # the line as it was
    assert naming_problem(neighbour_only, 0, 2, "stalled") is not None
    assert naming_problem(line.replace("rank 2 stalled", "rank 1 stalled"), 0, 2, "stalled") is not None


@pytest.mark.parametrize("step, layout", DEATHS, ids=[f"{s}:{' '.join(f)}" for s, f in DEATHS])
def test_a_dead_rank_is_named_at_once(step, layout, fault_runs):
    """kill -9 of rank 2 of a 3-stage pipeline: its connections close. Rank 1 must say at once, in one line,
    that rank 2 is gone and what it was doing; rank 0, whose neighbour rank 1 then ends, must name rank 2 too
    (rank 1 left its verdict in the store). Both exit non-zero long before --timeout (DEATH_TIMEOUT) could
    expire. Controls: the lines a survivor printed before (a timeout line, a gloo traceback) fail, and so
    does a line naming rank 1."""
    run = made(fault_runs["death", step, tuple(layout)])
    for rank in (0, 1):
        err = run.text(rank, "err")
        assert run.returncodes[rank] != 0 and naming_problem(err, rank, 2, "gone") is None, \
            naming_problem(err, rank, 2, "gone")
        assert run.exited_after[rank] < DEATH_TIMEOUT / 2, f"rank {rank} exited {run.exited_after[rank]:.0f} s after"
    old_timeout = (f"error: rank 0 (stage 0) waited in vain for gradient 3 of this step from rank 1 "
                   f"(--timeout {DEATH_TIMEOUT} s)")
    old_traceback = "Traceback (most recent call last):\nRuntimeError: [pair.cc:598] Connection closed by peer"
    assert naming_problem(old_timeout, 0, 2, "gone") is not None
    assert naming_problem(old_traceback, 0, 2, "gone") is not None
    assert naming_problem(run.text(0, "err").replace("rank 2 is gone", "rank 1 is gone"), 0, 2, "gone") is not None


INTERRUPTED = re.compile(r"interrupted at step (\d+); the last checkpoint is (.*)")


def interrupt_problems(codes, outputs) -> list:
    """What is wrong with the end of a run that got Ctrl-C: every rank exits with 130, one line in all, rank 0's,
    says the step and the last checkpoint, and no rank prints a traceback."""
    said = [line for out in outputs for line in out.splitlines() if INTERRUPTED.fullmatch(line)]
    problems = [] if set(codes) == {130} else [f"exit codes {codes}, not 130"]
    problems += [] if len(said) == 1 and said[0] in outputs[0] else [f"the interrupted lines are {said}"]
    return problems + [f"rank {r} printed a traceback" for r, out in enumerate(outputs) if "Traceback" in out]


def interrupt(cmd, cwd, wait):
    """Two ranks of `cmd`; once wait() returns, SIGINT to both, as Ctrl-C in a terminal sends it: (exit codes,
    outputs)."""
    with agent_store() as port:
        ranks = [subprocess.Popen(torchrun_argv(cmd), cwd=cwd, env=rank_env(r, 2, port), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for r in range(2)]
        try:
            wait()
            for p in ranks:
                p.send_signal(signal.SIGINT)
            outputs = [p.communicate(timeout=60)[0] for p in ranks]
        finally:
            for p in ranks:
                p.kill()
                p.wait()
    return [p.returncode for p in ranks], outputs


def test_ctrl_c_ends_every_rank_with_one_line(step_dirs, tmp_path):
    """SIGINT to both ranks of a pp 2 run (step 03), as Ctrl-C in a terminal sends it, once it has saved: exit
    code 130 on both, and one line, rank 0's, naming the step and the last checkpoint. The control: the old end,
    KeyboardInterrupt's traceback from each rank, fails the same check."""
    cmd = [sys.executable, str(step_dirs["step03_afab"] / "train.py"), "--device", "cpu", "--steps", "100000",
           "--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16", "--save", str(tmp_path / "ck"),
           "--save-every", "2", "--keep", "1", "--log-json", str(tmp_path / "log.jsonl")]
    log = tmp_path / "log.jsonl"  # 4 steps logged: the checkpoint of step 2 is saved

    def saved():
        deadline = time.monotonic() + START_DEADLINE
        while not (log.exists() and len(log.read_text().splitlines()) >= 4) and time.monotonic() < deadline:
            time.sleep(0.1)

    codes, outputs = interrupt(cmd, tmp_path, saved)
    problems = interrupt_problems(codes, outputs)
    assert not problems, "\n".join(problems) + "\n" + outputs[0][-2000:]
    step, folder = INTERRUPTED.search(outputs[0]).groups()
    assert folder.startswith(str(tmp_path / "ck" / "step")) and int(folder[-8:]) <= int(step), outputs[0][-500:]
    old = ["Traceback (most recent call last):\n  ...\nKeyboardInterrupt"] * 2
    assert interrupt_problems([1, 1], old), "the control passed the check"


def test_ctrl_c_while_torch_loads_ends_with_the_same_line(step_dirs):
    """SIGINT 0.3 s after two ranks of step 01 start, while they import torch: exit code 130 on both and rank 0's
    one line, no traceback (train.py installs support/progress.py's handler before it imports torch). The
    control: a process that imports torch with Python's default handler fails the same check."""
    cmd = [sys.executable, str(step_dirs[STEPS[0]] / "train.py"), "--device", "cpu", "--steps", "100000"]
    while_loading = lambda: time.sleep(0.3)
    problems = interrupt_problems(*interrupt(cmd, REPO, while_loading))
    assert not problems, problems
    # On a loaded machine this process has been seen to outlive the signal and sleep on. A short sleep ends it
    # either way, before communicate's deadline: killed by KeyboardInterrupt's traceback, or exiting 0.
    assert interrupt_problems(*interrupt([sys.executable, "-c", "import time, torch; time.sleep(10)"], REPO,
                                         while_loading))


OUT_OF_MEMORY = """
import sys
sys.path.insert(0, sys.argv[1])
import torch
from support.distributed import one_line_errors
if sys.argv[2] == "wrapped":
    with one_line_errors(10.0):
        torch.empty(2**60, dtype=torch.uint8)
else:
    torch.empty(2**60, dtype=torch.uint8)
"""


def test_out_of_memory_ends_with_one_line(step_dirs):
    """An allocation the allocator refuses (2^60 bytes) inside train.main's one_line_errors: exit code 1 and one
    line naming the step and the rank. The control: the same allocation outside it prints a traceback."""
    runs = [subprocess.run([sys.executable, "-c", OUT_OF_MEMORY, str(step_dirs[STEPS[0]]), how], capture_output=True,
                           text=True, timeout=60) for how in ("wrapped", "bare")]
    wrapped, bare = runs
    assert wrapped.returncode == 1 and wrapped.stderr.strip().startswith("error: out of memory in step 0 on rank 0: "), \
        wrapped.stderr[-2000:]
    assert len(wrapped.stderr.strip().splitlines()) == 1, wrapped.stderr[-2000:]
    assert "Traceback" in bare.stderr, bare.stderr[-2000:]

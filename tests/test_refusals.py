"""The one `error:` line arrives: refused torchrun launches on a busy machine, and a loss that diverges.

Under torchrun the first worker to exit with an error makes the agent stop all the others, so a line that
a rank prints after a peer has exited can be lost. test_the_error_line_arrives_whatever_order_ranks_exit
launches refused runs in a row beside a busy loop, half of them with rank 0 reaching its check late (the
order that loses the line), and its control shows the old behaviour losing it. Under torchrun a refusal and
--help come from rank 0 alone. The stall tests are in test_faults.py."""
import ast
import json
import os
import resource
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import STEPS
import harness
from harness import REPO, agent_store, rank_env, run, run_rank, torchrun_argv

REFUSED = [(["--lr", "nan"], "error: --lr nan must be positive"),
           (["--pp", "x"], "error: argument --pp: invalid int value: 'x' (see --help)"),
           (["--steps", "0"], "error: --steps 0 must be positive")]
RANKS, LATE_S, AT_ONCE = 4, 2.0, 2  # ranks per launch, rank 0's delay in half of them, launches side by side


def late_launch(step_dir, late_s: float, flags, control=False):
    """torchrun with RANKS ranks of `train.main(flags)`, rank 0 starting late_s seconds after the others
    (tests/check_bad_flags.py --late); returns every line starting with `error: ` that the launch printed."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}",
           str(REPO / "tests" / "check_bad_flags.py"), str(step_dir), "--late", str(late_s),
           *(["--exit-at-once"] if control else []), *flags]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode != 0, done.stdout[-2000:]
    return [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("error: ")]


def test_the_error_line_arrives_whatever_order_ranks_exit(step_dirs):
    """One refused launch of 4 ranks for every other step (config.parse_flags and refuse are the same text in
    every step), two at a time, beside a process that keeps a core busy: every launch prints its `error:`
    line exactly once, also when rank 0 gets to its check 2 s after the other ranks have refused. Control:
    with the old behaviour (ranks other than 0 exit as soon as they refuse) a launch whose rank 0 is late
    prints no line at all: torchrun stopped rank 0 before it spoke."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        launches = [(step, LATE_S * (k % 2), *REFUSED[k % len(REFUSED)]) for k, step in enumerate(STEPS[::2])]
        with ThreadPoolExecutor(AT_ONCE) as pool:
            printed = list(pool.map(lambda c: late_launch(step_dirs[c[0]], c[1], c[2]), launches))
        lost = late_launch(step_dirs[STEPS[0]], LATE_S, REFUSED[0][0], control=True)
    finally:
        busy.kill()
        busy.wait()
    for (step, late, flags, line), errors in zip(launches, printed):
        assert errors == [line], f"{step} {' '.join(flags)} (rank 0 late by {late:g} s): printed {errors}"
    assert lost == [], f"the control printed {lost}: it shows nothing about the order of exits"


def diverge(step_dir, folder):
    """Two ranks at --lr 1e30 (pp 2), started warm as torchrun starts them: [(exit code, stderr)] of rank 0 and
    rank 1."""
    cmd = torchrun_argv([sys.executable, str(step_dir / "train.py"), "--device", "cpu", "--steps", "5", "--layers",
                         "2", "--hidden", "32", "--heads", "2", "--seq-len", "16", "--lr", "1e30", "--timeout", "60"])
    with agent_store() as port, ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda r: run(cmd, cwd=folder, env=rank_env(r, 2, port), capture_output=True, text=True,
                                           timeout=120), range(2)))
    return [(d.returncode, d.stderr) for d in done]


def test_a_diverged_loss_stops_the_run_with_one_line(step_dirs, tmp_path):
    """--lr 1e30 in fp32: every rank exits with code 3 at the first non-finite loss, and the only `error:`
    line, rank 0's, names the loss and the step. Control: the same run at the default --lr ends with 0."""
    with ThreadPoolExecutor(2) as pool:
        runs = dict(zip(STEPS, pool.map(lambda s: diverge(step_dirs[s], tmp_path), STEPS)))
    for step, ((code0, err0), (code1, err1)) in runs.items():
        errors = [line for line in (err0 + err1).splitlines() if line.startswith("error: ")]
        assert (code0, code1) == (3, 3), f"{step}: exit codes {code0}, {code1}\n{err0[-2000:]}"
        assert len(errors) == 1 and "training diverged" in errors[0] and " at step " in errors[0], (step, errors)
        assert errors[0] == err0.strip().splitlines()[-1], f"{step}: rank 0's last line is {err0[-300:]}"
    control = run_rank([sys.executable, str(step_dirs[STEPS[0]] / "train.py"), "--device", "cpu", "--steps", "2",
                        "--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16"], cwd=tmp_path)
    assert control.returncode == 0, control.stderr[-2000:]


def parse_as_rank_0(step_dir, folder, cases, limit_bytes=None):
    """tests/check_bad_flags.py on [[world, flags], ...] in `folder`, under `ulimit -v limit_bytes` if given:
    [{exit_code, last_line, printed}] (exit_code None: accepted)."""
    (folder / "cases.json").write_text(json.dumps(cases))
    limit = (lambda: resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, resource.RLIM_INFINITY))) \
        if limit_bytes else None
    done = subprocess.run([sys.executable, str(REPO / "tests" / "check_bad_flags.py"), str(step_dir),
                           str(folder / "cases.json")], cwd=folder, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), preexec_fn=limit)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def tiny_run(step_dir, folder, *flags):
    """One process of train.py on a tiny model for one step, in folder: (exit code, stdout)."""
    done = run_rank([sys.executable, str(step_dir / "train.py"), "--device", "cpu", "--steps", "1", "--layers", "2",
                     "--hidden", "32", "--heads", "2", "--seq-len", "16", *flags], cwd=folder)
    return done.returncode, done.stdout + done.stderr


def test_an_output_replaces_only_a_file_the_course_wrote(step_dirs, tmp_path):
    """--trace and --log-json at a file the course did not write (a Chrome trace of another tool, a JSON log of
    another trainer) are refused before any work, one line naming the path, and the files stay as they were. The
    control: the trace and the log of a run of the course, and an empty file, are accepted; a second run
    replaces them whole and says so, and leaves no temporary file."""
    step_dir = step_dirs[STEPS[0]]
    (tmp_path / "theirs.json").write_text('{"traceEvents": []}')
    (tmp_path / "theirs.jsonl").write_text('{"step": 0, "loss": 1.0}\n')
    (tmp_path / "empty.json").write_text("")
    code, first = tiny_run(step_dir, tmp_path, "--trace", "t.json", "--log-json", "l.jsonl")
    assert code == 0, first[-2000:]
    found = parse_as_rank_0(step_dir, tmp_path, [[1, ["--trace", "theirs.json"]], [1, ["--log-json", "theirs.jsonl"]],
                                                 [1, ["--trace", "t.json", "--log-json", "l.jsonl"]],
                                                 [1, ["--trace", "empty.json"]]])
    assert [f["exit_code"] for f in found] == [2, 2, None, None], found
    assert found[0]["last_line"] == ("error: --trace theirs.json exists and is not a trace this course wrote: it is "
                                     "left as it is; give another file name"), found[0]
    assert found[1]["last_line"].startswith("error: --log-json theirs.jsonl exists and is not a log"), found[1]
    code, second = tiny_run(step_dir, tmp_path, "--trace", "t.json", "--log-json", "l.jsonl")
    assert code == 0, second[-2000:]
    assert "trace written to t.json, replacing an earlier run's trace" in second, second[-2000:]
    assert "--log-json l.jsonl: an earlier run's log, which this run replaces" in second, second[-2000:]
    assert len((tmp_path / "l.jsonl").read_text().splitlines()) == 1 and not list(tmp_path.glob("*.tmp"))
    assert (tmp_path / "theirs.json").read_text() == '{"traceEvents": []}'


# Another trainer's JSON-lines log: records with step and loss, as the course's have, and its own keys besides.
THEIR_LOG = "".join(f'{{"step": {k}, "loss": {5.5 - k / 10}, "learning_rate": 0.0003, "epoch": {k / 100}}}\n'
                    for k in range(3))


@pytest.mark.parametrize("step", STEPS)
def test_another_trainers_log_is_never_replaced(step, step_dirs, tmp_path):
    """--log-json at another tool's training log, whose records have step and loss keys as the course's do:
    train.py refuses it in one line naming the flag and the path, exit code 2, and the file keeps every byte.
    Every step (config.py is each step's own). The control, a log the course wrote replaced with a line that
    says so, is test_an_output_replaces_only_a_file_the_course_wrote's."""
    (tmp_path / "theirs.jsonl").write_text(THEIR_LOG)
    code, printed = tiny_run(step_dirs[step], tmp_path, "--log-json", "theirs.jsonl")
    assert code == 2, printed[-2000:]
    assert len(printed.splitlines()) == 1 and printed.startswith("error: --log-json theirs.jsonl "), printed[-2000:]
    assert (tmp_path / "theirs.jsonl").read_text() == THEIR_LOG and not list(tmp_path.glob("*.tmp"))


def test_the_memory_budget_counts_the_address_space_limit(step_dirs, tmp_path):
    """Under `ulimit -v` 2.5 GiB a model that needs at least 2.2 GiB (--hidden 1024) is refused before any work,
    naming the limit: torch maps about 0.6 GiB already. The control: without the limit it is accepted."""
    flags = [1, ["--hidden", "1024", "--heads", "8", "--steps", "1"]]
    limited = parse_as_rank_0(step_dirs[STEPS[0]], tmp_path, [flags], limit_bytes=int(2.5 * 2**30))[0]
    free = parse_as_rank_0(step_dirs[STEPS[0]], tmp_path, [flags])[0]
    assert limited["exit_code"] == 2 and "ulimit -v of 2.5 GiB per process" in limited["last_line"], limited
    assert free["exit_code"] is None, free


LONG_STEP = """
import sys, time
sys.path.insert(0, sys.argv[1])
import config
from support import report
from support.distributed import progress
args = config.build_parser().parse_args(sys.argv[2:])
args.pp = 1
report.announce(args)
report.TICK_S = 0.2
report.watch(steps=3)
progress.update(step=1, since=time.monotonic())
time.sleep(0.7)
progress.update(step=3, since=time.monotonic())  # the run's steps are done: the ticker is quiet
print("done", flush=True)
time.sleep(0.7)
"""


def test_a_long_step_is_announced_and_ticks(step_dirs):
    """--seq-len 20000 in bf16 (step 07): before the first step rank 0 prints one line with the step's estimated
    seconds, from its FLOPs and a short probe; while a step runs, a line every TICK_S (0.2 s here) names it, and
    none once the steps are done. The control: the default model is not announced (its step is short)."""
    step_dir = str(step_dirs["step07_mixed_precision"])
    long = harness.run([sys.executable, "-c", LONG_STEP, step_dir, "--seq-len", "20000", "--precision", "bf16"],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    short = harness.run([sys.executable, "-c", LONG_STEP, step_dir], capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = long.stdout.splitlines()
    assert lines[0].startswith("the first step will take about ") and "FLOPs" in lines[0], long.stdout + long.stderr
    ticks = lines[1:lines.index("done")]
    assert 2 <= len(ticks) <= 4 and all(t.startswith("(step 1 still running after") for t in ticks), lines
    assert lines[-1] == "done", lines
    assert not short.stdout.startswith("the first step"), short.stdout


def torchrun(step_dir, nproc: int, *flags: str, timeout: float = 180):
    """`torchrun --standalone` of the step's train.py on the CPU, as a user starts it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(step_dir / "train.py"), "--device", "cpu", *flags]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def ranks_output(done) -> str:
    """What the ranks printed, without the report torchrun adds after a failure."""
    text = done.stdout + done.stderr
    cut = text.find("Traceback (most recent call last):\n  File \"") if "ChildFailedError" in text else -1
    lines = [line for line in text[: cut if cut >= 0 else None].splitlines() if "torch/distributed/run.py" not in line]
    return "\n".join(lines[-40:])


def help_problem(step, helped) -> str:
    """What is wrong with a --help's output: it must show the defaults and open with the step's description."""
    if "(default: 0.003)" not in " ".join(helped.stdout.split()):
        return "--help does not show the defaults"
    return "" if f"Step {step[4:6]} - " in helped.stdout else "--help does not open with the step's own description"


@pytest.mark.parametrize("step", [STEPS[0], STEPS[-1]])
def test_under_torchrun_rank_0_alone_speaks(step, step_dirs):
    """A broken rule and --help print once for all ranks, and the error is the last line a rank prints. Who
    speaks is decided by config.parse_flags and config.refuse, the same code in every step (checked below), so
    the first step and the last stand for all. (The two launches run side by side: each spends most of its
    time importing torch.)"""
    with ThreadPoolExecutor(2) as pool:
        refused, helped = pool.map(lambda flags: torchrun(step_dirs[step], 2, *flags, timeout=60),
                                   (["--lr", "-1"], ["--help"]))
    errors = [line for line in (refused.stdout + refused.stderr).splitlines() if line.startswith("error: ")]
    assert refused.returncode != 0 and errors == ["error: --lr -1.0 must be positive"], ranks_output(refused)
    assert helped.returncode == 0 and helped.stdout.count("usage:") == 1, ranks_output(helped)
    assert not help_problem(step, helped), help_problem(step, helped)


def who_speaks(step_dir) -> list:
    """The source of config.parse_flags and config.refuse, which decide which rank prints under torchrun."""
    tree = ast.parse((step_dir / "config.py").read_text())
    return [ast.unparse(node) for node in tree.body if isinstance(node, ast.FunctionDef)
            and node.name in ("parse_flags", "refuse")]


@pytest.mark.parametrize("step", STEPS[1:-1])
def test_who_speaks_is_decided_alike_in_every_step(step, step_dirs):
    """The reason test_under_torchrun_rank_0_alone_speaks runs two steps: the rest decide as they do. Control:
    the old refuse, every rank exiting at once, is told apart."""
    first = who_speaks(step_dirs[STEPS[0]])
    assert len(first) == 2 and who_speaks(step_dirs[step]) == first
    assert [text.replace("time.sleep(REFUSAL_WAIT_S)", "pass") for text in first] != first


@pytest.mark.parametrize("step", STEPS)
def test_help_opens_with_the_step_and_shows_the_defaults(step, step_dirs):
    """Each step's own --help, in one process. Control: the same text naming another step fails the check."""
    helped = harness.run([sys.executable, str(step_dirs[step] / "train.py"), "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and not help_problem(step, helped), help_problem(step, helped)
    helped.stdout = helped.stdout.replace(f"Step {step[4:6]} - ", "Step 00 - ")
    assert help_problem(step, helped), "--help naming another step passed the check"

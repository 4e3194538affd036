"""The warm launcher (tests/warm.py, harness.start_ranks) starts a rank as torchrun does.

The same command runs twice, under real `torchrun --standalone` and under the warm launcher, and each rank
must see the same: environment, argv, working folder, sys.path[0] and __file__, the same lines on stdout
and on stderr, and the same exit code, torchrun's own verdict included. Three commands: a rank probe that
joins a gloo group (tests/rank_probe.py), a refused configuration of step 01's train.py (rank 0's `error:`
line, then torchrun stops rank 1), and a probe whose rank 1 fails before it joins. Control: a launcher that
drops one of torchrun's variables fails the same comparison.

MASTER_PORT, TORCHELASTIC_RUN_ID and TORCHELASTIC_ERROR_FILE are not compared: they differ between any
two torchrun launches (a free port, a fresh id, a folder named after it). Nor are PYTEST_CURRENT_TEST, which
pytest sets to the phase (the torchrun launches run in a fixture), and the folder of the session's warm
servers (warm.SHARED), which is set once the first server starts.
"""
import json
import os
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import pytest

from conftest import STEPS
import warm
from harness import REPO, agent_store, start_ranks, wait_all

# Differ between any two torchrun launches; pytest names the phase, and torchrun runs in the fixture's setup;
# the folder of the session's warm servers is set when the first one starts, which may follow torchrun's launch.
PER_LAUNCH = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "PYTEST_CURRENT_TEST", warm.SHARED}
PROBE = "tests/rank_probe.py"
COMMANDS = {"joins": [PROBE], "refused": [f"{STEPS[0]}/train.py", "--pp", "3"], "fails": [PROBE, "fail"]}
FAILED_RANK = re.compile(r"rank +: (\d+) \(local_rank: \d+\)\n +exitcode +: (-?\d+)")


def under_torchrun(args, folder: Path):
    """{rank: (exit code, stdout, stderr)} and torchrun's own exit code, each rank's output redirected to a
    file (--redirects 3). torchrun names the ranks that failed, with their exit codes; the others exited 0.
    It gets os.environ, as the warm launcher does: a child that inherits would also get what C code set in
    this process (readline, loaded by pytest, sets COLUMNS and LINES) but os.environ does not show."""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "--log-dir", str(folder), "--redirects", "3", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=180, env=dict(os.environ))
    codes = {int(rank): int(code) for rank, code in FAILED_RANK.findall(done.stderr)}
    ranks = {}
    for rank in range(2):
        logs = next(folder.glob(f"*/attempt_0/{rank}"))
        ranks[rank] = (codes.get(rank, 0), (logs / "stdout.log").read_text(), (logs / "stderr.log").read_text())
    return ranks, done.returncode


def under_warm_launcher(args, folder: Path, drop=None):
    """The same, from harness.start_ranks with no variable of the tests' own (extra_env={}); the launcher's
    verdict is torchrun's: 1 if a rank failed, else 0. drop: a variable the launcher leaves out (control)."""
    folder.mkdir(parents=True)
    files = [(open(folder / f"{rank}.out", "w+"), open(folder / f"{rank}.err", "w+")) for rank in range(2)]
    with agent_store() as port:
        procs = start_ranks([sys.executable, *args], 2, port, folder, files, cwd=REPO,
                            extra_env={} if drop is None else {drop: None})
        assert wait_all(procs, 120) == [], "a rank stalled"
    ranks = {rank: (p.returncode, *[(f.seek(0), f.read())[1] for f in files[rank]]) for rank, p in enumerate(procs)}
    return ranks, int(any(p.returncode for p in procs))


def differences(torchrun, warm) -> list:
    """Where the two launches differ, rank by rank: exit codes, environment, and every other line."""
    (t_ranks, t_code), (w_ranks, w_code) = torchrun, warm
    found = [] if t_code == w_code else [f"the launch ended with {w_code}, torchrun with {t_code}"]
    for rank in range(2):
        (t_exit, t_out, t_err), (w_exit, w_out, w_err) = t_ranks[rank], w_ranks[rank]
        if t_exit != w_exit:
            found.append(f"rank {rank}: exit code {w_exit}, under torchrun {t_exit}")
        t_env, w_env = environment(t_out), environment(w_out)
        found += [f"rank {rank}: {name} is {w_env.get(name)!r}, under torchrun {t_env.get(name)!r}"
                  for name in sorted(set(t_env) | set(w_env)) if t_env.get(name) != w_env.get(name)]
        if other_lines(t_out) != other_lines(w_out):
            found.append(f"rank {rank}: stdout {other_lines(w_out)}, under torchrun {other_lines(t_out)}")
        if t_err != w_err:
            found.append(f"rank {rank}: stderr {w_err!r}, under torchrun {t_err!r}")
    return found


def environment(stdout: str) -> dict:
    """The probe's environment line, less the variables that differ between any two launches."""
    line = next((line for line in stdout.splitlines() if line.startswith("env ")), "env {}")
    return {k: v for k, v in json.loads(line[4:]).items() if k not in PER_LAUNCH}


def other_lines(stdout: str) -> list:
    return [line for line in stdout.splitlines() if not line.startswith("env ")]


@pytest.fixture(scope="module")
def torchrun_runs(tmp_path_factory):
    """The three commands under real torchrun, all at once: {name: under_torchrun(...)}."""
    folder = tmp_path_factory.mktemp("torchrun")
    with ThreadPoolExecutor(len(COMMANDS)) as pool:
        return dict(zip(COMMANDS, pool.map(lambda name: under_torchrun(COMMANDS[name], folder / name), COMMANDS)))


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_warm_rank_is_started_as_torchrun_starts_it(name, torchrun_runs, tmp_path):
    args, torchrun = COMMANDS[name], torchrun_runs[name]
    assert torchrun[1] == (0 if name == "joins" else 1), f"torchrun ended with {torchrun[1]}: {torchrun[0]}"
    assert differences(torchrun, under_warm_launcher(args, tmp_path / "warm")) == []
    if name == "joins":
        assert "joined 1 of 2" in torchrun[0][1][1], torchrun[0][1]
        dropped = under_warm_launcher(args, tmp_path / "control", drop="GROUP_RANK")
        assert differences(torchrun, dropped) == ["rank 0: GROUP_RANK is None, under torchrun '0'",
                                                  "rank 1: GROUP_RANK is None, under torchrun '0'"]


MODULE_PROBE = '''import os, sys
print(sys.argv[1:], sys.argv[0] == __file__, sys.path[0], __name__, os.getcwd())
if sys.argv[1] == "raise":
    raise ValueError("as asked")
sys.exit(int(sys.argv[1]))
'''


@pytest.mark.parametrize("how", ["0", "3", "raise"])
def test_a_module_started_warm_runs_as_python_m_runs_it(how, tmp_path):
    """`python -m MODULE ARGS` (how the exercises run pytest) gives the same stdout and exit code warm and cold,
    and an uncaught exception the same last frame and message (the frames above it are runpy's, which differ:
    the interpreter's own start-up against runpy.run_module)."""
    (tmp_path / "module_probe.py").write_text(MODULE_PROBE)
    cmd = [sys.executable, "-m", "module_probe", how]
    assert warm.server_for(cmd, dict(os.environ)) is not None, "python -m would start cold"
    runs = [launch(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
            for launch in (subprocess.run, warm.run)]
    cold, hot = [(done.returncode, done.stdout, done.stderr.strip().splitlines()[-3:]) for done in runs]
    assert hot == cold and cold[0] == (1 if how == "raise" else int(how)), (cold, hot)
    assert f"[{how!r}] True {tmp_path} __main__ {tmp_path}" in cold[1], cold


def started_late(path: Path):
    """A stand-in for a server still importing: it says "ready" after a second, once, then waits for its stdin."""
    server = object.__new__(warm.Server)
    server.path, server.ready, server.reading = str(path), None, threading.Lock()
    server.process = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(1); print('ready', "
                                       "flush=True); sys.stdin.read()"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
    return server


def both_go_on(wait_ready, path: Path) -> bool:
    """Whether two threads that call wait_ready on one starting server (ready after 1 s) both return True
    within 5 s."""
    server = started_late(path)
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(wait_ready, server) for _ in range(2)]
        waited = wait(futures, timeout=5)
        server.process.stdin.close()  # the server ends: a thread still reading gets an empty line and goes on
        server.process.wait()
    return not waited.not_done and all(f.result() for f in futures)


def test_two_threads_that_wait_for_one_server_both_go_on(tmp_path):
    """Two threads that ask for a server while it still imports (test_hostile_inputs drives two tools at once)
    both get it: "ready" comes once, and neither waits for a second line. Control: the check without its
    lock leaves the second thread reading until the server ends."""
    def unlocked(server):
        if server.ready is None:
            server.ready = server.process.stdout.readline().strip() == "ready"
        return server.ready

    assert both_go_on(warm.Server.wait_ready, tmp_path / "a.socket")
    assert not both_go_on(unlocked, tmp_path / "b.socket"), "the control passed: both threads went on unlocked"

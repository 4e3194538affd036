"""A run in which one rank is stopped or killed mid-run (tests/test_faults.py, the CUDA tier).

Its ranks start cold, with torchrun's environment and the store run as torchrun's agent runs it: a fault is
the course's to handle, from processes that start as a user's would.
"""
import json
import subprocess
import time
from pathlib import Path

from harness import REPO, agent_store, rank_env, tail, torchrun_argv


class FaultRun:
    """A run in which one rank was stopped or killed: each rank's exit code, stdout and stderr, the seconds
    from the signal to each survivor's exit, and rank 0's --log-json records. `problem` says why the run
    could not be made (it never logged two steps, or a survivor outlived its deadline), with the command
    and every rank's last output; None if it was made."""

    def __init__(self, cmd, folder: Path, world: int, victim: int):
        self.cmd, self.folder, self.world, self.victim = cmd, folder, world, victim
        self.returncodes, self.exited_after, self.problem = {}, {}, None

    def text(self, rank: int, stream: str) -> str:
        path = self.folder / f"rank{rank}.{stream}"
        return path.read_text() if path.exists() else ""

    def records(self):
        log = self.folder / "log.jsonl"
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    def fail(self, why: str):
        tails = "\n".join(f"  rank {r} stderr:\n{tail(self.text(r, 'err'), 8)}" for r in range(self.world))
        self.problem = f"{why}\n  command: {' '.join(map(str, self.cmd))}\n{tails}"


def fault_run(cmd, world: int, folder: Path, signal_number: int, victim: int, start_deadline: float,
              exit_deadline: float) -> FaultRun:
    """Start `cmd` (a train.py writing --log-json folder/log.jsonl) on `world` ranks; once rank 0 has logged
    two steps, send `signal_number` to rank `victim` and wait for the others to exit. Deadlines, in seconds:
    start_deadline for the two steps (start-up on a loaded machine), exit_deadline for the survivors."""
    run, folder = FaultRun(cmd, folder, world, victim), Path(folder)
    with agent_store() as port:
        return watch_fault(run, cmd, world, folder, port, signal_number, victim, start_deadline, exit_deadline)


def watch_fault(run: FaultRun, cmd, world: int, folder: Path, port: int, signal_number: int, victim: int,
                start_deadline: float, exit_deadline: float) -> FaultRun:
    """fault_run's launch and watch, the store at `port`: cold processes, as a user's would be."""
    log = folder / "log.jsonl"
    files = [(open(folder / f"rank{r}.out", "w"), open(folder / f"rank{r}.err", "w")) for r in range(world)]
    procs = [subprocess.Popen(torchrun_argv(cmd), cwd=REPO, env=rank_env(r, world, port, folder), stdout=out,
                              stderr=err)
             for r, (out, err) in enumerate(files)]
    try:
        started = time.monotonic()
        while not (log.exists() and log.read_text().count("\n") >= 2) and all(p.poll() is None for p in procs):
            if time.monotonic() - started > start_deadline:
                run.fail(f"rank 0 had not logged two steps {start_deadline:.0f} s after the launch")
                return run
            time.sleep(0.05)
        if any(p.poll() is not None for p in procs):
            run.fail(f"a rank exited before two steps were logged: exit codes {[p.poll() for p in procs]}")
            return run
        procs[victim].send_signal(signal_number)
        signalled = time.monotonic()
        while any(p.poll() is None for r, p in enumerate(procs) if r != victim):
            if time.monotonic() - signalled > exit_deadline:
                run.fail(f"a survivor still ran {exit_deadline:.0f} s after rank {victim} got signal {signal_number}")
                return run
            for r, p in enumerate(procs):
                if r != victim and p.poll() is not None and r not in run.exited_after:
                    run.exited_after[r] = time.monotonic() - signalled
            time.sleep(0.05)
        for r, p in enumerate(procs):
            if r != victim:
                run.exited_after.setdefault(r, time.monotonic() - signalled)
                run.returncodes[r] = p.returncode
        return run
    finally:
        for p, handles in zip(procs, files):
            p.kill()
            p.wait()
            for handle in handles:
                handle.close()

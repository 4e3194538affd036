"""Launch a step's code on several CPU processes and check it against a single device.

The pytest process never imports a step's modules (all steps share module
names); it starts `world` fresh Python processes running check_equivalence.py with the
environment torchrun would give them (gloo, CPU, one thread each), waits with a
deadline, and only reads back the tensors they saved.
"""
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

import formulas
import warm

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "check_equivalence.py"
RTOL = 1e-5  # fp32 losses and gradients: pipelining only reorders sums, so they agree to rounding
# Weights after three AdamW steps: 1e-5 too, per tensor (rel_err: the difference's norm over the tensor's). AdamW
# divides each gradient entry by its running RMS plus eps = 1e-8, so an entry whose gradient is near eps has its
# rounding difference multiplied by about lr * eps / (|g| + eps)^2, up to lr / eps = 1e5 at the tests' lr 1e-3.
# Measured over every fp32 case of test_equivalence but PipeDream with TP (its tolerances say why): at most 6.5e-6
# (step 08, experts at top-k 1, interleaved: one element of layer 0's wv, gradient -1.7e-9, off by 5.8e-11, moved
# 4.2e-6), 5.8e-6 under tp 2; gradients at most 4e-7. Control: the experts left out of weight decay move only the
# weights, by 3 * lr * 0.01 = 3e-5 (test_equivalence's expert-weights-without-decay), which 1e-4 would pass.
WEIGHT_RTOL = 1e-5
# The one variable the tests add to torchrun's environment: a crash in C++ prints the ranks' Python frames.
TEST_ENV = {"PYTHONFAULTHANDLER": "1"}
PEERS_SPEAK_S = 2.0  # after one rank fails, how long the others may go on to print their side (wait_all)
STOP_GRACE_S = 5.0  # after SIGTERM, how long a rank may take to exit before SIGKILL (torchrun gives 30 s)


class RunFailed(AssertionError):
    """A multi-process run crashed or stalled; the message says which rank and where."""


def rank_env(rank: int, world: int, port: int, out: Path = None) -> dict:
    """Exactly what `torchrun --standalone --nproc_per_node WORLD` gives rank `rank` (torch 2.13), with the
    rendezvous store at `port`, which the launcher runs as torchrun's agent does (agent_store).
    tests/test_warm.py compares it with real torchrun's. Only MASTER_PORT, TORCHELASTIC_RUN_ID and
    TORCHELASTIC_ERROR_FILE differ, as they do between any two torchrun launches. CUDA_VISIBLE_DEVICES stays as
    the user set it: the CPU tests name --device cpu, and the CUDA tier uses the GPUs the user chose."""
    run_id = f"tests-{port}"
    error_file = (Path(out) if out else Path(tempfile.gettempdir())) / f"torchelastic_{run_id}" / str(rank) / "error.json"
    return dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_NAME="default", ROLE_RANK=str(rank),
                ROLE_WORLD_SIZE=str(world), MASTER_ADDR="localhost", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID=run_id,
                TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_ERROR_FILE=str(error_file),
                TORCHELASTIC_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT", TORCH_NCCL_ASYNC_ERROR_HANDLING="1")


@contextmanager
def agent_store():
    """The rendezvous store torchrun's agent runs for its ranks (TORCHELASTIC_USE_AGENT_STORE=True): every rank,
    rank 0 included, joins it as a client, and it outlives them. Yields its port."""
    from torch.distributed import TCPStore

    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    try:
        yield store.port
    finally:
        del store


def run(cmd, **kwargs) -> subprocess.CompletedProcess:
    """One process, as subprocess.run(cmd, **kwargs) runs it, started warm where it can be (tests/warm.py)."""
    return warm.run(cmd, **kwargs)


def run_rank(cmd, cwd=REPO, timeout: float = 120) -> subprocess.CompletedProcess:
    """`cmd` as the one rank of a torchrun launch of one process, warm; its output captured as text."""
    with agent_store() as port:
        return run(cmd, cwd=cwd, env=rank_env(0, 1, port), capture_output=True, text=True, timeout=timeout)


def launch(cmd, world: int, out: Path, timeout: float, cwd=REPO):
    """Run `cmd` (`python SCRIPT ARGS`) as ranks 0..world-1, as torchrun runs them (start_ranks); return their
    stdout texts. Raise RunFailed naming the bad rank."""
    out.mkdir(parents=True, exist_ok=True)
    logs = [open(out / f"rank{rank}.log", "w+") for rank in range(world)]
    with agent_store() as port:
        procs = start_ranks(cmd, world, port, out, [(log, subprocess.STDOUT) for log in logs], cwd)
        stalled = wait_all(procs, timeout)
    texts = [(log.seek(0), log.read())[1] for log in logs]
    for log in logs:
        log.close()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0 and r not in stalled]
    if failed or stalled:
        raise RunFailed(failure_message(out, texts, {r: procs[r].returncode for r in failed}, stalled, timeout))
    return texts


def start_ranks(cmd, world: int, port: int, out: Path, streams, cwd=REPO, extra_env=TEST_ENV):
    """Start `cmd` (`python SCRIPT ARGS`) as ranks 0..world-1, warm (tests/warm.py), as torchrun starts them:
    `python -u SCRIPT ARGS` with torchrun's environment (rank_env, the store at `port`), updated by extra_env
    (a None leaves a variable out). streams: each rank's (stdout, stderr), files or fds; stderr may be
    subprocess.STDOUT."""
    def env(rank):
        return {k: v for k, v in dict(rank_env(rank, world, port, out), **extra_env).items() if v is not None}

    return [warm.popen(torchrun_argv(cmd), cwd=cwd, env=env(rank), stdout=stdout, stderr=stderr)
            for rank, (stdout, stderr) in enumerate(streams)]


def torchrun_argv(cmd):
    """`python SCRIPT ARGS` as torchrun runs it: `python -u SCRIPT ARGS` (unbuffered)."""
    return [cmd[0], "-u", *cmd[1:]] if cmd[0] == sys.executable and cmd[1:2] != ["-u"] else list(cmd)


def wait_all(procs, timeout: float):
    """Wait for every rank, and stop them as torchrun's agent does once one has failed: SIGTERM to the others,
    SIGKILL to what still runs STOP_GRACE_S later. One difference, on purpose: the others get PEERS_SPEAK_S
    first, so that their own last words (a peer gone, where they waited) reach the failure message. At the
    deadline every rank still running is killed; return those ranks (stalled)."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            stop_after_failure(procs)
            return []
        time.sleep(0.02)
    stalled = [r for r, p in enumerate(procs) if p.poll() is None]
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    return stalled


def stop_after_failure(procs):
    """A rank failed: wait PEERS_SPEAK_S for the others to end by themselves, then stop them as torchrun does."""
    spoken = time.monotonic() + PEERS_SPEAK_S
    while any(p.poll() is None for p in procs) and time.monotonic() < spoken:
        time.sleep(0.02)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def failure_message(out: Path, texts, failed: dict, stalled, timeout) -> str:
    """failed: {rank: its exit code}, negative where a signal killed it."""
    def last_status(rank):
        where = out / f"rank{rank}.status"
        return where.read_text() if where.exists() else "(no status written)"

    def ended(code):
        return f"was killed by {signal.Signals(-code).name}" if code < 0 else "exited with an error"

    lines = [f"rank {rank} {ended(code)} at: {last_status(rank)}; last output:\n{tail(texts[rank])}"
             for rank, code in failed.items()]
    lines += [f"rank {rank} stalled for {timeout:.0f} s at: {last_status(rank)}; last output:\n{tail(texts[rank])}"
              for rank in stalled]
    return "\n".join(lines)


def tail(text: str, n: int = 15) -> str:
    """A rank's last words, indented: its last Python traceback in full (every frame and the exception's
    line), else its last n lines. Whatever follows the exception's line (a C++ stack trace under
    TORCH_SHOW_CPP_STACKTRACES=1, warnings at exit) is counted, not shown: it would push the frames out.
    A crash faulthandler reported shows its line and the crashed thread's frames (most recent first)."""
    lines = text.strip().splitlines()
    plain = [re.sub(r"^\[rank\d+\]: ?", "", line) for line in lines]  # torch's prefix on a rank's traceback
    starts = [i for i, line in enumerate(plain) if line.startswith("Traceback (most recent call last)")]
    crash = next((i for i in reversed(range(len(plain))) if plain[i].startswith("Fatal Python error:")), None)
    if crash is not None and (not starts or crash > starts[-1]):
        current = next((i for i in range(crash, len(plain)) if plain[i].startswith("Current thread")), len(plain))
        stop = next((i for i in range(current, len(plain)) if not plain[i].strip()), len(plain))
        return "\n".join("    " + line for line in [lines[crash], *lines[current:stop][:n]])
    end = next((i for i in range(starts[-1] + 1, len(plain)) if plain[i][:1] not in " \t"), None) if starts else None
    if end is None:
        return "\n".join("    " + line for line in lines[-n:])
    shown = lines[starts[-1]:end + 1]
    after = f"\n    ({len(lines) - end - 1} more lines)" if end + 1 < len(lines) else ""
    return "\n".join("    " + line for line in shown) + after


def run_cases(step_dir: Path, world: int, cases, out: Path, timeout: float = 240):
    """All `cases` (lists of flags) of one step and world size, in one process group.

    Returns {case index: None if it finished, else why not}: a failed launch fails the case it
    stopped in, and the cases after it were never run.
    """
    try:
        launch([sys.executable, str(WORKER), str(step_dir), str(out), json.dumps(cases)], world, out, timeout)
        return {i: None for i in range(len(cases))}
    except RunFailed as failure:
        done = [i for i in range(len(cases)) if case_finished(out / f"case{i}", world)]
        stopped = next((i for i in range(len(cases)) if i not in done), len(cases))
        never_run = f"not run: the launch stopped in the case [{' '.join(cases[min(stopped, len(cases) - 1)])}]"
        return {i: None if i in done else str(failure) if i == stopped else never_run for i in range(len(cases))}


def case_finished(case_dir: Path, world: int) -> bool:
    return (case_dir / "reference.pt").exists() and all((case_dir / f"rank{r}.pt").exists() for r in range(world))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error; where either holds inf or nan (an fp16 overflow), 0 if both hold the same values
    in the same places, bitwise, else inf (never nan, which would pass every `err > tol`)."""
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        same = torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
        return 0.0 if same else float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def compare_case(case_dir: Path, world: int, label: str, rtol: float = RTOL, weight_rtol: float = WEIGHT_RTOL,
                 reference: str = "reference.pt"):
    """Every mismatch between the ranks' results and the single-device reference, as text.

    Tensor-parallel shards are put back together (by name, along the dimension each was split on)
    and compared as whole parameters, one data-parallel replica at a time. rtol bounds the
    gradients, weight_rtol the weights (and step 07's fp32 masters) after three steps; 0 means
    bitwise. Step 07's loss scales must be the reference's, step by step, and step 08's global gradient norms
    with experts (the reference saves them). reference: which of the
    references check_equivalence.py saved (reference_microbatched.pt: computed microbatch by microbatch). A PipeDream
    run (its ranks saved their weight versions) ends on weights: its losses and weights are compared.
    """
    ref = torch.load(case_dir / reference)
    results = [torch.load(case_dir / f"rank{rank}.pt") for rank in range(world)]
    pipedream = all("versions" in got for got in results)  # its run ends on weights: no gradients to compare
    errors = []
    for rank, got in enumerate(results):
        for step, (loss, ref_loss) in enumerate(zip(got["losses"], ref["losses"])):
            if abs(loss - ref_loss) > max(RTOL, rtol) * abs(ref_loss):  # looser only where rtol is (TP in half)
                errors.append(f"{label}, rank {rank}: loss at step {step} is {loss:.8f}, reference {ref_loss:.8f}")
        errors += [f"{label}, rank {rank}: parameter {name} got no gradient"
                   for name in got["names"] if not pipedream and name not in got["grads"]]
    errors += [f"{label}, rank {rank}: loss scales {got['scales']}, reference {ref['scales']}"
               for rank, got in enumerate(results) if "scales" in ref and got["scales"] != ref["scales"]]
    errors += [f"{label}, rank {rank}: grad norm at step {step} is {norm:.8f}, reference {ref_norm:.8f}"
               for rank, got in enumerate(results) if "norms" in ref  # step 08's experts (moe_reference.py)
               for step, (norm, ref_norm) in enumerate(zip(got["norms"], ref["norms"]))
               if abs(norm - ref_norm) > rtol * ref_norm]
    kinds = ([] if pipedream else [("grads", rtol)]) + [("weights", weight_rtol)]
    kinds += [("masters", weight_rtol)] if "masters" in ref else []
    for what, tol in kinds:
        for (replica, name), tensor in whole_tensors(results, what, errors, label).items():
            err = rel_err(tensor, ref[what][name])
            if err > tol:
                errors.append(f"{label}, replica {replica}: {what[:-1]} of {name} "
                              f"has relative error {err:.2e} > {tol:.0e}")
    missing = sorted(set(ref["weights"]) - {name for got in results for name in got["names"]})
    if missing:
        errors.append(f"{label}: no rank holds parameters {missing}")
    return errors


def write_per_rank(found, out: str):
    """Rank side of a check script: gather every rank's findings, write them as one JSON list on rank 0."""
    import torch.distributed as dist

    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, found)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(per_rank, f)


def memory_report_problems(stdout: str, schedule: str, pp: int, dp: int, tp: int, m: int, v: int = 1, grid=None):
    """Where train.py's printed memory report, one row a rank, is not each rank's own stage's formula:
    rank r sits on stage r // (dp * tp) (Megatron-LM's order, TP fastest; grid(r) to test another order),
    and its row names that stage and prints formulas.peak_stored of it, beside the measured count."""
    import re

    grid = grid or (lambda r: r // (dp * tp))
    rows = re.findall(r"^  rank (\d+) \(stage (\d+)[^)]*\): (\d+) \(formula (\d+)\)", stdout, re.MULTILINE)
    problems = [] if len(rows) == pp * dp * tp else [f"{len(rows)} memory rows printed for {pp * dp * tp} ranks"]
    for rank, stage, measured, formula in (tuple(map(int, row)) for row in rows):
        expected = formulas.peak_stored(schedule, pp, grid(rank), m, v)
        if stage != grid(rank) or formula != expected or measured != expected:
            problems.append(f"rank {rank}: row says stage {stage}, formula {formula}, measured {measured}; "
                            f"it is stage {grid(rank)}, whose formula is {expected}")
    return problems


def throughput_problem(records, stdout: str, tokens_per_step: int):
    """Where tokens_per_s is not tokens_per_step (batch x seq_len) over the step's logged step_time_s: in a
    --log-json record, or in the step line rank 0 printed for it (tokens/s to the unit); None if nowhere."""
    lines = re.findall(r"^step +(\d+) .* (\d+) tokens/s", stdout, re.MULTILINE)
    printed = {int(step): int(rate) for step, rate in lines}
    for r in records:
        expected = tokens_per_step / r["step_time_s"]
        if abs(r["tokens_per_s"] - expected) > 1e-9 * expected:
            return f"step {r['step']}: logged {r['tokens_per_s']:.6g} tokens/s, {tokens_per_step} tokens over its " \
                   f"{r['step_time_s']:.6g} s are {expected:.6g}"
        if r["step"] not in printed or abs(printed[r["step"]] - expected) > 0.5 + 1e-9 * expected:
            return f"step {r['step']}: the step line says {printed.get(r['step'])} tokens/s, expected {expected:.0f}"
    return None


def memory_errors(case_dir: Path, world: int, label: str):
    """Each rank's measured peak of stored microbatches in step 0 against tests/formulas.py (from step 02)."""
    errors = []
    for rank in range(world):
        got = torch.load(case_dir / f"rank{rank}.pt")["memory"]
        if got is not None:
            expected = formulas.peak_stored(got["schedule"], got["pp"], got["stage"], got["m"], got["v"])
            if got["peak"] != expected:
                errors.append(f"{label}, rank {rank} (stage {got['stage']}): {got['peak']} microbatches stored "
                              f"at the peak, formula {expected}")
    return errors


def versions_errors(case_dir: Path, world: int, label: str):
    """PipeDream (step 04 on): every backward read the version its forward read, as each rank logged it;
    the peak of versions held is tests/formulas.py's. Nothing for the other schedules."""
    errors = []
    for rank in range(world):
        got = torch.load(case_dir / f"rank{rank}.pt")
        if "versions" not in got:
            continue
        forward = {entry[1]: entry[2] for entry in got["versions"]["log"] if entry[0] == "F"}
        errors += [f"{label}, rank {rank}: the backward of {entry[1]} read version {entry[2]}, its forward "
                   f"version {forward[entry[1]]}" for entry in got["versions"]["log"]
                   if entry[0] == "B" and entry[2] != forward[entry[1]]]
        v = got["versions"]
        expected = formulas.peak_versions(v["schedule"], v["vertical_sync"], v["pp"], v["stage"], v["steps"],
                                          v["stashing"])
        if v["peak"] != expected:
            errors.append(f"{label}, rank {rank}: {v['peak']} weight versions held at the peak, formula {expected}")
    return errors


def whole_tensors(results, what: str, errors: list, label: str) -> dict:
    """{(replica, name): tensor} of `what` ("grads" or "weights"), TP shards concatenated in TP order.

    Copies that must be bitwise equal, and are not, go to `errors`: a replicated parameter (a norm
    gain) on the TP ranks of a stage, and the two copies of a tied embedding (first and last stage).
    """
    shards = defaultdict(lambda: defaultdict(list))  # (replica, name) -> tp_rank -> copies
    split = {}
    for got in results:
        replica, tp_rank, _ = got["place"]
        for name, tensor in got[what].items():
            shards[replica, name][tp_rank].append(tensor)
            split[name] = got["splits"][name]
    whole = {}
    for (replica, name), by_tp_rank in shards.items():
        where = f"{label}, replica {replica}: {what[:-1]} of {name}"
        for tp_rank, copies in by_tp_rank.items():
            if any(not torch.equal(c, copies[0]) for c in copies[1:]):
                errors.append(f"{where}: its {len(copies)} copies on TP rank {tp_rank} differ")
        parts = [by_tp_rank[t][0] for t in sorted(by_tp_rank)]
        if split[name] is None and any(not torch.equal(p, parts[0]) for p in parts[1:]):
            errors.append(f"{where}: replicated, but not bitwise equal on the {len(parts)} TP ranks")
        whole[replica, name] = parts[0] if split[name] is None else torch.cat(parts, split[name])
    return whole

"""The GPU path's decisions, proven on a CPU: CUDA faked where a decision reads it, NCCL's own error texts.

  * the device is decided once per node, the same on every rank: --device cuda with fewer GPUs than the
    node's ranks refuses with one line, --device auto falls back to the CPU and its first rank says why; in a job
    of two nodes each node counts its own ranks (LOCAL_WORLD_SIZE), not the job's (WORLD_SIZE);
  * a step's clock is read after one synchronize of the GPU, outside the schedule, and only on CUDA;
  * gloo's and NCCL's timeout and closed-connection texts are told apart from any other error, which
    p2p._guarded raises with its own message (never as a deadlock);
  * NCCL starts eagerly (device_id) with PyTorch's one-time p2p serialisation warning switched off;
  * the ranks refuse to train on different corpora (tests/check_gpu_path.py runs the in-process checks);
  * with CUDA faked to show one GPU, the CPU suite's launches and the notebooks' run_train still run, on the CPU.

Each check is first shown to fail a planted wrong report (the controls), so that it cannot pass by accident.
"""
import json
import re
import sys

import pytest

from check_gpu_path import MESSAGES
from conftest import STEPS
import harness
from harness import REPO, RunFailed, launch
from test_train import train_py

TINY_RUN = ["--steps", "1", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
            "--timeout", "60"]
PIPEDREAM_STEPS = [s for s in STEPS if s >= "step04"]
P2P_STEPS = [s for s in STEPS if s >= "step03"]


@pytest.fixture(scope="module")
def reports(step_dirs):
    """report(step) -> what tests/check_gpu_path.py found in that step, run once per step."""
    cache = {}

    def report(step):
        if step not in cache:
            done = harness.run([sys.executable, str(REPO / "tests" / "check_gpu_path.py"), str(step_dirs[step])],
                               cwd=REPO, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr[-3000:]
            cache[step] = json.loads(done.stdout)
        return cache[step]

    return report


def device_problems(devices) -> list:
    """What is wrong with the per-rank device outcomes {"choice gpus local_world nodes local_rank": [outcome, notes]}:
    each node decides from its own GPUs and ranks, whatever the job's size."""
    problems, nodes = [], {}
    for key, (outcome, notes) in devices.items():
        choice, gpus, local_world, n_nodes, local_rank = key.split()
        nodes.setdefault((choice, int(gpus), int(local_world), int(n_nodes)), {})[int(local_rank)] = outcome, notes
    for (choice, gpus, local_world, n_nodes), ranks in nodes.items():
        name = f"--device {choice} on a node of {gpus} GPUs and {local_world} ranks, in a job of {n_nodes} node(s)"
        outcomes = {json.dumps([kind, re.sub(r" \(rank \d+\)$", "", what)]) for (kind, what), _ in ranks.values()}
        if len(outcomes) != 1:
            problems.append(f"{name}: the ranks decide differently: {sorted(outcomes)}")
            continue
        kind, what = json.loads(outcomes.pop())
        fits = 0 < gpus >= local_world
        if choice == "auto" and [kind, what] != ["device", "cuda" if fits else "cpu"]:
            problems.append(f"{name}: {kind} {what}, expected {'cuda' if fits else 'cpu'}")
        if choice == "cuda" and fits and [kind, what] != ["device", "cuda"]:
            problems.append(f"{name}: {kind} {what}, expected cuda")
        if choice == "cuda" and not fits and not (kind == "refused" and what.startswith("error: --device cuda")
                                                  and (gpus == 0 or f"{local_world} ranks" in what)):
            problems.append(f"{name}: {kind} {what}, expected one refusal line naming --device cuda and the ranks")
        falls_back = choice == "auto" and 0 < gpus < local_world
        for rank, (_, notes) in ranks.items():
            said = len(notes) == 1 and "--device auto" in notes[0] and f"{gpus} GPUs" in notes[0]
            if notes and not (falls_back and rank == 0 and said) or falls_back and rank == 0 and not said:
                problems.append(f"{name}: local rank {rank} printed {notes}")
    return problems


def timing_problems(calls, on_cuda: bool, step_calls) -> list:
    """What is wrong with the calls of two steps: each step's kernels must be waited for (one "sync") after its
    last work and before the clock stops, only on CUDA. step_calls: one step's calls on the CPU."""
    expected = []
    for call in step_calls:
        expected += ["sync"] if on_cuda and call == "clock" and expected.count("clock") % 2 else []
        expected.append(call)
    return [] if calls == expected else [f"calls {calls}, expected {expected}"]


STEP_CALLS = ["start_step", "clock", "compute", "optimizer", "clock", "end_step"]
PIPEDREAM_CALLS = ["warm_up", "start_recording", "clock", "begin_step", "schedule", "finish_sends", "clock",
                   "end_step", "share_loss", "share_loss"]


def fault_problems(kinds, guarded) -> list:
    """What is wrong with faults.kind_of's answers and p2p._guarded's exceptions for MESSAGES."""
    problems = [f"kind_of says {kinds.get(m)!r} of {m[:90]!r}, expected {k!r}" for m, k in MESSAGES.items()
                if kinds.get(m) != k]
    raised = {"gone": "PeerGone", "timeout": "PeerTimeout", None: "RuntimeError"}
    for message, kind in MESSAGES.items() if guarded else ():
        name, text = guarded[message]
        if name != raised[kind] or kind is None and text != message:
            problems.append(f"_guarded raised {name}({text[:80]!r}) for {message[:80]!r}, expected {raised[kind]}"
                            + (" with the message itself" if kind is None else ""))
    return problems


@pytest.mark.parametrize("step", STEPS)
def test_the_device_is_decided_once_per_node(step, reports):
    assert not device_problems(reports(step)["devices"]), "\n".join(device_problems(reports(step)["devices"]))


@pytest.mark.parametrize("step", STEPS)
def test_the_step_clock_waits_for_the_gpu_once(step, reports):
    timing = reports(step)["timing"]
    steps = (["reset_peak"] + STEP_CALLS) * 2
    problems = timing_problems(timing["cuda"], True, steps) + timing_problems(timing["cpu"], False, STEP_CALLS * 2)
    if step in PIPEDREAM_STEPS:
        problems += timing_problems(timing["pipedream cuda"], True, PIPEDREAM_CALLS)
        problems += timing_problems(timing["pipedream cpu"], False, PIPEDREAM_CALLS)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("step", STEPS)
def test_nccl_and_gloo_faults_are_told_from_other_errors(step, reports):
    report = reports(step)
    assert (step in P2P_STEPS) == bool(report["guarded"])
    assert not fault_problems(report["faults"], report["guarded"]), "\n".join(fault_problems(report["faults"],
                                                                                             report["guarded"]))


def nccl_problems(seen) -> list:
    """NCCL must start eagerly (device_id, so that the replay's in-order model is exact) with PyTorch's
    one-time serialisation warning switched off (distributed.py says why)."""
    expected = dict(backend="nccl", device_id="cuda:0", warning="0")
    return [] if seen == expected else [f"init_process_group saw {seen}, expected {expected}"]


@pytest.mark.parametrize("step", STEPS)
def test_nccl_starts_eagerly_without_the_serialisation_warning(step, reports):
    assert not nccl_problems(reports(step)["nccl"]), nccl_problems(reports(step)["nccl"])


def test_the_checks_fail_planted_wrong_reports():
    """Controls, each the behaviour before issue 40: ranks 2 and 3 of a 2-GPU node crash on 'invalid device
    ordinal' under --device auto; the clock stops before the GPU has finished; NCCL's timeout is not recognised
    and every error becomes a deadlock; every rank prints PyTorch's serialisation warning. And a node of a
    two-node job that counts the job's ranks as its own: it falls back to the CPU, or refuses, with GPUs enough."""
    good = {f"auto 2 4 1 {r}": [["device", "cpu"], [] if r else ["note: --device auto ... 2 GPUs ..."]]
            for r in range(4)}
    assert device_problems(good) == []
    crashed = dict(good, **{f"auto 2 4 1 {r}": [["crash", "CUDA error: invalid device ordinal"], []] for r in (2, 3)})
    assert device_problems(crashed)
    assert device_problems(dict(good, **{"auto 2 4 1 1": [["device", "cpu"], ["note: --device auto ... 2 GPUs ..."]]}))
    # two nodes of 4 GPUs and 4 ranks each, decided as if the node held the job's 8 ranks: CPU, and a refusal
    whole_job = {f"auto 4 4 2 {r}": [["device", "cpu"], [] if r else ["note: --device auto ... 4 GPUs ..."]]
                 for r in range(4)}
    assert device_problems(whole_job)
    assert device_problems({f"cuda 4 4 2 {r}": [["refused", "error: --device cuda needs a GPU for each of the 8 ranks "
                                                 "on this node, which has 4"], []] for r in range(4)})
    early_clock = (["reset_peak"] + STEP_CALLS) * 2
    assert timing_problems(early_clock, True, early_clock) and not timing_problems(STEP_CALLS, False, STEP_CALLS)
    twice = ["start_step", "clock", "compute", "sync", "optimizer", "sync", "clock", "end_step"]
    assert timing_problems(twice, True, STEP_CALLS)
    old_kinds = {m: ("gone" if "closed by peer" in m else "timeout" if "timed out" in m.lower() else None)
                 for m in MESSAGES}
    old_guarded = {m: (["PeerGone", "..."] if k == "gone" else ["PeerTimeout", "... waited in vain ..."])
                   for m, k in old_kinds.items()}
    assert fault_problems(old_kinds, {}) and fault_problems(dict(MESSAGES), old_guarded)
    assert nccl_problems(dict(backend="nccl", device_id="cuda:0", warning=None))


def corpus_launch(step_dir, folder, texts):
    """Two ranks (pp 2), rank r reading --data folder/corpus{r}.txt, which holds texts[r]: whether a rank failed,
    and the `error:` lines they printed."""
    folder.mkdir()
    for rank, text in enumerate(texts):
        (folder / f"corpus{rank}.txt").write_text(text)
    train = step_dir / "train.py"  # run as `python train.py ...`, with rank r's own --data: a warm start
    script = (f"import os, runpy, sys; sys.path[0] = {str(step_dir)!r}; sys.argv = [{str(train)!r}, '--device', "
              f"'cpu', *{TINY_RUN!r}, '--data', {str(folder)!r} + f'/corpus{{os.environ[\"RANK\"]}}.txt']; "
              f"runpy.run_path({str(train)!r}, run_name='__main__')")
    try:
        launch([sys.executable, "-c", script], 2, folder, timeout=120)
        failed = False
    except RunFailed:
        failed = True
    printed = "".join((folder / f"rank{r}.log").read_text() for r in range(2))
    return failed, [line for line in printed.splitlines() if line.startswith("error: ")]


@pytest.mark.parametrize("step", [STEPS[0], STEPS[-1]])
def test_ranks_refuse_to_train_on_different_corpora(step, step_dirs, tmp_path):
    """data.py and the line in train.train are the same in every step: the first and the last are launched.
    Two ranks on different --data texts end with one line that says so and the cure; the control, the same
    text on both, trains (before issue 40 the different texts trained too)."""
    text = "the same text on every rank. " * 200
    assert corpus_launch(step_dirs[step], tmp_path / "same", [text, text]) == (False, [])
    failed, errors = corpus_launch(step_dirs[step], tmp_path / "different", [text, text.upper()])
    assert failed and len(errors) == 1, errors
    assert "different corpora" in errors[0] and "give every node the same file" in errors[0], errors


FAKE_CUDA = '''import os
if os.environ.get("PP_FAKE_GPUS"):  # tests/test_gpu_path.py: torch.cuda as a node with that many GPUs shows it
    import torch
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: int(os.environ["PP_FAKE_GPUS"])
'''


@pytest.fixture
def one_fake_gpu(tmp_path, monkeypatch):
    """Every Python process started from here on sees one CUDA device (a sitecustomize on PYTHONPATH)."""
    site = tmp_path / "fake_cuda"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAKE_CUDA)
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("PP_FAKE_GPUS", "1")
    shown = harness.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                        capture_output=True, text=True, timeout=60)
    assert shown.stdout.strip() == "1", shown.stderr[-2000:]
    return tmp_path


def test_a_machine_with_one_gpu_runs_the_cpu_suite_unchanged(one_fake_gpu, step_dirs):
    """With CUDA faked to show one GPU, the suite's train.py launch (test_train.train_py) and a notebook's
    run_train run on the CPU as without it. Control: the same launch without --device cpu (as before issue 40)
    takes the one GPU, which this CPU build of torch does not have, and fails."""
    step_dir = step_dirs[STEPS[0]]
    out = one_fake_gpu / "suite"
    assert re.search(r"^step +0 +loss", train_py(step_dir, 1, *TINY_RUN, out=out), re.MULTILINE)
    workdir = one_fake_gpu / "notebook"
    workdir.mkdir()
    notebook = ("import sys; sys.path.insert(0, '.'); from support import plots; "
                f"print(plots.run_train(1, *{TINY_RUN!r}, workdir={str(workdir)!r}).records)")
    done = harness.run([sys.executable, "-c", notebook], cwd=step_dir, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "'loss'" in done.stdout, done.stderr[-3000:]
    with pytest.raises(RunFailed):
        launch([sys.executable, str(step_dir / "train.py"), *TINY_RUN], 1, one_fake_gpu / "control", timeout=120)

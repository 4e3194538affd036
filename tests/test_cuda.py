"""The CUDA tier: the GPU path, checked wherever GPUs exist; skipped without CUDA (all but the checks' controls).

    python tests/test_cuda.py        the whole tier, then a table: one row per test, its outcome and seconds

  * one GPU, every step's train.py at world size 1 (tests/check_cuda.py), fp32, and steps 07 and 08 also bf16 and
    fp16: every recorded step synchronizes once at start_step, once after the optimizer (the step's clock waits
    for the GPU: distributed.wait_for_device) and once at end_step, and reads the event stamps only after that;
    the step before (not recorded) waits for the GPU alone. The log's last record holds the rank's peak_mem_bytes;
    the trace holds the recorded steps. Control: a timeline that synchronizes at every span must fail.
  * one GPU, every step at world size 1 in fp32 (07, 08: bf16 and fp16 too), plain and with --recompute and
    --deallocate, against the CPU reference of tests/check_equivalence.py (GPU_TOLERANCES says why each bound).
  * two GPUs (NCCL): pp 2 with each schedule of steps 01-08 (PipeDream's included), --p2p ordered, bf16 and fp16
    messages, tp 2, dp 2, against the same reference, with each rank's peak of stored microbatches against the
    formula; with four GPUs also tp 2 x pp 2 with --scatter-gather. Step 08's experts: one GPU (every expert
    local), dp 2 x ep 2 (NCCL's all-to-all), and with four GPUs pp 2 x dp 2 x ep 2 under dualpipev. A checkpoint saved on two GPUs (pp 2) resumes
    on one (pp 1). A stalled peer: NCCL's watchdog aborts the waiting rank, or under TORCH_NCCL_BLOCKING_WAIT=1
    the rank ends with the course's one line (faults.py).
  * TF32 is switched off for every launch (tf32_off), whatever the environment says.

The checks of the logs and the tolerances are themselves checked, with and without CUDA.
"""
import json
import math
import os
import signal
import sys

import pytest
import torch

from conftest import STEPS
from fault_runs import fault_run
from harness import (REPO, RTOL, WEIGHT_RTOL, compare_case, launch, memory_errors, run_cases,
                     versions_errors)
from test_equivalence import PIPEDREAM, TINY, tolerances

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the GPU path is not checked here")
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"{torch.cuda.device_count()} CUDA devices, "
                              "fewer than the 2 an NCCL pipeline needs")
STEPS_RUN = 3  # step 0 unrecorded, steps 1 and 2 recorded
WAIT = ["sync", "distributed.py:wait_for_device"]  # the step's one wait for the GPU, before its clock stops (train.py)
HALF_STEPS = [s for s in STEPS if s >= "step07"]
RUNS = [(step, "fp32") for step in STEPS] + [(step, p) for step in HALF_STEPS for p in ("bf16", "fp16")]


def timeline_problems(report, steps: int):
    """What check_cuda.py's log shows wrong with the CUDA timeline of a run of `steps` steps (see its docstring)."""
    log, events, problems = report["log"], report["events"], []
    if not report["on_cuda"]:
        problems.append("the timeline did not record on CUDA")
    starts = [i for i, entry in enumerate(log) if entry[0] == "start"]
    recorded = [log[i][1] for i in starts if log[i][2]]
    if recorded != list(range(1, steps)):
        problems.append(f"steps recorded: {recorded}, expected 1..{steps - 1} (not the first)")
    for i in starts:
        _, step, enabled, started = log[i]
        end = next(k for k in range(i, len(log)) if log[k][0] == "end")
        ended = next(k for k in range(end, len(log)) if log[k][0] == "ended")
        inside, closing = log[i + 1:end], log[end + 1:ended]
        mine = [e for e in events if e["step"] == step]
        if not enabled:
            if inside != [WAIT] or closing:
                problems.append(f"step {step} is not recorded, yet: {inside + closing} (expected only the wait)")
            continue
        if inside != [["sync", "timeline.py:start_step"], WAIT]:
            problems.append(f"step {step}: between start_step and end_step {inside}, expected only start_step's "
                            f"synchronize and the step's one wait for the GPU (train.py, after the optimizer)")
        if closing != [["sync", "timeline.py:end_step"]] + [["read"]] * (2 * len(mine)):
            problems.append(f"step {step}: end_step did {closing[:4]}... ({len(closing)} calls), expected one "
                            f"synchronize, then 2 stamps read for each of its {len(mine)} events")
        outside = [e for e in mine if not started <= e["start"] <= e["end"] <= log[ended][2]]
        if outside:
            problems.append(f"step {step}: events outside the step on the wall clock: {outside[:3]}")
        kinds = {e["kind"] for e in mine}
        if "forward" not in kinds or not kinds & {"backward", "B"}:
            problems.append(f"step {step}: events of kinds {sorted(kinds)}, expected forwards and backwards")
    return problems


def log_problems(records, steps: int):
    """The --log-json of one CUDA rank: a record per step, finite losses, the last with its peaks."""
    problems = [] if [r["step"] for r in records] == list(range(steps)) else [f"steps logged: {records}"]
    problems += [f"step {r['step']}: loss {r['loss']}" for r in records if not math.isfinite(r["loss"])]
    last = records[-1] if records else {}
    peak = last.get("peak_mem_bytes")
    if not (isinstance(peak, list) and len(peak) == 1 and isinstance(peak[0], int) and peak[0] > 0):
        problems.append(f"peak_mem_bytes {peak}: expected one positive byte count")
    elif peak[0] < (last.get("peak_activation_bytes") or [0])[0]:
        problems.append(f"peak_mem_bytes {peak} below the stored activations {last['peak_activation_bytes']}")
    return problems


def check_cuda(step_dir, out, *flags, control=()):
    """The report of tests/check_cuda.py and the log and trace of train.py FLAGS on one GPU."""
    report, log, trace = out / "report.json", out / "log.jsonl", out / "trace.json"
    launch([sys.executable, str(REPO / "tests" / "check_cuda.py"), str(step_dir), str(report), *control, "--",
            "--device", "cuda", "--steps", str(STEPS_RUN), "--log-json", str(log), "--trace", str(trace), *flags],
           1, out, timeout=300)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return json.loads(report.read_text()), records, json.loads(trace.read_text())["traceEvents"]


@CUDA
@pytest.mark.parametrize("step, precision", RUNS, ids=[f"{s}:{p}" for s, p in RUNS])
def test_one_gpu_run_times_without_synchronizing(step, precision, step_dirs, tmp_path):
    flags = [] if step not in HALF_STEPS else ["--precision", precision]
    report, records, trace = check_cuda(step_dirs[step], tmp_path, *flags)
    problems = timeline_problems(report, STEPS_RUN) + log_problems(records, STEPS_RUN)
    traced = {e["args"]["step"] for e in trace if e["ph"] == "X"}
    if traced != set(range(1, STEPS_RUN)):
        problems.append(f"the trace holds steps {sorted(traced)}")
    assert not problems, "\n".join(problems)


@CUDA
def test_a_timeline_that_synchronizes_fails(step_dirs, tmp_path):
    report, _, _ = check_cuda(step_dirs[STEPS[-1]], tmp_path, control=["--synchronizing"])
    assert any("between start_step and end_step" in p for p in timeline_problems(report, STEPS_RUN)), report["log"]


def clean_report(steps: int = 3):
    """A log as check_cuda.py writes it for a correct timeline: one forward and one backward per recorded step."""
    log, events = [["start", 0, False, 0.0], WAIT, ["end", 0], ["ended", 0, 1.0]], []
    for step in range(1, steps):
        t = 10.0 * step
        events += [dict(kind="forward", step=step, start=t + 1, end=t + 2),
                   dict(kind="backward", step=step, start=t + 2, end=t + 4)]
        log += [["start", step, True, t], ["sync", "timeline.py:start_step"], WAIT, ["end", step],
                ["sync", "timeline.py:end_step"], *[["read"]] * 4, ["ended", step, t + 5]]
    return dict(log=log, events=events, on_cuda=True)


def broken(how):
    report = clean_report()
    log = report["log"]
    if how == "synchronize inside a step":
        log.insert(log.index(["end", 1]), ["sync", "timeline.py:span"])
    elif how == "a stamp read inside a step":
        log.insert(log.index(["end", 1]), ["read"])
    elif how == "an event after its step":
        report["events"][0]["end"] = 100.0
    elif how == "host clock":
        report["on_cuda"] = False
    elif how == "the first step recorded":
        log[0][2] = True
    elif how == "the clock read before the GPU finished":
        del log[log.index(["end", 1]) - 1]
    return report


@pytest.mark.parametrize("how", ["synchronize inside a step", "a stamp read inside a step", "an event after its step",
                                 "host clock", "the first step recorded", "the clock read before the GPU finished"])
def test_the_timeline_check_fails_a_broken_log(how):
    """Runs without CUDA too: the check passes a correct log and fails each broken one."""
    assert timeline_problems(clean_report(), 3) == []
    assert timeline_problems(broken(how), 3), how


def test_the_log_check_fails_a_missing_peak():
    good = [dict(step=0, loss=5.0), dict(step=1, loss=4.0, peak_mem_bytes=[2**20], peak_activation_bytes=[2**10])]
    assert log_problems(good, 2) == []
    for bad in ([None], [0], [2**9], []):  # a CPU run's None, nothing, less than the activations alone, no rank
        assert log_problems([good[0], dict(good[1], peak_mem_bytes=bad)], 2), bad


# GPU against the CPU reference (check_equivalence.py computes it on the CPU), (gradients, weights) per precision.
# fp32, TF32 off: GPU and CPU kernels sum in other orders, as pipelining reorders sums: harness's RTOL and
# WEIGHT_RTOL (both 1e-5, measured on CPUs only). Half precision: each matmul's fp32 sum is rounded to the half
# type once, and a sum in another order can round one unit in the last place apart: bf16 keeps 8 bits (4e-3),
# fp16 11 bits (5e-4), and a gradient passes about five roundings. Derived, not yet measured on a GPU: the
# tier's first run confirms them.
GPU_TOLERANCES = {"fp32": (RTOL, WEIGHT_RTOL), "bf16": (2e-2, 2e-2), "fp16": (5e-3, 5e-3)}
TF32_OFF = {"NVIDIA_TF32_OVERRIDE": "0", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "0"}  # whatever the container sets
FOUR_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 4, reason="fewer than the 4 CUDA devices of tp 2 x pp 2")


def precision_of(flags) -> str:
    return flags[flags.index("--precision") + 1] if "--precision" in flags else "fp32"


def gpu_tolerances(flags):
    """The looser of the GPU's (GPU_TOLERANCES) and the CPU test's own for these flags (TP in half precision)."""
    return tuple(max(a, b) for a, b in zip(GPU_TOLERANCES[precision_of(flags)], tolerances(flags)))


def gpu_case(step, world, *flags, marks=()):
    argv = [*TINY, *flags]
    argv[argv.index("--device") + 1] = "cuda"  # the worker joins NCCL when its cases run on CUDA
    return pytest.param(step, world, argv, id=f"{step}:{world}gpu:{' '.join(flags)}", marks=marks)


def memory_flags(step):
    """--recompute (step 02 on) and --deallocate (step 04 on): the memory-saving paths, on the GPU."""
    return [*(["--recompute"] if step >= "step02" else []), *(["--deallocate"] if step >= "step04" else [])]


ONE_GPU_CASES = [gpu_case(step, 1, "--pp", "1", "--layers", "4", *precision, *extra)
                 for step in STEPS for precision in ([[]] + [["--precision", p] for p in ("bf16", "fp16")]
                                                     if step in HALF_STEPS else [[]])
                 for extra in dict.fromkeys(map(tuple, ([], memory_flags(step))))]  # step 01 has neither
PP2 = ["--pp", "2", "--layers", "4", "--microbatches", "4"]
SCHEDULES = {"step04_1f1b": ["afab", "1f1b"], "step05_interleaved": ["afab", "1f1b", "interleaved"]}
SCHEDULES.update({step: SCHEDULES["step05_interleaved"] for step in ("step06_tp", "step07_mixed_precision")})
SCHEDULES["step08_dualpipe"] = SCHEDULES["step05_interleaved"] + ["zb1p", "dualpipe", "dualpipev"]
LAST = STEPS[-1]
TWO_GPU_CASES = [
    gpu_case(STEPS[0], 2, "--pp", "2", "--layers", "4"),
    gpu_case(STEPS[1], 2, *PP2, "--recompute"),
    gpu_case(STEPS[2], 2, *PP2), gpu_case(STEPS[2], 2, "--pp", "1", "--dp", "2", "--layers", "4"),
    *[gpu_case(step, 2, *PP2, "--schedule", s, *(["--virtual-stages", "2"] if s == "interleaved" else []))
      for step, names in SCHEDULES.items() for s in names],
    *[gpu_case(step, 2, "--pp", "2", *PIPEDREAM, "--schedule", s) for step in SCHEDULES
      for s in ("pipedream", "pipedream-2bw")],
    *[gpu_case(step, 2, *PP2, "--p2p", "ordered", *memory_flags(step)) for step in ("step04_1f1b", LAST)],
    *[gpu_case(step, 2, *PP2, "--precision", p) for step in HALF_STEPS for p in ("bf16", "fp16")],
    gpu_case("step06_tp", 2, "--tp", "2", "--pp", "1", "--layers", "4"),
    gpu_case(LAST, 2, "--tp", "2", "--pp", "1", "--layers", "4", "--precision", "bf16"),
    gpu_case(LAST, 2, "--dp", "2", "--pp", "1", "--layers", "4", "--microbatches", "2", "--precision", "fp16"),
    *[gpu_case(step, 4, "--tp", "2", *PP2, "--scatter-gather", *p, marks=FOUR_GPUS)
      for step, p in (("step06_tp", []), (LAST, ["--precision", "bf16"]))],
    # Step 08's experts (experts.py): NCCL's all_to_all_single with uneven splits, against moe_reference.py.
    gpu_case(LAST, 2, "--dp", "2", "--pp", "1", "--layers", "4", "--microbatches", "2", "--experts", "4",
             "--top-k", "2", "--ep", "2"),
    gpu_case(LAST, 4, *PP2, "--dp", "2", "--experts", "4", "--top-k", "2", "--ep", "2", "--schedule", "dualpipev",
             marks=FOUR_GPUS),
]
ONE_GPU_CASES.append(gpu_case(LAST, 1, "--pp", "1", "--layers", "4", "--experts", "4", "--top-k", "2"))


@pytest.fixture(scope="module")
def tf32_off():
    """Every launch of this module with TF32 switched off in cuBLAS, whatever the environment says (a container
    may force it): the CPU reference has no TF32, and fp32's tolerance assumes none. The control of the CPU test:
    set NVIDIA_TF32_OVERRIDE=1 before pytest, and the environment still says 0 inside the module."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in TF32_OFF.items():
            patch.setenv(name, value)
        yield


@pytest.fixture(scope="module")
def gpu_results(step_dirs, tmp_path_factory, tf32_off):
    """{(step, flags): (case folder, failure)}: the cases of each step and GPU count in one launch."""
    results = {}
    for step, world in dict.fromkeys((p.values[0], p.values[1]) for p in ONE_GPU_CASES + TWO_GPU_CASES):
        if torch.cuda.device_count() < world:
            continue
        cases = [p.values[2] for p in ONE_GPU_CASES + TWO_GPU_CASES if p.values[:2] == (step, world)]
        out = tmp_path_factory.mktemp(f"gpu{world}-{step}")
        failures = run_cases(step_dirs[step], world, cases, out, timeout=120 + 30 * len(cases))
        results.update({(step, tuple(c)): (out / f"case{i}", failures[i]) for i, c in enumerate(cases)})
    return results


def gpu_case_errors(step, world, flags, gpu_results):
    case_dir, failure = gpu_results[step, tuple(flags)]
    label = f"{step} on {world} GPUs [{' '.join(flags[len(TINY):])}]"
    if failure is not None:
        return [f"{label}: {failure}"]
    errors = compare_case(case_dir, world, label, *gpu_tolerances(flags))
    return errors + memory_errors(case_dir, world, label) + versions_errors(case_dir, world, label)


@CUDA
@pytest.mark.parametrize("step, world, flags", ONE_GPU_CASES)
def test_one_gpu_matches_the_cpu_reference(step, world, flags, gpu_results):
    errors = gpu_case_errors(step, world, flags, gpu_results)
    assert not errors, "\n".join(errors[:25])


@CUDA
@TWO_GPUS
@pytest.mark.parametrize("step, world, flags", TWO_GPU_CASES)
def test_nccl_pipeline_matches_the_cpu_reference(step, world, flags, gpu_results):
    errors = gpu_case_errors(step, world, flags, gpu_results)
    assert not errors, "\n".join(errors[:25])


def test_the_tolerances_and_the_tf32_switch(tf32_off):
    """Runs without CUDA: half precision is held looser than fp32, TP in half no tighter than on the CPU, and
    within this module the launches' environment has TF32 off, also where it was forced on before."""
    assert gpu_tolerances(TINY) == (RTOL, WEIGHT_RTOL)
    assert gpu_tolerances([*TINY, "--precision", "fp16"]) == (5e-3, 5e-3)
    assert gpu_tolerances([*TINY, "--tp", "2", "--precision", "fp16"]) == (2e-2, 2e-2)
    assert all(os.environ[name] == "0" for name in TF32_OFF)


def train_on_gpus(step_dir, world, out, *flags, env=()):
    """train.py on `world` GPUs with a small model; the records of its --log-json."""
    log = out / "log.jsonl"
    with pytest.MonkeyPatch.context() as patch:
        for name, value in dict(env).items():
            patch.setenv(name, value)
        launch([sys.executable, str(step_dir / "train.py"), "--device", "cuda", *SMALL, "--log-json", str(log), *flags],
               world, out, timeout=180)
    return [json.loads(line) for line in log.read_text().splitlines()]


SMALL = ["--hidden", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "8", "--layers", "4", "--timeout", "60"]


@CUDA
@TWO_GPUS
def test_a_checkpoint_saved_on_two_gpus_resumes_on_one(step_dirs, tmp_path, tf32_off):
    """pp 2 on two GPUs saves after 2 steps; one GPU (pp 1) resumes it for steps 2 and 3 only, whose losses are
    those of 4 uninterrupted steps on two GPUs (fp32: RTOL). A resume that lost the optimizer's state would differ
    (tests/test_checkpoints.py's control shows it on the CPU)."""
    step_dir, save = step_dirs[LAST], tmp_path / "save"
    whole = train_on_gpus(step_dir, 2, tmp_path / "whole", "--pp", "2", "--steps", "4")
    train_on_gpus(step_dir, 2, tmp_path / "first", "--pp", "2", "--steps", "2", "--save", str(save))
    resumed = train_on_gpus(step_dir, 1, tmp_path / "resumed", "--pp", "1", "--steps", "4", "--resume", str(save))
    assert [r["step"] for r in resumed] == [2, 3], resumed
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in whole[2:]], rel=RTOL, abs=0)


@CUDA
@TWO_GPUS
@pytest.mark.parametrize("blocking", [False, True], ids=["watchdog", "blocking-wait"])
def test_a_stalled_peer_on_nccl(blocking, step_dirs, tmp_path, monkeypatch):
    """kill -STOP of rank 1 (pp 2) on NCCL. By default NCCL's watchdog gives up after --timeout, logs 'Watchdog
    caught collective operation timeout' and aborts rank 0 (no one line: the host never waits in Python). With
    TORCH_NCCL_BLOCKING_WAIT=1, work.wait() blocks the host and raises that text, and rank 0 ends with the
    course's one line naming rank 1 (faults.py)."""
    if blocking:
        monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    cmd = [sys.executable, str(step_dirs[LAST] / "train.py"), "--device", "cuda", *SMALL[:-2], "--timeout", "4",
           "--steps", "100000", "--pp", "2", "--log-json", str(tmp_path / "log.jsonl")]
    run = fault_run(cmd, 2, tmp_path, signal.SIGSTOP, 1, 120, 64)
    assert not run.problem, run.problem
    err = (tmp_path / "rank0.err").read_text()
    if blocking:
        last = err.strip().splitlines()[-1]
        assert run.returncodes[0] == 1 and last.startswith("error: ") and "rank 1 stalled" in last, err[-2000:]
    else:
        assert run.returncodes[0] != 0 and "Watchdog caught collective operation timeout" in err, err[-2000:]


class Table:
    """A pytest plugin that prints one row per test of the tier: its outcome and seconds."""

    def __init__(self):
        self.rows = []

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            self.rows.append((report.nodeid.split("::")[-1], report.outcome, report.duration))

    def pytest_sessionfinish(self):
        width = max([len(name) for name, _, _ in self.rows] + [4])
        print(f"\n{'test':<{width}}  outcome   seconds")
        for name, outcome, seconds in self.rows:
            print(f"{name:<{width}}  {outcome:<8}  {seconds:7.1f}")


if __name__ == "__main__":  # the whole CUDA tier, one command: python tests/test_cuda.py
    sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"], plugins=[Table()]))

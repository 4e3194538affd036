"""The GPU path, checked wherever a GPU exists; skipped without CUDA (all but the checks' own controls).

    pytest tests/test_cuda.py

  * every step's train.py on one GPU (world size 1) in fp32, and steps 07 and 08 also in bf16 and fp16, with
    --trace and --log-json, run by tests/check_cuda.py, which logs every torch.cuda.synchronize (and its caller),
    every reading of a CUDA event's stamp, and the timeline's start_step and end_step. In every recorded step
    the timeline synchronizes once at start_step and once at end_step and nowhere in between, reads the stamps
    only after end_step's synchronize (two per event), and each event lies inside its step on the wall clock;
    the step before (not recorded) neither synchronizes nor reads. The log's last record holds the rank's
    peak_mem_bytes, at least its peak of stored activations; the trace holds the recorded steps. Control: a
    timeline that synchronizes at every span must fail the check.
  * with 2 or more GPUs, a 2-rank NCCL pipeline of each schedule (step 01's naive, step 02's GPipe, and step
    08's afab, 1f1b, interleaved, PipeDream, PipeDream-2BW, zb1p, DualPipe, DualPipeV) against the
    single-device reference of tests/check_equivalence.py (on the CPU, so held to fp32's 1e-5, weights 1e-4), with each
    rank's peak of stored microbatches against the formula: the equivalence test's harness, on CUDA.

The checks of the logs are themselves checked on hand-made logs, with and without CUDA.
"""
import json
import math
import sys

import pytest
import torch

from conftest import STEPS
from harness import REPO, RTOL, WEIGHT_RTOL, compare_case, launch, memory_errors, run_cases, versions_errors
from test_equivalence import PIPEDREAM, TINY

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the GPU path is not checked here")
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"{torch.cuda.device_count()} CUDA devices, "
                              "fewer than the 2 an NCCL pipeline needs")
STEPS_RUN = 3  # step 0 unrecorded, steps 1 and 2 recorded
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
            if inside or closing:
                problems.append(f"step {step} is not recorded, yet: {inside + closing}")
            continue
        if inside != [["sync", "timeline.py:start_step"]]:
            problems.append(f"step {step}: between start_step and end_step {inside}, expected only start_step's "
                            f"synchronize")
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
    log, events = [["start", 0, False, 0.0], ["end", 0], ["ended", 0, 1.0]], []
    for step in range(1, steps):
        t = 10.0 * step
        events += [dict(kind="forward", step=step, start=t + 1, end=t + 2),
                   dict(kind="backward", step=step, start=t + 2, end=t + 4)]
        log += [["start", step, True, t], ["sync", "timeline.py:start_step"], ["end", step],
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
    return report


@pytest.mark.parametrize("how", ["synchronize inside a step", "a stamp read inside a step", "an event after its step",
                                 "host clock", "the first step recorded"])
def test_the_timeline_check_fails_a_broken_log(how):
    """Runs without CUDA too: the check passes a correct log and fails each broken one."""
    assert timeline_problems(clean_report(), 3) == []
    assert timeline_problems(broken(how), 3), how


def test_the_log_check_fails_a_missing_peak():
    good = [dict(step=0, loss=5.0), dict(step=1, loss=4.0, peak_mem_bytes=[2**20], peak_activation_bytes=[2**10])]
    assert log_problems(good, 2) == []
    for bad in ([None], [0], [2**9], []):  # a CPU run's None, nothing, less than the activations alone, no rank
        assert log_problems([good[0], dict(good[1], peak_mem_bytes=bad)], 2), bad


def nccl_case(step, *flags):
    argv = [*TINY, *flags]
    argv[argv.index("--device") + 1] = "cuda"  # the worker joins NCCL when its cases run on CUDA
    return pytest.param(step, argv, id=f"{step}:{' '.join(flags)}")


LAST = STEPS[-1]
NCCL_CASES = [
    nccl_case(STEPS[0], "--pp", "2", "--layers", "4"),
    nccl_case(STEPS[1], "--pp", "2", "--layers", "4", "--microbatches", "4"),
    *[nccl_case(LAST, "--pp", "2", "--layers", "4", "--microbatches", "4", "--schedule", schedule, *extra)
      for schedule, extra in [("afab", []), ("1f1b", []), ("interleaved", ["--virtual-stages", "2"]), ("zb1p", []),
                              ("dualpipe", []), ("dualpipev", [])]],
    *[nccl_case(LAST, "--pp", "2", *PIPEDREAM, "--schedule", schedule) for schedule in ("pipedream", "pipedream-2bw")],
]


@pytest.fixture(scope="module")
def nccl_results(step_dirs, tmp_path_factory):
    """{flags: (case folder, failure)}: each step's cases in one launch of 2 ranks, one GPU each."""
    results = {}
    for step in dict.fromkeys(p.values[0] for p in NCCL_CASES):
        cases = [p.values[1] for p in NCCL_CASES if p.values[0] == step]
        out = tmp_path_factory.mktemp(f"nccl-{step}")
        failures = run_cases(step_dirs[step], 2, cases, out, timeout=120 + 30 * len(cases))
        results.update({(step, tuple(c)): (out / f"case{i}", failures[i]) for i, c in enumerate(cases)})
    return results


@CUDA
@TWO_GPUS
@pytest.mark.parametrize("step, flags", NCCL_CASES)
def test_nccl_pipeline_matches_single_device(step, flags, nccl_results):
    case_dir, failure = nccl_results[step, tuple(flags)]
    label = f"{step} on 2 GPUs [{' '.join(flags[len(TINY):])}]"
    assert failure is None, f"{label}: {failure}"
    errors = compare_case(case_dir, 2, label, RTOL, WEIGHT_RTOL) + memory_errors(case_dir, 2, label)
    errors += versions_errors(case_dir, 2, label)
    assert not errors, "\n".join(errors[:25])

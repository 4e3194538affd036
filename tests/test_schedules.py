"""Schedules checked two ways: replayed without a model (order, deadlock freedom) and by measured memory."""
import json
import subprocess
import sys

import pytest

from conftest import STEPS
from harness import REPO, launch

SCHEDULED = [s for s in STEPS if s >= "step04"]  # steps whose schedule.py offers a choice of schedules


@pytest.mark.parametrize("step", SCHEDULED)
def test_schedule_order_is_complete_and_deadlock_free(step, step_dirs):
    done = subprocess.run([sys.executable, str(REPO / "tests" / "replay.py"), str(step_dirs[step])],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["configurations"] >= 1000, report
    assert report["send_first_deadlocks"], "the simulator failed to see the deadlock of send-first ordering"
    assert not report["problems"], "\n".join(report["problems"])


def stored_microbatches(schedule: str, pp: int, stage: int, m: int, v: int) -> int:
    """Peak (virtual) microbatches of activations a stage holds: all m for AFAB, the pipeline depth
    below it for 1F1B, the warm-up forwards plus one for interleaved 1F1B."""
    if schedule == "afab":
        return m
    if schedule == "1f1b":
        return min(pp - stage, m)
    return min(2 * (pp - stage - 1) + (v - 1) * pp + 1, v * m)


MEMORY_CASES = [(step, "afab", 4, 1, 8, 1) for step in SCHEDULED] + [
    (step, "1f1b", pp, dp, m, 1) for step in SCHEDULED for pp, dp, m in [(4, 1, 8), (4, 1, 2), (2, 2, 4)]] + [
    (step, "interleaved", pp, dp, m, v) for step in SCHEDULED if step >= "step05"
    for pp, dp, m, v in [(4, 1, 8, 2), (2, 2, 2, 2), (2, 1, 4, 3)]]


@pytest.mark.parametrize("step, schedule, pp, dp, m, v", MEMORY_CASES)
def test_measured_peak_activations_match_formula(step, schedule, pp, dp, m, v, step_dirs, tmp_path):
    """And with dp > 1: each rank all-reduces its gradients once per step, after its last backward."""
    log, trace = tmp_path / "log.jsonl", tmp_path / "trace.json"
    flags = ["--device", "cpu", "--pp", str(pp), "--dp", str(dp), "--schedule", schedule, "--microbatches", str(m),
             "--batch-size", str(dp * m), "--layers", "8", "--hidden", "32", "--heads", "2", "--seq-len", "16",
             "--steps", "2", "--deallocate", "--log-json", str(log), "--trace", str(trace), "--timeout", "60"]
    if v > 1:
        flags += ["--virtual-stages", str(v)]
    launch([sys.executable, str(step_dirs[step] / "train.py"), *flags], pp * dp, tmp_path, timeout=120)
    record = json.loads(log.read_text().splitlines()[-1])
    expected = [stored_microbatches(schedule, pp, rank // dp, m, v) for rank in range(pp * dp)]
    assert record["peak_stored_microbatches"] == expected
    assert all(b > 0 for b in record["peak_activation_bytes"])
    if dp > 1:
        boxes = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
        for rank in range(pp * dp):
            for step in range(2):
                mine = [e for e in boxes if e["tid"] == rank and e["args"]["step"] == step]
                syncs = [e for e in mine if e["cat"] == "allreduce"]
                last_backward = max(e["ts"] + e["dur"] for e in mine if e["cat"] == "backward")
                assert len(syncs) == 1 and syncs[0]["ts"] >= last_backward, (rank, step, syncs)

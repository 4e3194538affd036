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


def stored_microbatches(schedule: str, pp: int, stage: int, m: int) -> int:
    """Peak microbatches of activations a stage holds: all m for AFAB, the pipeline depth below it for 1F1B."""
    return m if schedule == "afab" else min(pp - stage, m)


@pytest.mark.parametrize("step", SCHEDULED)
@pytest.mark.parametrize("schedule, pp, dp, m", [("afab", 4, 1, 8), ("1f1b", 4, 1, 8), ("1f1b", 4, 1, 2),
                                                 ("1f1b", 2, 2, 4)])
def test_measured_peak_activations_match_formula(step, schedule, pp, dp, m, step_dirs, tmp_path):
    log = tmp_path / "log.jsonl"
    flags = ["--device", "cpu", "--pp", str(pp), "--dp", str(dp), "--schedule", schedule, "--microbatches", str(m),
             "--batch-size", str(dp * m), "--layers", "4", "--hidden", "32", "--heads", "2", "--seq-len", "16",
             "--steps", "2", "--deallocate", "--log-json", str(log), "--timeout", "60"]
    launch([sys.executable, str(step_dirs[step] / "train.py"), *flags], pp * dp, tmp_path, timeout=120)
    record = json.loads(log.read_text().splitlines()[-1])
    expected = [stored_microbatches(schedule, pp, rank // dp, m) for rank in range(pp * dp)]
    assert record["peak_stored_microbatches"] == expected
    assert all(b > 0 for b in record["peak_activation_bytes"])

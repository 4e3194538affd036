"""The measurements the course reports, held to account: known answers, and PyTorch's own pipelining.

check_measures.py runs each step's bubble computation, activation meter and deallocation on inputs
whose answers are known by hand. torch_pp.py runs the step's schedules beside
torch.distributed.pipelining on the same model, weights and batch.
"""
import json
import subprocess
import sys

import pytest

from conftest import STEPS
from harness import REPO, launch


@pytest.mark.parametrize("step", STEPS)
def test_measuring_code_gives_known_answers(step, step_dirs):
    done = subprocess.run([sys.executable, str(REPO / "tests" / "check_measures.py"), str(step_dirs[step])],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert len(report) >= 2 and not any(report.values()), report
    assert step < "step02" or "meter" in report, f"{step}: the activation meter (support/memory.py) went unchecked"


STEP = "step05_interleaved"  # the last step with just the three classic schedules
TORCH_CASES = [(STEP, "afab", []), (STEP, "1f1b", []), (STEP, "interleaved", ["--virtual-stages", "2"])]
TORCH_CASES += [(step, name, []) for step in STEPS if step >= "step08" for name in ("zb1p", "dualpipev")]


def torch_pp(step_dirs, tmp_path, mode, schedule, extra, step=STEP):
    """Rank 0's report of tests/torch_pp.py on 2 processes (m = 8: a power of two, see its docstring)."""
    out = tmp_path / "report.json"
    flags = ["--device", "cpu", "--schedule", schedule, *extra, "--microbatches", "8", "--batch-size", "16",
             "--layers", "8", "--hidden", "64", "--heads", "4", "--seq-len", "32", "--timeout", "60"]
    launch([sys.executable, str(REPO / "tests" / "torch_pp.py"), str(step_dirs[step]), mode, str(out), *flags],
           2, tmp_path, timeout=120)
    return json.loads(out.read_text())


@pytest.mark.parametrize("step, schedule, extra", TORCH_CASES, ids=[f"{c[0]}:{c[1]}" for c in TORCH_CASES])
def test_gradients_bitwise_equal_to_torch_pipelining(step, schedule, extra, step_dirs, tmp_path, replay_passes):
    replay_passes(step, schedule)
    report = torch_pp(step_dirs, tmp_path, "grads", schedule, extra, step)
    assert all(rank["bitwise"] for rank in report["ranks"]), report


def test_torch_comparison_can_fail(step_dirs, tmp_path):
    """Negative control: torch's schedule on the next batch must not match ours."""
    report = torch_pp(step_dirs, tmp_path, "control", "1f1b", [])
    assert not any(rank["bitwise"] for rank in report["ranks"]), report

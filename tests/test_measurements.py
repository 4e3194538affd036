"""The measurements the course reports, held to account: known answers, and PyTorch's own pipelining.

check_measures.py runs each step's bubble computation, activation meter and deallocation on inputs
whose answers are known by hand. torch_pp.py runs the step's schedules beside
torch.distributed.pipelining on the same model, weights and batch.
"""
import json
import shutil
import sys

import pytest

from conftest import STEPS
import harness
from harness import REPO, launch


TIMELINE = "support/timeline.py"  # the step's module whose COMPUTE lists the kinds of box the bubble counts as busy
SPLIT_STEPS = [step for step in STEPS if step >= "step08"]  # the backward split into B and W


def measures(step_dir):
    """The JSON report of tests/check_measures.py on a step folder."""
    done = harness.run([sys.executable, str(REPO / "tests" / "check_measures.py"), str(step_dir)],
                       capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("step", STEPS)
def test_measuring_code_gives_known_answers(step, step_dirs):
    report = measures(step_dirs[step])
    assert len(report) >= 2 and not any(report.values()), report
    assert ("split_bubble" in report) == ("w_in_its_box" in report) == (step in SPLIT_STEPS), report
    assert step < "step02" or "meter" in report, f"{step}: the activation meter (support/memory.py) went unchecked"


@pytest.mark.parametrize("step", SPLIT_STEPS)
def test_bubble_of_a_split_backward_counts_w_as_busy(step, step_dirs, tmp_path):
    """The control of the split bubble check: a copy of the step whose timeline no longer lists W among the
    compute kinds (one line planted at the end of its timeline module) must fail it. The check runs because
    the step splits its backward (weight_grad_store.py), not because the list under test names W."""
    planted = tmp_path / step
    shutil.copytree(step_dirs[step], planted, ignore=shutil.ignore_patterns("notebook.ipynb", "__pycache__"))
    with open(planted / TIMELINE, "a") as module:
        module.write('\nCOMPUTE = tuple(kind for kind in COMPUTE if kind != "W")  # planted: W is idle time\n')
    problem = measures(planted).get("split_bubble")
    assert problem and "expected [0.75]" in problem, problem


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

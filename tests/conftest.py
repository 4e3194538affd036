"""Pytest options shared by every test file.

    pytest --step-dir step02_gpipe=~/my_gpipe

points the tests of step 02 at your own copy of that folder (see tests/README.md,
"The tests as exercises"). The option can be given once per step.
"""
import json
import sys
from pathlib import Path

import pytest

import harness
from replay_report import report_failures

REPO = Path(__file__).resolve().parent.parent
STEPS = sorted(p.name for p in REPO.glob("step0*") if p.is_dir())


def pytest_addoption(parser):
    parser.addoption("--step-dir", action="append", default=[], metavar="STEP=PATH",
                     help="test PATH in place of the course's folder STEP (e.g. step02_gpipe=../mine)")


def pytest_configure(config):
    config.addinivalue_line("markers", "exercise_proofs: the launches that prove every exercise "
                                       "(tests/test_exercises.py); run with -m exercise_proofs, as CI does once")
    overrides = {}
    for item in config.getoption("--step-dir"):
        name, sep, path = item.partition("=")
        if not sep or name not in STEPS:
            raise pytest.UsageError(f"--step-dir {item} must be STEP=PATH with STEP one of {', '.join(STEPS)}")
        folder = Path(path).expanduser().resolve()
        if not (folder / "train.py").is_file():
            raise pytest.UsageError(f"--step-dir {item}: {folder} has no train.py")
        overrides[name] = folder
    config.step_dirs = {name: overrides.get(name, REPO / name) for name in STEPS}


@pytest.fixture(scope="session")
def step_dirs(request):
    """Folder to test for each step name: the course's own, or the learner's copy."""
    return request.config.step_dirs


@pytest.fixture(scope="session")
def replay_report(step_dirs):
    """report(step) -> the JSON report of tests/replay.py on that step (run once), or None before step 04."""
    cache = {}

    def report(step):
        if step not in cache:
            if not (step_dirs[step] / "schedule.py").exists() or step < "step04":
                cache[step] = None
            else:
                done = harness.run([sys.executable, str(REPO / "tests" / "replay.py"), "--json",
                                    str(step_dirs[step])], capture_output=True, text=True, timeout=120)
                assert done.returncode in (0, 1), done.stderr[-3000:]  # 1: the report holds problems
                cache[step] = json.loads(done.stdout)
        return cache[step]

    return report


@pytest.fixture(scope="session")
def replay_at_fault(replay_report):
    """at_fault(step, schedule): whether the step's replay found a problem that concerns `schedule`
    (replay_report.main says which schedules each failure concerns)."""

    def at_fault(step, schedule) -> bool:
        report = replay_report(step)
        return bool(report) and schedule in report["schedules_at_fault"]

    return at_fault


@pytest.fixture(scope="session")
def replay_passes(replay_report, replay_at_fault, step_dirs):
    """check(step, schedule): fail at once, without launching processes, if the replay finds `schedule` at
    fault. A bug in one schedule leaves the tests of the step's other schedules to run."""

    def check(step, schedule):
        if replay_at_fault(step, schedule):
            report, folder = replay_report(step), step_dirs[step]
            shown = folder.relative_to(Path.cwd()) if folder.is_relative_to(Path.cwd()) else folder
            mine = [p for p in report["problems"] if p.startswith(f"{schedule} ")]
            first = (mine or report["problems"] or report_failures(report))[0]  # PipeDream's: 1F1B's first
            pytest.fail(f"{step}: the schedule replay fails for {schedule}, so no process is launched; first "
                        f"problem: {first} (run: python tests/replay.py {shown})", pytrace=False)

    return check

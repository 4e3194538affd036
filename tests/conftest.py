"""Pytest options shared by every test file.

    pytest --step-dir step02_gpipe=~/my_gpipe

points the tests of step 02 at your own copy of that folder (see README,
"The tests as exercises"). The option can be given once per step.
"""
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STEPS = sorted(p.name for p in REPO.glob("step0*") if p.is_dir())


def pytest_addoption(parser):
    parser.addoption("--step-dir", action="append", default=[], metavar="STEP=PATH",
                     help="test PATH in place of the course's folder STEP (e.g. step02_gpipe=../mine)")


def pytest_configure(config):
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

"""How each kind of exercise check runs on a learner's copy, and what its failure prints (tests/exercise.py).

A check is the course's own test of the function: the replay of the schedules without a model, the verbs on a
fake transport, a small run against the single device (tests/check_exercises.py), the lab on a design
challenge's list (tests/lab.py), or the step's own tests under pytest. Each runs in a process of its own
(warm.py), with no colour and a fixed width, so that what it prints reads the same in a terminal and in Jupyter.
"""
import json
import os
import re
import sys
from pathlib import Path

import warm

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
# What a check prints must not depend on the terminal or on Jupyter (whose kernels set FORCE_COLOR=1).
PLAIN = {"NO_COLOR": "1", "COLUMNS": "120", "TERM": "dumb"}
COLOUR_VARIABLES = ("FORCE_COLOR", "PY_COLORS", "CLICOLOR_FORCE")
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
SUMMARY = re.compile(r"=+ short test summary info =+$|!{3,} |\d+ (failed|error)")  # where pytest's report ends


def check_name(check, step):
    """What a check is, in the words `check` prints beside ok or FAIL."""
    kind = check[0]
    if kind == "replay":
        return f"replay of {', '.join(check[1])}" + (f" and {check[2]}" if len(check) > 2 else "") + \
            " (no model; pp <= 4, m <= 8)"
    if kind == "equivalence":
        return f"equivalence, {check[1]} ranks [{' '.join(check[2])}] against one device"
    if kind == "verbs":
        return "each verb alone on a fake transport (stages 0-3 of 4)"
    if kind == "lab":
        return "the lab: validation, replay, ideal idle, peaks, the drawing beside your list, the target" + \
            ("" if "--no-run" in check else ", then a gloo run against one device")
    return "the step's tests: " + ", ".join(node.split("::")[-1].format(step=step) for node in check[1:])


def run_check(check, exercise, folder):
    """(passed, report, lines): run one graded check on the copy. report: a failed pytest check's traceback as
    pytest printed it, in full; lines: the diagnosis, which the hints read (a check of the course's own is all
    diagnosis)."""
    kind = check[0]
    if kind == "replay":
        cmd = [sys.executable, str(TESTS / "check_exercises.py"), "replay", str(folder), ",".join(check[1]),
               *check[2:]]
    elif kind == "verbs":
        cmd = [sys.executable, str(TESTS / "check_exercises.py"), "verbs", str(folder)]
    elif kind == "lab":  # a design challenge: tests/lab.py on the learner's list, its drawing beside it
        listed = folder / exercise["file"]
        cmd = [sys.executable, str(TESTS / "lab.py"), str(listed), "--pp", str(exercise["pp"]), "--microbatches",
               str(exercise["m"]), "--times", exercise["times"], "--challenge", exercise["challenge"], "--png",
               str(listed.with_suffix(".png")), "--step-dir", str(folder), *check[1:]]
    elif kind == "equivalence":
        cmd = [sys.executable, str(TESTS / "check_exercises.py"), "equivalence", str(folder), str(check[1]),
               json.dumps(check[2])]
    else:
        nodes = [node.format(step=exercise["step"]) for node in check[1:]]
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--no-header", "--tb=short",
               "--color=no", "-o", "addopts=", f"--step-dir={exercise['step']}={folder}", *nodes]
    done = warm.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=plain_environment())  # warm.py
    text = ANSI.sub("", done.stdout + done.stderr)
    if done.returncode == 0:
        return True, [], []
    if kind == "pytest":
        return False, pytest_failure(text), pytest_diagnosis(text, folder)
    return False, [], text.strip().splitlines()  # in full


def plain_environment():
    """This process's environment without colour or terminal settings: the diagnosis reads the same anywhere."""
    env = {key: value for key, value in os.environ.items() if key not in COLOUR_VARIABLES}
    return {**env, **PLAIN}


def pytest_failure(text):
    """pytest's report of the failure, as it printed it: the test's name, every frame and every E line, in full
    (--tb=short: the frames from the test down, pytest's own left out); its banners and summary left out."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if re.fullmatch(r"=+ (FAILURES|ERRORS) =+", line)), None)
    if start is None:
        return []
    end = next((i for i, line in enumerate(lines[start + 1:], start + 1) if SUMMARY.match(line)), len(lines))
    return lines[start + 1:end]


def pytest_diagnosis(text, folder):
    """The assertion lines of a failed pytest run, or the exception that stopped it."""
    from check_exercises import failure_lines

    lines = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    stub = [line for line in lines if "NotImplementedError" in line]
    if any("RunFailed" in line for line in lines):  # a launch of the step's ranks failed: each rank's last words
        return stub[:1] + failure_lines("\n".join(lines), folder, most=7)
    if stub:
        return stub[:1] + failure_lines("\n".join(lines), folder, most=3)
    shortened = [line if len(line) < 240 else line[:237] + "..." for line in lines if line]
    return shortened[:8] or [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))][:4]

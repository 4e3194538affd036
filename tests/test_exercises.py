"""The exercises (tests/exercises.py, tests/exercise.py) are proven to work.

For every exercise: its stubbed copy fails its first check with the stub's message, in time; each typical
wrong answer of the catalogue (the incomplete ones too), applied to the course's own code as a small edit,
fails within 30 s, and the diagnosis names the right thing (its key words) with the hint that fits; each
other right answer of the catalogue passes every check; the course's own code passes every check
(each distinct replay once per step; the equivalence and pytest checks are tests of this suite, which runs
them on the course's code: here they must exist).

The default run (about a minute) proves the catalogue's shape, the hints' levels (the bad-input lines are in
test_hostile_inputs.py), the learner's notebook without the answer, a diagnosis under FORCE_COLOR, the replay's
report, the exercises graded first without launching ranks (the replay, step 01's verbs), and that every pytest
check names a test of the suite. The rest launches ranks for every other stub and wrong answer, every other right
answer, and runs every check of the course's own code: it is marked `exercise_proofs`, and CI (.ci/run) runs it
once, after the suite:

    pytest -m exercise_proofs tests/test_exercises.py
"""
import ast
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest

import exercise
import exercise_checks
from check_exercises import failure_lines
from conftest import STEPS
import harness
from exercises import ALL, EXERCISES
from exercises_design import CHALLENGES
from harness import tail

REPO = Path(__file__).resolve().parent.parent
# Proven in the default run: the exercises graded first without launching ranks, seconds each.
DEFAULT = [e["id"] for e in EXERCISES if e["checks"][0][0] in ("replay", "verbs")]
FIRST_FAILURE_S = 30  # a typical wrong answer's diagnosis arrives within this
IDS = [e["id"] for e in EXERCISES]


def proofs_asked(request):
    if "exercise_proofs" not in (request.config.getoption("-m") or ""):
        pytest.skip("launches for every exercise: pytest -m exercise_proofs tests/test_exercises.py (CI runs it)")


def prepared(entry, folder: Path, stub=False, wrong=None) -> Path:
    """A copy of the exercise's step in folder: stubbed, with one wrong answer applied, or as the course has it."""
    shutil.copytree(REPO / entry["step"], folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if stub:
        exercise.stub_copy(entry, folder)
    if wrong:
        (folder / wrong[1]).write_text(exercise.wrong_answer(entry, wrong, (folder / wrong[1]).read_text()))
    return folder


def first_failure(entry, folder: Path):
    """(1-based number of the first failing check or None, its diagnosis, seconds taken)."""
    start = time.perf_counter()
    for n, check in enumerate(entry["checks"], 1):
        passed, _, lines = exercise_checks.run_check(check, entry, folder)
        if not passed:
            return n, "\n".join(lines), time.perf_counter() - start
    return None, "", time.perf_counter() - start


def assert_stub_fails_first(entry, folder):
    n, text, seconds = first_failure(entry, prepared(entry, folder, stub=True))
    assert n == 1 and exercise.stub_message(entry) in text, f"{entry['id']} stubbed: check {n} said\n{text}"
    return seconds


def assert_wrong_answers_fail(entry, tmp_path):
    for i, wrong in enumerate(entry["wrong"]):
        n, text, seconds = first_failure(entry, prepared(entry, tmp_path / f"wrong{i}", wrong=wrong))
        assert n is not None, f"{entry['id']}: the wrong answer '{wrong[0]}' passes every check"
        assert seconds < FIRST_FAILURE_S, f"{entry['id']}, '{wrong[0]}': the first failure took {seconds:.0f} s"
        missing = [word for word in wrong[4] if word not in text]
        assert not missing, f"{entry['id']}, '{wrong[0]}': the diagnosis lacks {missing}:\n{text}"
        keyed = [hint for key, hint in (h for h in entry["hints"] if isinstance(h, tuple)) if key in wrong[4]]
        assert not keyed or exercise.hint_for(entry, text.splitlines()) == keyed[0], (entry["id"], wrong[0])


# The side roads: files a step adds beside its idea, read second (the top README sizes them apart).
SIDE_ROADS = {"pipedream.py", "dualpipe.py", "action_lists.py", "schedule_lab.py", "torch_schedules.py", "experts.py",
              "overlap.py"}


def test_catalogue_covers_every_step_and_names_real_code():
    """20-30 exercises, 1-4 per step on its idea and at most 4 more on its side roads (the files read
    second), unique ids; every function exists in its step's file, keeps its signature and docstring when
    stubbed; every wrong answer's text is in the code exactly once."""
    assert 20 <= len(EXERCISES) <= 30 and len(set(IDS)) == len(IDS)
    on_road = [all(file in SIDE_ROADS for file, _ in e["functions"]) for e in EXERCISES]
    idea = {step: sum(e["step"] == step and not r for e, r in zip(EXERCISES, on_road)) for step in STEPS}
    road = {step: sum(e["step"] == step and r for e, r in zip(EXERCISES, on_road)) for step in STEPS}
    assert all(1 <= n <= 4 for n in idea.values()) and all(n <= 4 for n in road.values()), (idea, road)
    for entry in EXERCISES:
        assert entry["id"][:2] == entry["step"][4:6] and entry["checks"] and entry["hints"] and entry["wrong"]
        for file, qualname in entry["functions"]:
            source = (REPO / entry["step"] / file).read_text()
            stubbed = exercise.stub_source(source, qualname, exercise.stub_message(entry))
            compile(stubbed, file, "exec")
            node = exercise.function_node(ast.parse(stubbed), qualname)
            assert "NotImplementedError" in ast.unparse(node.body[-1]), (entry["id"], qualname)
            original = exercise.function_node(ast.parse(source), qualname)
            assert ast.get_docstring(node) == ast.get_docstring(original)
            assert ast.dump(node.args) == ast.dump(original.args)
        for edit in (*entry["wrong"], *entry["right"]):
            exercise.wrong_answer(entry, edit, (REPO / entry["step"] / edit[1]).read_text())
        for file, answer, _ in entry.get("hide", ()):
            assert (REPO / entry["step"] / file).read_text().count(answer) == 1, (entry["id"], answer)
        assert len(exercise.levels(entry)) == len(exercise.HINT_LEVELS), entry["id"]


def run_cli(*argv):
    done = harness.run([sys.executable, str(REPO / "tests" / "exercise.py"), *argv], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout.strip().splitlines()


def test_replay_reports_a_raising_schedule(tmp_path):
    """tests/replay.py on a copy whose 1F1B raises: every configuration reported, naming it, not a crash;
    a short summary and exit status 1 (JSON with --json)."""
    entry = exercise.BY_ID["04.1f1b"]
    folder = prepared(entry, tmp_path / "copy", stub=True)
    done = harness.run([sys.executable, str(REPO / "tests" / "replay.py"), str(folder)], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 1 and len(lines) <= 15 and "Traceback" not in done.stderr, done.stdout + done.stderr
    assert "NCCL" in lines[0] and lines[2].startswith("  1f1b pp=1 m=1 v=1 p2p=batched (and 49 alike): the schedule "
                                                       "raised NotImplementedError: exercise 04.1f1b"), lines


def test_replay_runs_step_03_and_says_what_runs_before_it():
    """Step 03 (AFAB alone, no --schedule, no --p2p) is replayed, its controls caught; steps 01-02 have no
    engine to replay: one line says what checks them instead."""
    done = harness.run([sys.executable, str(REPO / "tests" / "replay.py"), "--json", "step03_afab"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    report = json.loads(done.stdout)
    controls = {k: v for k, v in report.items() if k.endswith(("_caught", "_deadlocks"))}
    assert done.returncode == 0 and report["configurations"] >= 100 and not report["problems"], done.stdout[-2000:]
    assert len(controls) >= 3 and all(controls.values()), controls
    for step in ("step01_naive", "step02_gpipe"):
        done = harness.run([sys.executable, str(REPO / "tests" / "replay.py"), step], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
        lines = (done.stdout + done.stderr).strip().splitlines()
        assert done.returncode == 1 and len(lines) == 1 and "tests/test_equivalence.py" in lines[0], lines


def test_a_broken_schedule_blames_itself_alone(tmp_path):
    """The replay's schedules_at_fault, by which conftest.replay_passes lets the tests of a step's other
    schedules run: both typical wrong answers of 04.1f1b (one raises, one deadlocks on NCCL's streams)
    blame 1F1B and PipeDream, which runs through 1F1B's function, never AFAB. (The course's own steps
    blame none: tests/test_schedules.py.)"""
    entry = exercise.BY_ID["04.1f1b"]
    for i, wrong in enumerate(entry["wrong"]):
        folder = prepared(entry, tmp_path / f"wrong{i}", wrong=wrong)
        done = harness.run([sys.executable, str(REPO / "tests" / "replay.py"), "--json", str(folder)], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
        assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
        blamed = json.loads(done.stdout)["schedules_at_fault"]
        assert blamed == ["1f1b", "pipedream", "pipedream-2bw"], (wrong[0], blamed)


def test_a_failed_launch_is_diagnosed_from_each_rank_traceback():
    """A rank's traceback followed by a C++ stack trace (TORCH_SHOW_CPP_STACKTRACES=1) or warnings at exit:
    the diagnosis still names the learner's frame and the exception (control: the log's last 15 lines do not).
    A rank that crashed: the crash and the crashed thread's newest frame in the learner's folder."""
    log = ["Traceback (most recent call last):", '  File "/course/mine/pipeline.py", line 72, in send_backward',
           "    dist.send(input_grad, dst=stage.index + 1)", "torch.distributed.DistStoreError: wait timeout",
           "Exception raised from get at store.cpp:91 (most recent call first):",
           *(f"#{i} c10::detail::frame{i}" for i in range(40))]
    log = "\n".join(f"[rank1]: {line}" for line in log)
    lines = failure_lines(f"rank 1 exited with an error at: step 0 forward/backward; last output:\n{tail(log)}",
                          "/course/mine")
    assert lines == ["rank 1 exited with an error at: step 0 forward/backward", "  at pipeline.py:72 in send_backward",
                     "  torch.distributed.DistStoreError: wait timeout"], lines
    last_15 = "\n".join(log.splitlines()[-15:])
    control = failure_lines(f"rank 1 exited with an error at: step 0; last output:\n{last_15}", "/course/mine")
    assert "send_backward" not in "\n".join(control), control
    # A send to a rank that does not exist can crash gloo (SIGSEGV): faulthandler prints every thread's frames,
    # newest first, the heartbeat's thread before the crashed one.
    crash = ["Fatal Python error: Segmentation fault", "", "Thread 0x7f46 (most recent call first):",
             '  File "/course/mine/support/faults.py", line 75 in _beat', "", "Current thread 0x7f47 (most recent call first):",
             '  File "/usr/lib/torch/distributed/distributed_c10d.py", line 2652 in isend',
             '  File "/course/mine/pipeline.py", line 72 in send_backward',
             '  File "/course/mine/pipeline.py", line 97 in backward_step', "", "Extension modules: torch._C"]
    lines = failure_lines(f"rank 1 was killed by SIGSEGV at: step 0; last output:\n{tail(chr(10).join(crash))}",
                          "/course/mine")
    assert lines == ["rank 1 was killed by SIGSEGV at: step 0", "  at pipeline.py:72 in send_backward",
                     "  Fatal Python error: Segmentation fault"], lines


def lab_copy(entry, folder: Path, answer=None) -> Path:
    """A copy of step 08 holding a design challenge's list: the starter `start` writes, or one of the catalogue's."""
    prepared(entry, folder, stub=True)
    if answer:
        exercise.make_answer(entry, answer, folder)
    return folder


@pytest.mark.parametrize("entry", [pytest.param(e, id=e["id"]) for e in CHALLENGES])
def test_design_challenge_starter_and_wrong_lists_fail(entry, tmp_path):
    """Each design challenge of the lab is an exercise: `list` shows it, its starter list (a valid schedule) fails
    the lab's first check on the target, and each wrong list fails it with its key words; the drawing of the
    learner's list lies beside it."""
    assert entry["id"] in [line.split()[0] for line in run_cli("list")[1][:-1]]
    n, text, _ = first_failure(entry, lab_copy(entry, tmp_path / "starter"))
    assert n == 1 and f"challenge {entry['challenge']}" in text and "FAIL" in text, text
    assert (tmp_path / "starter" / entry["file"]).with_suffix(".png").is_file()
    for i, wrong in enumerate(entry["wrong"]):
        n, text, _ = first_failure(entry, lab_copy(entry, tmp_path / f"wrong{i}", wrong))
        missing = [word for word in wrong[2] if word not in text]
        assert n == 1 and not missing, f"{entry['id']}, '{wrong[0]}': check {n}, the report lacks {missing}:\n{text}"
        keyed = [hint for key, hint in (h for h in entry["hints"] if isinstance(h, tuple)) if key in wrong[2]]
        assert not keyed or exercise.hint_for(entry, text.splitlines()) == keyed[0], (entry["id"], wrong[0])


@pytest.mark.exercise_proofs
@pytest.mark.parametrize("entry", [pytest.param(e, id=e["id"]) for e in CHALLENGES])
def test_design_challenge_right_lists_pass_every_check(entry, tmp_path, request):
    """Each right list of a design challenge passes the target and the gloo run against one device."""
    proofs_asked(request)
    for i, right in enumerate(entry["right"]):
        n, text, _ = first_failure(entry, lab_copy(entry, tmp_path / f"right{i}", right))
        assert n is None, f"{entry['id']}, '{right[0]}' fails check {n}:\n{text}"


def limit_s(entry):
    """How soon a stub must fail: a schedule's replay in 30 s, a layer's launch of ranks in 60 s."""
    return 60 if entry["step"] in ("step06_tp", "step07_mixed_precision") else 30


@pytest.mark.parametrize("entry", [pytest.param(e, id=e["id"], marks=() if e["id"] in DEFAULT
                                                else pytest.mark.exercise_proofs) for e in EXERCISES])
def test_stub_and_wrong_answers_fail(entry, tmp_path, request):
    """The stub fails check 1 with its message, in time (limit_s); each typical wrong answer fails a check,
    and the diagnosis names it (its key words) with the hint that fits."""
    if entry["id"] not in DEFAULT:
        proofs_asked(request)
    seconds = assert_stub_fails_first(entry, tmp_path / "stub")
    assert seconds < limit_s(entry), f"{entry['id']}: the stub's first failure took {seconds:.0f} s"
    assert_wrong_answers_fail(entry, tmp_path)


def step_checks(step):
    """Each distinct check of the step's exercises, once, with an exercise that names it."""
    found = {}
    for entry in (e for e in EXERCISES if e["step"] == step):
        for check in entry["checks"]:
            found.setdefault(json.dumps(check), (check, entry))
    return list(found.values())


@pytest.mark.exercise_proofs
@pytest.mark.parametrize("step", STEPS)
def test_other_right_answers_pass(step, tmp_path, request):
    """The other right answers of the step's exercises (other wordings of the same behaviour), all made in one
    copy of the step (each in its own function), pass every check of those exercises: the checks grade
    behaviour. One copy per step keeps the launches few. (The checks' power to fail: every wrong answer.)"""
    proofs_asked(request)
    folder = prepared(next(e for e in EXERCISES if e["step"] == step), tmp_path / "right")
    made = []
    for entry in (e for e in EXERCISES if e["step"] == step):
        for right in entry["right"]:
            path = folder / right[1]
            path.write_text(exercise.wrong_answer(entry, right, path.read_text()))
            made.append(f"{entry['id']}: {right[0]}")
    checks = [(check, entry) for check, entry in step_checks(step) if check[0] != "pytest"]
    nodes = [node for check, _ in step_checks(step) if check[0] == "pytest" for node in check[1:]]
    if nodes:  # one pytest run for all of them: each must pass, and pytest's start-up is paid once
        checks.append((("pytest", *dict.fromkeys(nodes)), next(e for e in EXERCISES if e["step"] == step)))
    with ThreadPoolExecutor(2) as pool:  # the checks are independent: two side by side keep both cores busy
        results = list(pool.map(lambda c: exercise_checks.run_check(*c, folder), checks))
    for (check, _), (passed, _, lines) in zip(checks, results):
        assert passed, f"{step} with {made} fails {exercise_checks.check_name(check, step)}:\n" + "\n".join(lines)


def test_hints_come_in_levels():
    """`hint ID N` shows levels 1 to N; a check's failure shows level 1 and how to ask for more; the first
    level never holds the third's answer; a level out of range gets one line."""
    entry = exercise.BY_ID["05.map"]
    code, lines = run_cli("hint", "05.map", "1")
    assert code == 0 and len(lines) == 1 and "(k // p) % v" not in lines[0], lines
    code, lines = run_cli("hint", "05.map", "3")
    assert code == 0 and len(lines) == 3 and "(k // p) % v" in lines[2], lines
    shown = exercise.hint_lines(entry, ["stage 0: something"], 1)
    assert len(shown) == 2 and "--hint 2" in shown[1] and "(k // p) % v" not in "".join(shown), shown
    for each in ALL:
        first, *_, last = exercise.levels(each)
        assert first != last and last not in first, each["id"]
    code, lines = run_cli("check", "05.map", "--hint", "9")
    assert code == 2 and len(lines) == 1 and "--hint 9" in lines[0], lines


def test_list_into_a_closed_pipe_ends_quietly():
    """`list | head -1`: one line, exit 0, nothing on stderr (no BrokenPipeError)."""
    done = subprocess.run(f"{sys.executable} tests/exercise.py list | head -1", shell=True, cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and len(done.stdout.splitlines()) == 1 and not done.stderr, done.stderr


def test_a_mistake_is_diagnosed_under_force_color():
    """Jupyter's kernels set FORCE_COLOR=1: the diagnosis of a pytest-graded mistake still shows, in plain
    text. Control: a coloured pytest line, as FORCE_COLOR makes them, read without removing its colour codes,
    yields no diagnosis."""
    coloured = "\x1b[1m\x1b[31mE   AssertionError: hysteresis counts overflows\x1b[0m"
    assert not [line for line in coloured.splitlines() if line.startswith("E ")]
    plain = exercise_checks.ANSI.sub("", coloured)
    assert exercise_checks.pytest_diagnosis(plain, REPO) == ["AssertionError: hysteresis counts overflows"]
    env = {**os.environ, "FORCE_COLOR": "1", "COLUMNS": "40", "TERM": "xterm-256color"}
    done = harness.run([sys.executable, "tests/exercise.py", "mistake", "07.scaler", "1"], cwd=REPO,
                       capture_output=True, text=True, timeout=300, env=env)
    assert "hysteresis counts overflows" in done.stdout and "\x1b[" not in done.stdout, done.stdout + done.stderr
    shown = done.stdout.splitlines()  # pytest's report in full, then the diagnosis, then the hint
    at = [next((i for i, line in enumerate(shown) if line.startswith(start)), -1)
          for start in ("tests/test_loss_scaler.py:", "E   AssertionError: hysteresis", "in short:", "hint:")]
    assert 0 <= at[0] < at[1] < at[2] < at[3] and "AssertionError: hysteresis" in shown[at[2] + 1], done.stdout


def test_a_pytest_check_shows_pytests_report_in_full():
    """A failed pytest check shows pytest's report as it printed it: the test's name, every frame and every E
    line, however many; not its banners or summary. Control: output with no failure section shows nothing."""
    frames = [f"tests/test_x.py:{n}: in f{n}\n    f{n + 1}()" for n in range(30)]
    text = "\n".join(["F", "=" * 10 + " FAILURES " + "=" * 10, "____ test_x ____", *frames, "E   ValueError: no",
                      "=" * 10 + " short test summary info " + "=" * 10, "FAILED tests/test_x.py::test_x",
                      "!!!!! stopping after 1 failures !!!!!", "1 failed in 0.1s"])
    report = exercise_checks.pytest_failure(text)
    assert report[0] == "____ test_x ____" and report[-1] == "E   ValueError: no" and len(report) == 62, report
    assert exercise_checks.pytest_failure("F\n1 failed in 0.1s") == []


def test_the_learners_code_states_no_answer_beside_the_stub(tmp_path):
    """What `start` stubs, it also cuts from the copy's other text: 04.warmup's docstring formula, 08.phases'
    table of counts. Control: the course's files hold each cut text."""
    hiding = [e for e in EXERCISES if e.get("hide")]
    assert {"04.warmup", "08.phases"} <= {e["id"] for e in hiding}
    for entry in hiding:
        folder = tmp_path / entry["id"]
        folder.mkdir()
        for file in {f for f, _ in entry["functions"]} | {f for f, _, _ in entry["hide"]}:
            shutil.copy(REPO / entry["step"] / file, folder / file)
        exercise.stub_copy(entry, folder)
        for file, answer, instead in entry["hide"]:
            assert answer in (REPO / entry["step"] / file).read_text()
            text = (folder / file).read_text()
            assert answer not in text and instead in text, (entry["id"], answer)


def test_the_learners_notebook_holds_no_answer(tmp_path):
    """For every exercise: the course's notebook shows the answer (the detector's control) and says "Try
    exercise ID" in the markdown cell just before the first cell that does; the copy `start` makes has no
    cell that shows it."""
    from exercise_answers import answer_cells, hide_answers

    for entry in EXERCISES:
        course = nbformat.read(REPO / entry["step"] / "notebook.ipynb", as_version=4)
        shown = answer_cells(course, entry, REPO / entry["step"])
        assert shown, f"{entry['id']}: no cell of the notebook shows the answer (the detector is blind)"
        before = course.cells[shown[0] - 1]
        assert before.cell_type == "markdown" and f"Try exercise {entry['id']}" in before.source, (entry["id"], shown[0])
        copy = tmp_path / f"{entry['id']}.ipynb"
        shutil.copy(REPO / entry["step"] / "notebook.ipynb", copy)
        hide_answers(copy, entry, REPO / entry["step"])
        assert not answer_cells(nbformat.read(copy, as_version=4), entry, REPO / entry["step"]), entry["id"]


def solution_checks(step, kind):
    """Every distinct check of one kind among the step's exercises (pytest: the node ids)."""
    found = []
    for entry in (e for e in EXERCISES if e["step"] == step):
        for check in (c for c in entry["checks"] if c[0] == kind):
            found += [c for c in ([n.format(step=step) for n in check[1:]] if kind == "pytest" else [check])
                      if c not in found]
    return found


def assert_course_code_passes(step, kind):
    entry = next(e for e in EXERCISES if e["step"] == step)
    for check in solution_checks(step, kind):
        passed, _, lines = exercise_checks.run_check(check, entry, REPO / step)
        assert passed, f"{step}'s own code fails {exercise_checks.check_name(check, step)}:\n" + "\n".join(lines)


@pytest.mark.exercise_proofs
@pytest.mark.parametrize("step", STEPS)
def test_course_code_passes_its_replays(step, request):
    """The solution is the course's own code: every replay of the step's exercises passes on its folder."""
    proofs_asked(request)
    assert_course_code_passes(step, "replay")


def test_every_equivalence_check_is_a_case_of_the_suite():
    """The course's own code passes the exercises' equivalence checks: each is a case of test_equivalence.py, on
    the same ranks with the same flags, which this suite runs on the course's folders."""
    from test_equivalence import CASES, TINY

    cases = {(p.values[0], p.values[1], tuple(p.values[2])) for p in CASES}
    missing = [(entry["id"], check[1], check[2]) for entry in EXERCISES for check in entry["checks"]
               if check[0] == "equivalence" and (entry["step"], check[1], (*TINY, *check[2])) not in cases]
    assert not missing, f"equivalence checks that no case of test_equivalence.py makes: {missing}"


def test_every_pytest_check_names_a_test_of_the_suite():
    """The pytest checks are tests of this suite, which runs them on the course's own code: they must exist."""
    nodes = [node for step in STEPS for node in solution_checks(step, "pytest")]
    done = harness.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                         "-o", "addopts=", *nodes], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and all(node in done.stdout for node in nodes), done.stdout + done.stderr

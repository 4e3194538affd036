"""Careless and hostile inputs to every tool: one clear line, no traceback, and nothing of the user's touched.

train.py of the first and the last step, tests/lab.py and tests/exercise.py each get many inputs in one
process per tool (tests/check_hostile.py): a refusal is decided before any process group or work, so
batching costs nothing it proves. Each input asserts its exit code, exactly one `error:` line holding the
words that name the flag, the value and what is true (or, for a run that is accepted or a learner's syntax
error, the documented report), and no traceback. The scratch folder they point at holds a user's files of
every awkward kind (a FIFO, a link, another tool's log and trace, a list written by hand, another run's
checkpoint); it is hashed before and after, with the step folders, and nothing in it may change. The output
rule and --keep are also checked with their controls: the old rule and the old --keep, planted, must fail.
"""
import hashlib
import json
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from exercises import ALL
from harness import REPO, run

FIRST, LAST = "step01_naive", "step08_dualpipe"
OURS = b'{"otherData": {"written_by": "pipeline parallelism from scratch, timeline.py"}, "traceEvents": []}'
LIST = b"0F0,0B0\r\n1F0,1B0\r\n"  # a two-rank list, as the course writes one
ONE = ["--microbatches", "1", "--schedule-file"]  # step 08, one rank: a one-row list

TRAIN = [  # (flags, the words of the one `error:` line; None: accepted), for both steps
    (["--trace", "/dev/null"], "--trace /dev/null is a character device, not a regular file"),
    (["--log-json", "/dev/zero"], "--log-json /dev/zero is a character device"),
    (["--trace", "pipe"], "--trace pipe is a FIFO"),
    (["--trace", "link.json"], "--trace link.json is a symbolic link"),
    (["--trace", "holiday.png"], "--trace holiday.png exists and is not a trace this course wrote"),
    (["--trace", "theirs.json"], "is not a trace this course wrote: it is left as it is"),
    (["--log-json", "theirs.jsonl"], "--log-json theirs.jsonl exists and is not a log this course wrote"),
    (["--log-json", "notes.txt"], "not a log this course wrote"),
    (["--trace", "x.json", "--log-json", "x.json"], "--trace x.json is also --log-json x.json: two outputs"),
    (["--trace", "folder"], "--trace folder is a directory"),
    (["--trace", "nodir/t.json"], "nodir does not exist"),
    (["--log-json", "notes.txt/log.jsonl"], "notes.txt is not a folder"),
    (["--data", "nothing.txt"], "--data nothing.txt does not exist"),
    (["--data", "folder"], "--data folder is a directory"),
    (["--data", "pipe"], "--data pipe is not a regular file"),
    (["--data", "ours.json", "--trace", "ours.json", "--seq-len", "16"], "is also --data ours.json"),
    (["--timeout", "1e300"], "--timeout 1e+300 must be at most 1e+09 s"),
    (["--timeout", "0.5"], "--timeout 0.5 must be at least 1 s"),
    (["--timeout", "nan"], "--timeout nan must be positive"),
    (["--lr", "inf"], "--lr inf and --timeout 120.0 must be finite"),
    (["--lr", "-1"], "--lr -1.0 must be positive"),
    (["--steps", "0"], "--steps 0 must be positive"),
    (["--steps", "1.5"], "argument --steps: invalid int value: '1.5'"),
    (["--seed", "-1"], "--seed -1 must be between 0 and"),
    (["--seq-len", "1000000000000"], "fewer than --seq-len 1000000000000 + 2"),
    (["--pp", "x"], "argument --pp: invalid int value: 'x'"),
    (["--layers", "0"], "--layers 0 must be positive"),
    (["--hidden", "33", "--heads", "2"], "--hidden 33 must be a multiple of --heads 2"),
    (["--device", "tpu"], "--device tpu is unknown"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--trace", "empty.json"], None),  # an empty regular file: nothing is lost
    (["--trace", "ours.json", "--log-json", "new.jsonl"], None),  # the course's own trace, and a new path
]
LAST_ONLY = [
    (["--dump-schedule", "my-list.csv"], "--dump-schedule my-list.csv exists and is not a schedule list this course"),
    (["--dump-schedule", "theirs.jsonl"], "not a schedule list this course wrote"),
    (["--dump-schedule", "x.csv", "--trace", "x.csv"], "--dump-schedule x.csv is also --trace x.csv"),
    ([*ONE, "latin1.csv"], "--schedule-file latin1.csv: byte 6 (0xe9) is not UTF-8"),
    ([*ONE, "utf16.csv"], "--schedule-file utf16.csv: byte 0 (0xff) is not UTF-8"),
    ([*ONE, "nothing.csv"], "--schedule-file nothing.csv does not exist"),
    ([*ONE, "folder"], "--schedule-file folder is a directory"),
    ([*ONE, "bom.csv"], None),  # a UTF-8 byte-order mark is accepted
    ([*ONE, "one.csv", "--dump-schedule", "one.csv"], "--dump-schedule one.csv is also --schedule-file one.csv"),
    (["--dump-schedule", "one.csv"], None),  # a list the course wrote: replaced
    (["--save", "notes.txt"], "--save notes.txt is a file"),
    (["--save", "ckpt", "--trace", "ckpt/t.json"], "--trace ckpt/t.json is inside --save ckpt"),
    (["--save", "ckpt"], None),  # another run's checkpoint in it: a note, and it stays
    (["--resume", "nothing"], "--resume nothing does not exist"),
    (["--resume", "notes.txt"], "--resume notes.txt is a file"),
    (["--resume", "ckpt/step00000007"], "--resume ckpt/step00000007 does not exist"),
    (["--resume", "ckpt2/step00000001"], "--resume ckpt2/step00000001 is a file"),  # named like a checkpoint
    (["--resume", "folder"], "--resume folder holds no checkpoint"),
    (["--resume", "ckpt", "--steps", "100"], "ckpt/step00000058/.metadata cannot be read"),
    (["--save", "ckpt2", "--keep", "0"], "--keep 0 must be at least 1"),
    (["--save", "ckpt2", "--save-every", "-1"], "--save-every -1 and --keep 2 must be at least 1"),
    (["--precision", "fp16", "--initial-loss-scale", "1e300"], "must satisfy 1.18e-38 <= min <= initial <= 3.4e+38"),
    (["--precision", "fp16", "--min-loss-scale", "1e-39"], "--min-loss-scale 1e-39 and --initial-loss-scale 65536.0 "
     "must satisfy 1.18e-38 <= min <= initial <= 3.4e+38, fp32's smallest normal and largest numbers"),
    (["--loss-scale", "inf"], "--loss-scale inf must be finite"),
    (["--schedule", "dualpipev", "--pairs", "x"], "--pairs x is unknown"),
    (["--schedule", "nope"], "--schedule nope is unknown"),
]
LAB = [
    (["ok.csv", "--pp", "0", "--microbatches", "1"], 2, "--pp 0 must be at least 1"),
    (["ok.csv", "--pp", "x", "--microbatches", "1"], 2, "argument --pp: invalid int value: 'x'"),
    ([], 2, "the following arguments are required"),
    (["nothing.csv", "--pp", "2", "--microbatches", "1"], 2, "nothing.csv does not exist"),
    (["folder", "--pp", "2", "--microbatches", "1"], 2, "folder is a directory"),
    (["latin1-2.csv", "--pp", "2", "--microbatches", "1"], 2, "latin1-2.csv: byte 6 (0xe9) is not UTF-8"),
    (["utf16.csv", "--pp", "2", "--microbatches", "1"], 2, "utf16.csv: byte 0 (0xff) is not UTF-8"),
    (["ok.csv", "--pp", "2", "--microbatches", "1", "--png", "holiday.png"], 2, "not a drawing this course wrote"),
    (["ok.csv", "--pp", "2", "--microbatches", "1", "--png", "nodir/x.png"], 2, "nodir does not exist"),
    (["ok.csv", "--pp", "2", "--microbatches", "1", "--png", "x.txt"], 2, "--png x.txt must end in .png"),
    (["ok.csv", "--pp", "2", "--microbatches", "1", "--png", "dir.png"], 2, "--png dir.png is a directory"),
    (["ok.csv", "--pp", "2", "--microbatches", "1", "--png", "link.png"], 2, "--png link.png is a symbolic link"),
    (["ok.csv", "--pp", "2", "--microbatches", "1", "--times", "1:0:1"], 2, "--times 1:0:1 must be three positive"),
    (["ok.csv", "--pp", "2", "--microbatches", "1", "--challenge", "nope"], 2, "invalid choice: 'nope'"),
    (["ok.csv", "--pp", "2", "--microbatches", "1", "--step-dir", "folder"], 2, "--step-dir folder has no"),
    (["bad-action.csv", "--pp", "2", "--microbatches", "1"], 2, "rank 0, action 1 '0X0': unknown action"),
    (["ok.csv", "--pp", "3", "--microbatches", "1"], 2, "the list has 2 rows (ranks), but --pp is 3"),
    (["stage-7.csv", "--pp", "2", "--microbatches", "1"], 2, "rank 1, action 0 7F0: stage 7 does not exist"),
    (["bom-2.csv", "--pp", "2", "--microbatches", "1", "--no-run", "--png", "drawn.png"], 0, None),
]
EXERCISE = [
    ([], 2, None), (["nope"], 2, None), (["start"], 2, None),  # the usage line, as documented
    (["hint", "03.afab", "0"], 2, "hint 03.afab 0: give a level from 1 to 3"),
    (["hint", "03.afab", "-1"], 2, "hint 03.afab -1: give a level from 1 to 3"),
    (["hint", "03.afab", "x"], 2, "hint 03.afab x: give a level"),
    (["hint", "03.afab", "4"], 2, "hint 03.afab 4: give a level from 1 to 3"),
    (["mistake", "03.afab", "0"], 2, "mistake 03.afab 0: give a mistake from 1 to"),
    (["mistake", "03.afab", "99"], 2, "mistake 03.afab 99: give a mistake from 1 to"),
    (["check", "03.afab", "--hint", "0"], 2, "--hint 0: give a level from 1 to 3"),
    (["check", "03.afab", "--hint"], 2, "--hint (nothing): give a level"),
    (["start", "03.afab"], 2, "03.afab is a file, not an exercise copy: it is left as it is"),
    (["start", "03.afab", "--force"], 2, "03.afab is a file, not an exercise copy"),
    (["check", "03.afab"], 2, "03.afab is a file, not a copy of a step"),
    (["check", "04.1f1b", "--step-dir", "nothing"], 2, "--step-dir nothing does not exist"),
    (["check", "04.1f1b", "--step-dir"], 2, "--step-dir needs a path"),
    (["check", "04.1f1b", "--step-dir", "notes.txt"], 2, "notes.txt is a file, not a copy of a step"),
    (["check", "zz.top"], 2, "no exercise 'zz.top'"),
    (["check", "04.1f1b", "--step-dir", "folder"], 2, "folder is not a copy of a step (no train.py in it)"),
    (["check", "04.1f1b", "--step-dir", str(REPO / "step05_interleaved")], 2, "made from step05_interleaved"),
    (["list"], 0, None),
    (["hint", "03.afab", "3"], 0, None),
    (["check", "01.naive"], 1, None),  # a copy Python cannot read: its report (test_the_documented_reports)
]


def scratch(folder: Path):
    """A user's folder of awkward things, which every input points at."""
    for name, data in [("holiday.png", b"\x89PNG holiday"), ("theirs.json", b'{"traceEvents": []}'),
                       ("theirs.jsonl", b'{"step": 0, "loss": 1.0}\n'), ("notes.txt", b"mine\n"), ("ours.json", OURS),
                       ("empty.json", b""), ("my-list.csv", b"0F0,0B0\n"), ("ok.csv", LIST),
                       ("one.csv", b"0F0,0B0\r\n"),
                       ("latin1.csv", b"0F0,0B\xe90\r\n"), ("latin1-2.csv", b"0F0,0B\xe90\r\n1F0,1B0\r\n"),
                       ("utf16.csv", "0F0,0B0\r\n".encode("utf-16")), ("bom.csv", b"\xef\xbb\xbf0F0,0B0\r\n"),
                       ("bom-2.csv", b"\xef\xbb\xbf" + LIST), ("bad-action.csv", b"0F0,0X0\n1F0,1B0\n"),
                       ("stage-7.csv", b"0F0,0B0\n7F0,7B0\n"),
                       ("ckpt/step00000058/.metadata", b"another run's index"),
                       ("ckpt2/step00000001", b"a file named like a checkpoint"), ("my_exercises/03.afab", b"mine\n")]:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    for name in ("folder", "dir.png"):
        (folder / name).mkdir()
    os.mkfifo(folder / "pipe")
    (folder / "link.json").symlink_to(folder / "empty.json")
    (folder / "link.png").symlink_to(folder / "holiday.png")
    copy = folder / "my_exercises" / "01.naive"  # a learner's copy that Python cannot read
    shutil.copytree(REPO / FIRST, copy, ignore=shutil.ignore_patterns("__pycache__", "*.ipynb"))
    source = (copy / "pipeline.py").read_text()
    (copy / "pipeline.py").write_text(source.replace("def naive_forward_backward(", "def naive_forward_backward((", 1))


def fingerprint(*folders) -> dict:
    """path -> the hash of its bytes (a link: its target; a FIFO: its kind), for every file under the folders."""
    found = {}
    for folder in folders:
        for path in sorted(Path(folder).rglob("*")):
            if "__pycache__" in path.parts:
                continue
            key = str(path)
            found[key] = ("link " + os.readlink(path) if path.is_symlink() else "fifo" if path.is_fifo() else
                          "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest())
    return found


def drive(folder: Path, jobs: list) -> list:
    """tests/check_hostile.py on `jobs`, in folder: one entry per job."""
    path = folder.parent / f"{folder.name}-jobs-{jobs[0]['tool']}-{len(jobs)}.json"
    path.write_text(json.dumps(jobs, default=str))
    done = run([sys.executable, str(REPO / "tests" / "check_hostile.py"), str(path)], cwd=folder, capture_output=True,
               text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def outcomes(step_dirs, tmp_path_factory):
    """({tool: [(input, expected code, expected words, {code, out, err})]}, the files that changed, what the
    output rule and --keep let through, with their plants). Two processes, one per step folder."""
    folder = tmp_path_factory.mktemp("hostile")
    scratch(folder)
    rules = folder.parent / f"{folder.name}-rules"  # outside the hashed folder: the rules write there
    rules.mkdir()
    before = fingerprint(folder, step_dirs[FIRST], step_dirs[LAST])
    tools = {FIRST: [(f, 2 if w else None, w) for f, w in TRAIN],
             LAST: [(f, 2 if w else None, w) for f, w in TRAIN + LAST_ONLY], "lab": LAB, "exercise": EXERCISE}
    cases = {name: [argv for argv, _, _ in each] for name, each in tools.items()}
    first = [dict(tool="train", step_dir=step_dirs[FIRST], cases=cases[FIRST]),
             dict(tool="exercise", copies=folder / "my_exercises", cases=cases["exercise"])]
    last = [dict(tool="train", step_dir=step_dirs[LAST], cases=cases[LAST]), dict(tool="lab", cases=cases["lab"]),
            dict(tool="rules", step_dir=step_dirs[LAST], folder=rules)]
    with ThreadPoolExecutor(2) as pool:
        (train_first, exercise), (train_last, lab, found_rules) = pool.map(lambda jobs: drive(folder, jobs),
                                                                           [first, last])
    after = fingerprint(folder, step_dirs[FIRST], step_dirs[LAST])
    changed = sorted(path for path in before if before[path] != after.get(path))
    found = {FIRST: train_first, LAST: train_last, "lab": lab, "exercise": exercise}
    return {name: list(zip(*zip(*tools[name]), found[name])) for name in tools}, changed, found_rules


def problem(argv, code, words, got) -> str:
    """What is wrong with one input's outcome, or None."""
    text = got["out"] + got["err"]
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    if "Traceback" in text:
        return f"{argv}: a traceback\n{text[-1500:]}"
    if got["code"] != code:
        return f"{argv}: exit code {got['code']}, not {code}: {text[-500:]}"
    if words is None:
        return f"{argv}: {errors}" if errors else None
    if len(errors) != 1 or words not in errors[0]:
        return f"{argv}: {errors or text[-300:]}, wanted one error: line with {words!r}"
    if len(text.strip().splitlines()) != 1:
        return f"{argv}: more than the error: line\n{text[-1500:]}"
    return None


@pytest.mark.parametrize("tool", [FIRST, LAST, "lab", "exercise"])
def test_each_input_gets_one_line_and_no_traceback(tool, outcomes):
    found = outcomes[0]
    problems = [p for p in (problem(*case) for case in found[tool]) if p]
    assert not problems, "\n".join(problems)


def test_nothing_of_the_users_changes(outcomes):
    """Every file that was there before the inputs, in the scratch folder and the step folders, is byte-identical
    after them (a link still points where it did, a FIFO is still a FIFO)."""
    found, changed, _ = outcomes
    assert sum(len(cases) for cases in found.values()) >= 60
    assert not changed, changed


def test_the_documented_reports(outcomes):
    """The reports that are not an `error:` line: another run's checkpoints named at the start; a copy Python
    cannot read shown as Python shows it (file, line, caret, message) before any check; the usage line; the
    catalogue, one line per exercise."""
    found = outcomes[0]
    save = next(got for argv, _, _, got in found[LAST] if argv == ["--save", "ckpt"])
    assert "note: --save ckpt holds 1 checkpoint(s) of another run" in save["err"], save
    assert "step00000058" in save["err"], save
    listed = next(got["out"] for argv, _, _, got in found["exercise"] if argv == ["list"]).splitlines()
    assert len(listed) == len(ALL) + 1 and listed[-1].startswith("start one: "), listed
    usage = [got for argv, _, _, got in found["exercise"] if len(argv) < 2 and argv != ["list"]]
    assert all(got["out"].startswith("usage: python tests/exercise.py") for got in usage), usage
    broken = next(got["out"] for argv, _, _, got in found["exercise"] if argv == ["check", "01.naive"]).splitlines()
    assert broken[0] == "FAIL 01.naive: Python cannot read the copy, so no check runs", broken
    lines = (REPO / FIRST / "pipeline.py").read_text().splitlines()
    line = next(n for n, text in enumerate(lines, 1) if text.startswith("def naive_forward_backward("))
    assert broken[1].startswith('  File "') and broken[1].endswith(f'pipeline.py", line {line}'), broken
    assert "def naive_forward_backward((" in broken[2] and set(broken[3].strip()) == {"^"}, broken
    assert broken[4].startswith("SyntaxError: ") and broken[5].startswith("hint: "), broken


def test_the_output_rule_and_keep_have_controls_that_fail(outcomes):
    """The output rule refuses /dev/null, a FIFO, a link to an empty file, another tool's trace and a folder,
    and takes an empty file and a new path; --keep 1, saving step 3 beside steps 1, 2 and another run's 58,
    leaves 3 and 58 (step 08: support/outputs.py is the same file in every step). Controls: the old rule (a path
    that reads as empty is the course's) takes /dev/null, the FIFO and the link; the old --keep (the newest by
    folder name) deletes this run's step 3."""
    found = outcomes[2]
    assert found["rule"] == [] and found["keep"] == [], found
    planted = found["rule planted"]
    assert any("/dev/null" in p for p in planted) and any("fifo" in p for p in planted), found
    assert found["keep planted"] == ["left ['step00000058'], wanted ['step00000003', 'step00000058']"], found

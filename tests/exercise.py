"""The tests as exercises: start one, write the function, check it. From the course root:

    python tests/exercise.py list                          the catalogue (tests/exercises.py) and each one's state
    python tests/exercise.py start 04.1f1b                 copy step 04 to my_exercises/04.1f1b/, the function stubbed
    python tests/exercise.py check 04.1f1b                 its checks, fastest first, stopping at the first failure
    python tests/exercise.py check 04.1f1b --step-dir my_1f1b    a copy made by hand (tests/README.md, the recipe by hand)
    python tests/exercise.py mistake 04.1f1b 1             what typical wrong answer 1 prints (the notebooks show it)
    python tests/exercise.py check 04.1f1b --hint 2        a failed check's hints up to level 2 (3: the answer's key)
    python tests/exercise.py hint 04.1f1b 3                the hints alone, without a check

A check runs the course's own tests on the copy: the replay of the schedules without a model (seconds), one
small run against the single device, then the step's own tests of that function. The solution is the step's
own code.
"""
import ast
import hashlib
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

from exercise_checks import REPO, TESTS, check_name, run_check
from exercises import ALL, BY_ID

COPIES = REPO / "my_exercises"
PASSED = ".exercise-passed"  # in a copy: the digest of its exercise files when every check last passed
HINT_LEVELS = ("the idea", "where to look", "the answer's key")


class Refused(Exception):
    """Bad input: one line for the learner."""


# ------------------------------------------------------------------------------------------------ stubs

def function_node(tree, qualname):
    """The def of `name` or `Class.name` in a module's tree."""
    scope, node = tree.body, None
    for part in qualname.split("."):
        node = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part), None)
        if node is None:
            raise Refused(f"{qualname} not found")
        scope = node.body
    return node


def stub_source(source, qualname, message):
    """source with the body of `qualname` replaced by a raise of `message`; its signature and docstring stay."""
    node = function_node(ast.parse(source), qualname)
    body = node.body
    has_doc = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
        and isinstance(body[0].value.value, str)
    first = body[0].end_lineno + 1 if has_doc else body[0].lineno  # 1-based: the first line to replace
    indent = " " * body[0].col_offset
    lines = source.splitlines(keepends=True)
    stub = f"{indent}raise NotImplementedError({message!r})  # your code here\n"
    return "".join(lines[:first - 1] + [stub] + lines[node.end_lineno:])


def wrong_answer(exercise, wrong, source):
    """source with one of the catalogue's wrong (or other right) answers made; each old text must be in it
    exactly once."""
    _, file, olds, news = wrong[:4]
    for old, new in zip(*((olds, news) if isinstance(olds, tuple) else ((olds,), (news,)))):
        assert source.count(old) == 1, f"{exercise['id']}: the wrong answer's text is not once in {file}: {old!r}"
        source = source.replace(old, new)
    return source


def make_answer(exercise, answer, folder):
    """Make one of the catalogue's wrong or right answers in `folder`, a copy of the step: an edit of its code,
    or a design challenge's list. Returns the file written."""
    file = exercise["file"] if "challenge" in exercise else answer[1]
    text = answer[1]() if "challenge" in exercise else wrong_answer(exercise, answer, (folder / file).read_text())
    (folder / file).write_text(text)
    return file


def stub_message(exercise):
    return f"exercise {exercise['id']}: {exercise['summary']}"


def stub_copy(exercise, folder):
    """Stub every function of the exercise in `folder`, a copy of its step, and cut the other text of its files
    that states the answer (the catalogue's `hide`: a docstring's formula, a table of the counts). A design
    challenge's copy gets its starter list instead."""
    if "challenge" in exercise:
        (folder / exercise["file"]).write_text(exercise["starter"]())
    for file, qualname in exercise["functions"]:
        path = folder / file
        path.write_text(stub_source(path.read_text(), qualname, stub_message(exercise)))
    for file, answer, instead in exercise.get("hide", ()):
        path = folder / file
        path.write_text(path.read_text().replace(answer, instead))


# ------------------------------------------------------------------------------------------------ copies

def python_files(folder):
    """{path in the folder: bytes} of the step's code: its own files and its support/ package."""
    files = [*folder.glob("*.py"), *folder.glob("support/*.py")]
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in files}


def made_from(folder):
    """The course step whose files the copy shares most (byte for byte), or None if none has its files."""
    mine = python_files(folder)
    best, score = None, -1
    for step in sorted(p for p in REPO.glob("step0*") if p.is_dir()):
        theirs = python_files(step)
        if set(theirs) == set(mine):
            same = sum(theirs[name] == mine[name] for name in mine)
            if same > score:
                best, score = step.name, same
    return best


def written(exercise):
    """[(file, what the learner writes in it)]: the exercise's functions, or a design challenge's list."""
    return exercise["functions"] or [(exercise["file"], f"a schedule for the lab's challenge {exercise['challenge']}")]


def digest(exercise, folder):
    return hashlib.sha256(b"".join((folder / file).read_bytes() for file, _ in written(exercise))).hexdigest()


def state(exercise):
    folder = COPIES / exercise["id"]
    if not folder.is_dir():
        return "not started"
    mark = folder / PASSED
    if mark.exists():
        return "passing" if mark.read_text() == digest(exercise, folder) else "started (changed since it passed)"
    return "started"


def exercise_of(ident):
    if ident not in BY_ID:
        raise Refused(f"no exercise {ident!r}: `python tests/exercise.py list` shows the ids (like 04.1f1b)")
    return BY_ID[ident]


def copy_for(exercise, step_dir=None):
    """The learner's copy of the exercise's step: checked to exist and to be made from that step."""
    folder = Path(step_dir).expanduser().resolve() if step_dir else COPIES / exercise["id"]
    if folder.exists() and not folder.is_dir():
        raise Refused(f"{step_dir or shown(folder)} is a file, not a copy of a step: it is left as it is")
    if step_dir and not folder.exists():
        raise Refused(f"--step-dir {step_dir} does not exist")
    if not (folder / "train.py").is_file():
        if step_dir:
            raise Refused(f"{step_dir} is not a copy of a step (no train.py in it)")
        raise Refused(f"exercise {exercise['id']} is not started: python tests/exercise.py start {exercise['id']}")
    origin = made_from(folder)
    if origin != exercise["step"]:
        raise Refused(f"{shown(folder)} was made from {origin or 'no step of the course'}, but exercise "
                      f"{exercise['id']} is in {exercise['step']}: start it, or copy {exercise['step']}")
    return folder


def shown(path):
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


# ------------------------------------------------------------------------------------------------ checks

def hint_for(exercise, lines):
    """The first level's hint that fits what the check printed: a (key word, hint) pair whose key word is in
    its lines, else the exercise's first level (the idea)."""
    text = "\n".join(lines)
    keyed = [hint for key, hint in (h for h in exercise["hints"] if isinstance(h, tuple)) if key in text]
    return (keyed or levels(exercise))[0]


def levels(exercise):
    """The exercise's plain hints: the idea, where to look, the answer's key."""
    return [hint for hint in exercise["hints"] if isinstance(hint, str)]


def hint_lines(exercise, lines, level):
    """The hints up to `level`: the first fits what the check printed; then how to ask for more."""
    shown = [f"hint: {hint_for(exercise, lines)}"]
    shown += [f"hint {n} ({HINT_LEVELS[n - 1]}): {hint}" for n, hint in enumerate(levels(exercise)[1:level], 2)]
    if level < len(levels(exercise)):
        shown.append(f"(more: --hint {level + 1}, {HINT_LEVELS[level]})")
    return shown


def syntax_error(folder):
    """Python's own report of the first file of the copy that it cannot read (file, line, the line with a caret,
    the message), as its lines; None if every file compiles."""
    for name, source in sorted(python_files(folder).items()):
        try:
            compile(source, str(shown(folder / name)), "exec")
        except SyntaxError as err:  # IndentationError and TabError included
            return "".join(traceback.format_exception_only(err)).rstrip().splitlines()
    return None


def check(exercise, folder, hint=1):
    """Run the exercise's checks in order, stopping at the first failure: its output, then the hints up to level
    `hint`. A file Python cannot read is shown as Python shows it, before any check runs."""
    checks, start, ident = exercise["checks"], time.perf_counter(), exercise["id"]
    broken = syntax_error(folder)
    if broken:
        print(f"FAIL {ident}: Python cannot read the copy, so no check runs")
        print("\n".join(broken))
        print("hint: fix the line Python shows (the carets mark where it stopped reading), then check again")
        return 1
    for n, each in enumerate(checks, 1):
        began = time.perf_counter()
        passed, report, lines = run_check(each, exercise, folder)
        took = time.perf_counter() - began
        if not passed:
            print(f"FAIL {ident}, check {n} of {len(checks)}: {check_name(each, exercise['step'])} ({took:.1f} s)")
            if report:  # pytest's own report first, in full; then the diagnosis and the hint
                print("\n".join([*report, "in short:"]))
            print("\n".join(f"  {line}" for line in lines))
            print("\n".join(hint_lines(exercise, lines, hint)))
            return 1
        print(f"ok   check {n} of {len(checks)}: {check_name(each, exercise['step'])} ({took:.1f} s)")
    if folder.is_relative_to(COPIES):
        (folder / PASSED).write_text(digest(exercise, folder))
    following = ALL[ALL.index(exercise) + 1:]
    after = f"next: python tests/exercise.py start {following[0]['id']}" if following else "that was the last one"
    print(f"PASS {ident}: every check passes ({time.perf_counter() - start:.1f} s). {after}")
    return 0


# ------------------------------------------------------------------------------------------------ commands

def command_list():
    try:
        for exercise in ALL:
            names = ", ".join(what for _, what in written(exercise))
            print(f"{exercise['id']:<18} {state(exercise):<12} {exercise['step']}: {names}")
        print("start one: python tests/exercise.py start ID; then: python tests/exercise.py check ID")
        sys.stdout.flush()
    except BrokenPipeError:  # the reader (head, a pager) stopped reading: nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    return 0


def command_hint(exercise, level):
    """The exercise's hints up to `level` (1-based), without a check."""
    for n, hint in enumerate(levels(exercise)[:level], 1):
        print(f"hint {n} ({HINT_LEVELS[n - 1]}): {hint}")
    return 0


def command_start(exercise, force=False):
    folder = COPIES / exercise["id"]
    if folder.is_symlink() or folder.exists() and not folder.is_dir():
        raise Refused(f"{shown(folder)} is {'a link' if folder.is_symlink() else 'a file'}, not an exercise copy: it "
                      "is left as it is; move it away, then start")
    if folder.exists() and not force:
        if not (sys.stdin.isatty() and input(f"{shown(folder)} exists: start again and lose it? [y/N] ") == "y"):
            raise Refused(f"{shown(folder)} exists: check it, or start again with --force (it is overwritten)")
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(REPO / exercise["step"], folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    ignore_copies()
    stub_copy(exercise, folder)
    from exercise_answers import hide_answers
    if (folder / "notebook.ipynb").exists():
        hide_answers(folder / "notebook.ipynb", exercise, REPO / exercise["step"])
    where = ", ".join(f"{shown(folder / file)}: {what}" for file, what in written(exercise))
    print(f"exercise {exercise['id']} ({exercise['step']}): write {where}")
    print(exercise["task"])
    print(f"then: python tests/exercise.py check {exercise['id']}")
    return 0


def ignore_copies():
    """my_exercises/.gitignore, unless one is there: the learner's copies stay out of the course's git."""
    if not os.path.lexists(COPIES / ".gitignore"):
        (COPIES / ".gitignore").write_text("*\n")


def command_mistake(exercise, which=1, hint=1):
    """Check a copy of the step with the catalogue's typical wrong answer number `which` (1-based) made, then delete
    it: what a learner who makes that mistake reads."""
    what = exercise["wrong"][which - 1][0]
    folder = COPIES / ".mistakes" / exercise["id"]
    if folder.is_symlink() or folder.exists() and not folder.is_dir():
        raise Refused(f"{shown(folder)} is not a folder of this course's: it is left as it is; move it away")
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(REPO / exercise["step"], folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    ignore_copies()
    file = make_answer(exercise, exercise["wrong"][which - 1], folder)
    print(f"# {exercise['id']} with a typical mistake in {file}: {what}")
    try:
        return check(exercise, folder, hint)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def hint_level(exercise, argv):
    """The --hint N of the command line (1 if absent), checked against the exercise's levels."""
    if "--hint" not in argv:
        return 1
    value = argv[argv.index("--hint") + 1] if argv.index("--hint") + 1 < len(argv) else ""
    return number_in("--hint", value, len(levels(exercise)), "a level")


def number_in(what: str, value: str, most: int, noun: str) -> int:
    """value as a whole number from 1 to `most`, or a Refused line naming what, the value and the range."""
    if not value.isdigit() or not 1 <= int(value) <= most:
        raise Refused(f"{what} {value or '(nothing)'}: give {noun} from 1 to {most}")
    return int(value)


def position(exercise, argv, most: int, noun: str) -> int:
    """The N after `hint ID` or `mistake ID` (1 if absent; 1-based), checked against `most`."""
    value = argv[2] if len(argv) > 2 and not argv[2].startswith("--") else None
    return 1 if value is None else number_in(f"{argv[0]} {exercise['id']}", value, most, noun)


def main(argv):
    sys.path.insert(0, str(TESTS))
    usage = ("usage: python tests/exercise.py list | start ID [--force] | check ID [--step-dir PATH] [--hint N] "
             "| mistake ID [N] [--hint N] | hint ID [N]")
    commands = ("list", "start", "check", "mistake", "hint")
    if not argv or argv[0] not in commands or (argv[0] != "list" and len(argv) < 2):
        print(usage)
        return 2
    try:
        if argv[0] == "list":
            return command_list()
        exercise = exercise_of(argv[1])
        hint = hint_level(exercise, argv)
        if argv[0] == "start":
            return command_start(exercise, force="--force" in argv)
        if argv[0] == "hint":
            return command_hint(exercise, position(exercise, argv, len(levels(exercise)), "a level"))
        if argv[0] == "mistake":
            return command_mistake(exercise, position(exercise, argv, len(exercise["wrong"]), "a mistake"), hint)
        if argv[-1] == "--step-dir":
            raise Refused("--step-dir needs a path: the copy of a step to check")
        step_dir = argv[argv.index("--step-dir") + 1] if "--step-dir" in argv else None
        return check(exercise, copy_for(exercise, step_dir), hint)
    except Refused as refusal:
        print(f"error: {refusal}")
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

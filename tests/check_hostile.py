"""Drive the course's tools with many hostile inputs in one process (test_hostile_inputs.py reads what it prints).

    python tests/check_hostile.py JOBS.json    ->  prints a JSON list, one entry per job

JOBS.json holds a list of jobs, run in order in this one process (one step folder per process: steps share
module names):

    {"tool": "train", "step_dir": DIR, "cases": [flags, ...]}        train.parse_args(flags), as rank 0 of 1
    {"tool": "lab", "cases": [argv, ...]}                           tests/lab.py's main(argv), step 08
    {"tool": "exercise", "copies": DIR, "cases": [argv, ...]}       tests/exercise.py's main(argv), copies in DIR
    {"tool": "rules", "step_dir": DIR, "folder": DIR}               the output rule and --keep, with their plants

A case's entry is {code, out, err}: the exit code (None: accepted), and what it wrote to stdout and stderr, with
the traceback of anything it raised. A refusal is decided before any process group or work, so one process
serves every case: starting Python and torch per input would cost a second or two each. `rules` plants the old
behaviours (a path that reads as empty taken as the course's; --keep pruning by folder name) and reports what
each rule and each plant let through.
"""
import io
import json
import os
import sys
import traceback
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def captured(call) -> dict:
    """call() with its output captured: {code, out, err}; an exception is a code of 'raised' and its traceback."""
    out, err, code = io.StringIO(), io.StringIO(), None
    try:
        with redirect_stdout(out), redirect_stderr(err):
            result = call()
        code = result if isinstance(result, int) else None
    except SystemExit as done:
        code = done.code
    except BaseException:  # what the tool let escape: the test shows it
        code, err = "raised", io.StringIO(err.getvalue() + traceback.format_exc())
    return dict(code=code, out=out.getvalue(), err=err.getvalue())


def old_refusal(flag, path, kind, ours):
    """The plant: the rule as it was (anything whose read returns nothing is the course's, links followed)."""
    if os.path.isdir(path):
        return f"{flag} {path} is a directory"
    if os.path.exists(path):
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # the old read, which a FIFO held until a writer came
        head = os.read(fd, 2**16)
        os.close(fd)
        if head and not ours(head):
            return f"{flag} {path} exists and is not a {kind} this course wrote"
    return None


def rule_problems(outputs, folder: Path) -> list:
    """Where the output rule lets a path through that it must refuse, or refuses one it must take."""
    folder.mkdir()
    (folder / "empty").write_bytes(b"")
    (folder / "link-to-empty").symlink_to(folder / "empty")
    (folder / "theirs.json").write_text('{"traceEvents": []}')
    os.mkfifo(folder / "fifo")
    refused = ["/dev/null", folder / "link-to-empty", folder / "theirs.json", folder / "fifo", folder]
    taken = [folder / "empty", folder / "new.json"]
    problems = [f"took {p}" for p in refused if outputs.refusal("--trace", str(p), "trace", outputs.is_trace) is None]
    problems += [f"refused {p}" for p in taken if outputs.refusal("--trace", str(p), "trace", outputs.is_trace)]
    outputs.write(str(folder / "new.json"), "x")
    if sorted(n.name for n in folder.iterdir() if n.name.endswith(".tmp")):
        problems.append("a temporary file was left")
    return problems


def keep_problems(checkpoint, folder: Path) -> list:
    """Save step 3 into a --save folder that holds steps 1, 2 and another run's 58, with --keep 1: this run's
    step 3 and the other run's step 58 must stay, steps 1 and 2 go."""
    folder.mkdir()
    for step in (1, 2, 58):
        os.makedirs(checkpoint.folder_of(str(folder), step))
        Path(checkpoint.folder_of(str(folder), step), ".metadata").write_bytes(b"index")
    final = checkpoint.folder_of(str(folder), 3)
    os.makedirs(final + ".tmp")
    Path(final + ".tmp", ".metadata").write_bytes(b"index")
    checkpoint.finish(final, keep=1)
    left = sorted(os.path.basename(p) for p in checkpoint.complete(str(folder)))
    wanted = ["step00000003", "step00000058"]
    return [] if left == wanted else [f"left {left}, wanted {wanted}"]


def rules(step_dir: str, folder: str) -> dict:
    """The output rule and --keep, each as the step has it and with its plant."""
    from support import outputs

    found, root = {}, Path(folder)
    for name, plant in (("rule", None), ("rule planted", old_refusal)):
        found[name] = with_plant(outputs, "refusal", plant, lambda: rule_problems(outputs, root / name))
    if not (Path(step_dir) / "support" / "checkpoint.py").is_file():
        return found
    from support import checkpoint

    by_name = lambda final, keep: checkpoint.complete(os.path.dirname(final))[:-keep]  # the old --keep
    for name, plant in (("keep", None), ("keep planted", by_name)):
        found[name] = with_plant(checkpoint, "pruned", plant, lambda: keep_problems(checkpoint, root / name))
    return found


def with_plant(module, name: str, plant, check):
    """check() with module.name replaced by plant (None: as it is), in a fresh folder; the module restored."""
    kept = getattr(module, name)
    setattr(module, name, plant or kept)
    try:
        return check()
    finally:
        setattr(module, name, kept)


def tool(job):
    """The function a job's cases call, its step folder first on the path."""
    if job.get("step_dir"):
        sys.path.insert(0, os.path.abspath(job["step_dir"]))
    sys.path.insert(1, str(TESTS))
    if job["tool"] == "train":
        import train
        return train.parse_args
    if job["tool"] == "lab":
        import lab
        return lab.main
    import exercise
    exercise.COPIES = Path(job["copies"])
    return exercise.main


def main(jobs_file):
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    found = []
    for job in json.loads(Path(jobs_file).read_text()):
        if job["tool"] == "rules":
            sys.path.insert(0, os.path.abspath(job["step_dir"]))
            found.append(rules(job["step_dir"], job["folder"]))
        else:
            call = tool(job)
            found.append([captured(lambda: call(list(argv))) for argv in job["cases"]])
    print(json.dumps(found))


if __name__ == "__main__":
    main(*sys.argv[1:])

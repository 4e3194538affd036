"""How tests/replay.py reports: a schedule that raised, in one line, and the whole report as a few readable
lines with the failures first (tests/exercise.py and a learner running the replay read these)."""
import os
import traceback


def describe_exception(error, folder):
    """One line: the exception, the innermost frame in the step's folder and the outermost one (the schedule
    function's own line), so that a learner sees where it surfaced and which of their lines led there."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename.startswith(folder + os.sep)]
    where = [f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}" for f in frames]
    text = f"{type(error).__name__}: {error}"
    if where:
        text += f" (at {where[-1]}" + (f", called from {where[0]}" if len(where) > 1 else "") + ")"
    return text


def report_failures(report):
    """Each line of the report that is a failure: a problem, a control not caught, a part that raised."""
    failures = []
    for key, value in report.items():
        if key.endswith("problems") or key in ("refused_but_safe", "part_errors", "torch_dualpipev_differences"):
            failures += [f"{key}: {v}" for v in value]
        elif key.endswith("_problem") and value is not None:
            failures.append(f"{key}: {value}")
        elif key.endswith(("_caught", "_deadlocks")) and not value:
            failures.append(f"control not caught: {key} is {value}")
    return failures


def summary(step_dir, report, failures, most=10):
    """The report as a few readable lines: the failures that say the same thing after their configuration's
    label are shown once, with how many there are."""
    head = (f"replay of {step_dir}: {report['configurations']} configurations in {report['seconds']} s "
            f"(schedules run over a fake transport whose operations complete in posting order, one stream "
            f"per rank, as NCCL's do)")
    if not failures:
        return head + "\nevery check passed"
    alike = {}  # what went wrong -> (first label, how many)
    for failure in failures:
        kind, _, rest = failure.partition(": ")
        label, sep, what = rest.partition(": ") if kind == "problems" else (kind, ": ", rest)
        first, count = alike.get(what or label, (label if sep else kind, 0))
        alike[what or label] = (first, count + 1)
    lines = [head, f"{report['problem_count']} configurations fail, and {len(failures) - len(report['problems'])} "
                   f"other checks; {len(alike)} distinct problems (among the first 50 configurations):"]
    lines += [f"  {first}" + (f" (and {count - 1} alike)" if count > 1 else "") + f": {what}"
              for what, (first, count) in list(alike.items())[:most]]
    return "\n".join(lines + ["(python tests/replay.py --json STEP_DIR prints the whole report)"])

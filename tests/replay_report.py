"""How tests/replay.py reports: a schedule that raised, in one line, and the whole report as a few readable
lines with the failures first (tests/exercise.py and a learner running the replay read these); main, the
command's run over every configuration, on all of the machine's cores."""
import json
import os
import time
import traceback
from concurrent.futures import ProcessPoolExecutor


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


def check_on_every_core(step_dir, configurations):
    """Step.check's problems for each (schedule, pp, m, v, ordering), in order. The replays are independent,
    so they are spread over the machine's cores; each worker process loads the step once."""
    with ProcessPoolExecutor(os.cpu_count(), initializer=_load_step, initargs=(step_dir,)) as pool:
        return list(pool.map(_check, configurations, chunksize=8))


_STEP = None  # a worker's Step


def _load_step(step_dir):
    from replay import Step

    global _STEP
    _STEP = Step(step_dir)


def _check(configuration):
    name, pp, m, virtual, ordering = configuration
    return _STEP.check(name, pp, m, ordering, virtual)


def main(step_dir, as_json=False):
    """Replay every configuration of the step; print the report (a summary, or JSON); return the exit status:
    0 if every check passed, 1 if any found a problem."""
    from ideal import check_zb1p_bubble
    from replay import Step  # replay.py imports this module, so not at the top
    from replay_controls import negative_controls
    from timeout_count import check_timeout_count  # step 04 on
    from two_way import check_two_way  # step 08
    from weight_versions import check_pipedream  # step 04 on

    step, start = Step(step_dir), time.perf_counter()
    allowed = list(step.configurations())
    # A refused ordering must be one that really fails: the rules refuse no safe configuration.
    refused = [(name, pp, m, v, ordering) for name, pp, m, v, ordering in step.configurations(allowed=False)
               if ordering == "ordered" and step.allowed(name, pp, m, v, "batched")]
    found = check_on_every_core(step_dir, allowed + refused)
    problems = [problem for each in found[:len(allowed)] for problem in each]
    refused_but_safe = [f"{name} pp={pp} m={m} v={v} p2p={ordering}"
                        for (name, pp, m, v, ordering), each in zip(refused, found[len(allowed):]) if not each]
    # The schedules that some failure concerns: a test of any other schedule of the step can still run.
    at_fault = {name for (name, *_), each in zip(allowed, found) if each}
    at_fault |= {line.split()[0] for line in refused_but_safe}
    if "1f1b" in at_fault:  # pipedream.py runs its whole run through 1F1B's function
        at_fault |= {"pipedream", "pipedream-2bw"}
    report = dict(configurations=len(allowed), seconds=round(time.perf_counter() - start, 1),
                  problem_count=len(problems), problems=problems[:50], refused_but_safe=refused_but_safe[:50])
    # Each part: (what, its check, the schedules it replays). The negative controls break 1F1B's, interleaved's
    # and ZB-H1's orders; the timeout count is of the transport, which every schedule uses.
    parts = [("negative controls", negative_controls, ("1f1b", "interleaved", "zb1p")),
             ("timeout count", check_timeout_count, step.names)]
    parts += [("zb1p ideal timeline", check_zb1p_bubble, ("zb1p",))] if "zb1p" in step.schedules else []
    parts += [("DualPipe", check_two_way, ("dualpipe", "dualpipev"))] if "dualpipe" in step.schedules else []
    if os.path.exists(os.path.join(step_dir, "pipedream.py")):
        parts.append(("PipeDream", check_pipedream, ("pipedream", "pipedream-2bw")))
    for what, part, concerns in parts:
        try:
            result = part(step)
        except Exception as error:  # noqa: BLE001 (a learner's code may raise anything: report, do not crash)
            report.setdefault("part_errors", []).append(f"{what}: raised {describe_exception(error, step.folder)}")
            at_fault.update(concerns)
            continue
        report.update(result)
        if report_failures(result):
            at_fault.update(concerns)
    report["schedules_at_fault"] = sorted(at_fault & set(step.names))
    failures = report_failures(report)
    print(json.dumps(report) if as_json else summary(step_dir, report, failures))
    return 1 if failures else 0

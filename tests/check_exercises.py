"""The graded checks of tests/exercise.py that run a step's code, one per process (steps share module names).

    python tests/check_exercises.py replay STEP_DIR NAMES [EXTRA]    the schedules NAMES (comma-separated),
        replayed without a model (tests/replay.py) for every configuration the step's rules allow with
        pp <= 4, m <= 8, v <= 3; EXTRA: "pipedream" (weight versions), "two_way" (DualPipe's phases) or
        "zb1p_bubble" (ZB-H1's ideal idle time)
    python tests/check_exercises.py equivalence STEP_DIR WORLD FLAGS_JSON    one run against the single device
    python tests/check_exercises.py verbs STEP_DIR    step 01's four verbs, each called alone on a fake transport
        (stages 0-3 of 4): its peer, its buffer, what it returns, and its message box in the timeline

Each prints what it found, the first problem only, in a few lines, and exits 0 (passed) or 1 (failed).
"""
import json
import os
import re
import sys
import tempfile
from pathlib import Path

MAX_PP, MAX_M, MAX_V = 4, 8, 3
TWO_WAY = ("dualpipe", "dualpipev")  # replayed by tests/two_way.py, not by Step.check


def first_replay_problem(step, names):
    """The first problem of the named schedules over the small configurations, and how many were replayed."""
    count = 0
    for name, pp, m, virtual, ordering in step.configurations():
        if name in names and name not in TWO_WAY and pp <= MAX_PP and m <= MAX_M and virtual <= MAX_V:
            count += 1
            problems = step.check(name, pp, m, ordering, virtual)
            if problems:
                return problems[0], count
    return None, count


def first_pipedream_problem(step):
    """PipeDream's weight versions (tests/weight_versions.py) over the same small configurations."""
    import pipedream
    import weight_versions

    count = 0
    for args, order in weight_versions.configurations(step):
        if args.pp <= MAX_PP:
            count += 1
            problems = weight_versions.check_configuration(pipedream, args, order)
            if problems:
                return problems[0], count
    return None, count


def first_two_way_problem(step):
    """DualPipe's and DualPipeV's phases, order and messages (tests/two_way.py), pp <= 4."""
    import two_way

    count = 0
    for name, pp, m in two_way.configurations(step):
        if pp <= MAX_PP:
            count += 1
            try:
                problems = two_way.check_configuration(step, name, pp, m)
            except Exception as error:  # noqa: BLE001 (a learner's code may raise anything)
                from replay import describe_exception
                problems = [f"{name} pp={pp} m={m}: raised {describe_exception(error, step.folder)}"]
            if problems:
                return problems[0], count
    return None, count


def phase_count_problem(folder):
    """DualPipe's table: at every place of a V, the phases hold each of F0, F1, B0, B1 exactly `crossing` times."""
    import dualpipe

    for v_ranks in range(1, 5):
        for place in range(v_ranks):
            for crossing in range(2 * v_ranks, 2 * v_ranks + 5):
                counts = dualpipe.phase_counts(v_ranks, place, crossing)
                for kind in ("F0", "F1", "B0", "B1"):
                    got = sum(n * phase.count(kind) for phase, n in counts.items())
                    if got != crossing:
                        return (f"phase_counts(v_ranks={v_ranks}, place={place}, crossing={crossing}) = {counts}: "
                                f"its phases run {kind} {got} times, not crossing = {crossing}")
    return None


def zb1p_bubble_problem(step):
    """ZB-H1's ideal timeline (tests/ideal.py): every rank idles (p-1)(F+B-W), or the first rank that does not."""
    from ideal import check_zb1p_bubble

    problems = check_zb1p_bubble(step, (MAX_PP, MAX_M))["zb1p_bubble_problems"]
    if not problems:
        return None
    return (f"{problems[0]} in the ideal timeline (each pass takes its time; a rank waits only where it waits "
            f"for a message): the W's do not fill the time the rank waits for its next activation")


def replay_check(step_dir, names, extra=None):
    import replay

    step = replay.Step(step_dir)
    names = names.split(",")
    try:
        problem, count = first_replay_problem(step, names)
        if problem is None and extra == "pipedream":
            problem, more = first_pipedream_problem(step)
            count += more
        if problem is None and extra == "two_way":
            problem = phase_count_problem(step.folder)
        if problem is None and extra == "two_way":
            problem, more = first_two_way_problem(step)
            count += more
        if problem is None and extra == "zb1p_bubble":
            problem = zb1p_bubble_problem(step)
    except Exception as error:  # noqa: BLE001 (the step's rules or layout may call the learner's code)
        problem = f"the step's code raised {replay.describe_exception(error, step.folder)}"
    if problem is None:
        print(f"{count} configurations replayed, no problem")
        return 0
    print(problem)
    if "deadlock" in problem:
        print("The replay completes each rank's operations in the order they were posted, one stream per rank, "
              "as NCCL does on a GPU; gloo on a CPU may not block there, but NCCL would.")
    return 1


def equivalence_check(step_dir, world, flags):
    from harness import compare_case, memory_errors, run_cases
    from test_equivalence import TINY, tolerances

    flags = [*TINY, *flags, "--timeout", "10"]  # a deadlock is named after 10 s, not 60
    os.environ["PP_TEST_PG_TIMEOUT"] = "10"  # the ranks' default group too (step 01's verbs use it)
    label = " ".join(flags[len(TINY):-2])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        failure = run_cases(Path(step_dir), world, [flags], out, timeout=120)[0]
        if failure:
            print(f"[{label}] on {world} ranks: the run failed")
            print("\n".join(failure_lines(failure, step_dir)))
            return 1
        errors = compare_case(out / "case0", world, label, *tolerances(flags)) + memory_errors(out / "case0", world, label)
    if errors:
        print(f"[{label}] on {world} ranks differs from the single device ({len(errors)} differences), first:")
        print("\n".join(errors[:6]))
        return 1
    print(f"[{label}] on {world} ranks equals the single device")
    return 0


def failure_lines(text, step_dir, most=8):
    """From a failed launch's report (every rank's last output): per rank, its status and the exception's
    last line (or the crash faulthandler reported), with the frame of the learner's folder it came from."""
    folder, lines, frame, crash = str(Path(step_dir).resolve()), [], None, None
    for line in text.splitlines():
        stripped = re.sub(r"^\[rank\d+\]:", "", line.strip()).strip()  # torch's prefix of a rank's traceback
        stripped = re.sub(r"^(harness\.)?RunFailed: ", "", stripped)
        if stripped.startswith("rank ") and any(f" {how} " in stripped for how in ("exited", "stalled", "killed")):
            lines += ["  " + crash] if crash else []
            lines.append(re.sub(r"\[--.*?\]: ", "", stripped.split("; last output")[0]))  # the case's flags: shown
            frame, crash = None, None
        elif stripped.startswith("Fatal Python error:"):  # faulthandler: the crash, then its frames, newest first
            crash = stripped
        elif stripped.startswith(f'File "{folder}'):
            path, _, rest = stripped[6:].partition('", line ')
            frame = f"  at {Path(path).name}:{rest.replace(', in ', ' in ')}"
            if crash:  # the crashed thread's newest frame in the learner's folder
                lines += [frame, "  " + crash]
                frame, crash = None, None
        elif stripped.startswith("error:") or (":" in stripped and stripped.split(":")[0].endswith(("Error", "Exception"))):
            lines += ([frame] if frame else []) + ["  " + stripped[:300]]
            frame = None
    lines += ["  " + crash] if crash else []
    return list(dict.fromkeys(lines))[:most] or text.splitlines()[:most]


class RecordingDist:
    """What step 01's pipeline.py sees of torch.distributed in verbs_check: each send or receive is recorded
    (peer, tensor), a receive fills its buffer with RECEIVED; nothing waits."""
    RECEIVED = 7.0

    def __init__(self):
        self.calls = []

    def send(self, tensor, dst, group=None, tag=0):
        self.calls.append(("send", dst, tensor.detach().clone()))

    def recv(self, tensor, src=None, group=None, tag=0):
        self.calls.append(("recv", src, tensor))
        tensor.fill_(self.RECEIVED)
        return src

    def isend(self, tensor, dst, group=None, tag=0):
        self.send(tensor, dst)
        return type("Work", (), {"wait": lambda self, timeout=None: True})()

    def irecv(self, tensor, src=None, group=None, tag=0):
        self.recv(tensor, src)
        return type("Work", (), {"wait": lambda self, timeout=None: True})()


# verb -> (what it does, its peer from stage s, the stages of 4 that call it)
VERBS = {"recv_forward": ("recv", lambda s: s - 1, (1, 2, 3)), "send_forward": ("send", lambda s: s + 1, (0, 1, 2)),
         "recv_backward": ("recv", lambda s: s + 1, (0, 1, 2)), "send_backward": ("send", lambda s: s - 1, (1, 2, 3))}


def verb_problem(pipeline, timeline, name, index):
    """What is wrong with one verb called on stage `index` of 4, or None."""
    import torch

    kind, peer, _ = VERBS[name]
    dist, recorder = RecordingDist(), timeline.Timeline()
    real, pipeline.dist = pipeline.dist, dist
    previous = timeline.install(recorder)
    stage = pipeline.Stage(model=None, index=index, count=4, shape=(2, 3, 4), device=torch.device("cpu"))
    sent = torch.arange(24.0).reshape(2, 3, 4)
    try:
        got = getattr(pipeline, name)(stage, sent) if kind == "send" else getattr(pipeline, name)(stage)
    finally:
        pipeline.dist = real
        timeline.install(previous)
    where = f"{name} on stage {index} of 4"
    if [c[0] for c in dist.calls] != [kind]:
        return f"{where} made the calls {[c[0] for c in dist.calls]}, expected one {kind}"
    _, to, tensor = dist.calls[0]
    if to != peer(index):
        return f"{where} {'sent to' if kind == 'send' else 'received from'} rank {to}, expected rank {peer(index)}"
    if kind == "send" and not torch.equal(tensor, sent):
        return f"{where} sent other values than it was given"
    if kind == "recv" and (tuple(tensor.shape) != stage.shape or got is None or not torch.equal(got, tensor)):
        return f"{where} must receive into a buffer of stage.shape {stage.shape} and return it"
    if not any(e["kind"] in timeline.MESSAGES for e in recorder.events):
        return (f"{where} recorded no message span, so the trace has no box for its message: wrap the "
                f"{kind} in span(\"{kind}\", what=...)")
    return None


def verbs_check(step_dir):
    """Step 01's four verbs, each alone on a fake transport: the first problem, or they pass."""
    sys.path.insert(0, str(Path(step_dir).resolve()))
    try:
        import pipeline
        timeline = sys.modules[pipeline.span.__module__]  # the harness's recorder, wherever it lives
        problem = next((p for name, (_, _, stages) in VERBS.items() for index in stages
                        if (p := verb_problem(pipeline, timeline, name, index))), None)
    except Exception as error:  # noqa: BLE001 (a learner's code may raise anything)
        from replay import describe_exception
        problem = f"the verbs raised {describe_exception(error, str(Path(step_dir).resolve()))}"
    if problem:
        print(problem)
        return 1
    print("the four verbs talk to the right neighbours, receive into stage.shape and record their messages")
    return 0


def main(argv):
    kind, step_dir, *rest = argv
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if kind == "replay":
        return replay_check(step_dir, *rest)
    if kind == "verbs":
        return verbs_check(step_dir)
    return equivalence_check(step_dir, int(rest[0]), json.loads(rest[1]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

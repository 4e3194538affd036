"""The graded checks of tests/exercise.py that run a step's code, one per process (steps share module names).

    python tests/check_exercises.py replay STEP_DIR NAMES [EXTRA]    the schedules NAMES (comma-separated),
        replayed without a model (tests/replay.py) for every configuration the step's rules allow with
        pp <= 4, m <= 8, v <= 3; EXTRA: "pipedream" (weight versions) or "two_way" (DualPipe's phases)
    python tests/check_exercises.py equivalence STEP_DIR WORLD FLAGS_JSON    one run against the single device

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


def main(argv):
    kind, step_dir, *rest = argv
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if kind == "replay":
        return replay_check(step_dir, *rest)
    return equivalence_check(step_dir, int(rest[0]), json.loads(rest[1]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

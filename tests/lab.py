"""The schedule lab: any list of actions, from its picture to a proof that it trains the same model.

    python tests/lab.py FILE --pp 4 --microbatches 8 [--times 1:1:1] [--png OUT.png] [--no-run]
                        [--challenge NAME] [--step-dir step08_dualpipe]

FILE is a compute-only CSV in PyTorch's notation, one row per rank (step 08's action_lists.py; what
torch's _dump_csv writes, or train.py --dump-schedule). The lab takes it through, in order:

  1. validation: one line per problem, naming the rank and the action;
  2. the replay (tests/replay.py): the step's own runtime on fake stages and transport, deadlock-free
     when every operation completes in posting order (NCCL's in-order streams), or where each rank waits;
  3. the ideal timeline (tests/ideal.py) at the pass times F:B:W (a full B takes B + W): idle per rank;
  4. the peak stored microbatches per rank (from each F until its B or W);
  5. a drawing of the ideal timeline (the step's plots.py), into --png;
  6. a real run on gloo, one process per rank, whose gradients, losses and weights must equal one
     device's (tests/harness.py, fp32 to 1e-5).

It prints one table and exits 1 on any failure; bad input exits 2 with one line, before any work.
--challenge NAME grades the list against a design target (lab_challenges.py).
"""
import argparse
import os
import sys
import tempfile
from fractions import Fraction
from functools import partial
from pathlib import Path

from harness import REPO, RunFailed, compare_case, run_cases
from ideal import ideal_idle, ideal_passes
from lab_challenges import CHALLENGES
from replay import Step, check_consumed, match

KINDS = {"F": "forward", "B": "backward", "W": "W"}  # the timeline's names; a split B is "B"


DRAWING_MARK = b"pipeline parallelism from scratch, tests/lab.py"  # the Software text of the lab's PNGs


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are the lab's one `error:` line, exit 2 (as train.py's are)."""

    def error(self, message):
        refuse(f"{message} (see --help)")


def parse(argv):
    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument("file")
    p.add_argument("--pp", type=int, required=True)
    p.add_argument("--microbatches", type=int, required=True)
    p.add_argument("--times", default="1:1:1", help="F:B:W of the ideal timeline (B the input-gradient pass)")
    p.add_argument("--png", default=None, help="where to draw the ideal timeline (default: a temporary file)")
    p.add_argument("--no-run", action="store_true", help="skip the real gloo run")
    p.add_argument("--challenge", default=None, choices=sorted(CHALLENGES))
    p.add_argument("--step-dir", default=str(REPO / "step08_dualpipe"))
    return check_flags(p.parse_args(argv))


def check_flags(args):
    """Every flag, before any work: one line and exit 2 for the first that breaks its rule."""
    for flag in ("pp", "microbatches"):
        if getattr(args, flag) < 1:
            refuse(f"--{flag} {getattr(args, flag)} must be at least 1")
    if not (Path(args.step_dir) / "schedule_lab.py").is_file():
        what = "does not exist" if not Path(args.step_dir).exists() else "has no schedule_lab.py"
        refuse(f"--step-dir {args.step_dir} {what}: the lab runs step 08 (step08_dualpipe) or a copy of it")
    if not Path(args.file).is_file():
        refuse(f"{args.file} " + ("is a directory: give a list's CSV file" if Path(args.file).is_dir()
                                  else "does not exist" if not Path(args.file).exists() else "is not a regular file"))
    if args.png and Path(args.png).suffix.lower() != ".png":
        refuse(f"--png {args.png} must end in .png: the drawing is a PNG image")
    return args


def is_drawing(head: bytes) -> bool:
    """A PNG the lab drew: its Software text is DRAWING_MARK."""
    return head.startswith(b"\x89PNG") and b"Software\x00" + DRAWING_MARK in head


def refuse(line: str):
    print(f"error: {line}", file=sys.stderr)
    sys.exit(2)


def read(lists, args):
    """The list, or one line and exit 2: bad cells, a rank count other than --pp, a stage that does not exist."""
    try:
        times = tuple(Fraction(t) for t in args.times.split(":"))
        assert len(times) == 3 and all(t > 0 for t in times)
    except (ValueError, AssertionError, ZeroDivisionError):
        refuse(f"--times {args.times} must be three positive numbers F:B:W")
    try:
        plan = lists.read_schedule(args.file)
    except lists.ScheduleError as err:
        refuse(f"{args.file}: {err}")
    except OSError as err:
        refuse(f"{args.file} cannot be read: {err.strerror}")
    shape = [p for p in lists.layout_problems(plan, args.pp, args.microbatches)]
    if shape:
        refuse(f"{args.file}: {shape[0]}" + (f" (and {len(shape) - 1} more)" if len(shape) > 1 else ""))
    return plan, times


class ListStep(Step):
    """The replay's Step, running one list: its layout is the list's placement."""

    def __init__(self, step_dir, lab, lists, plan):
        super().__init__(step_dir)
        self.plan, self.lists = plan, lists
        self.schedules["file"] = partial(lab.run_plan, plan=plan)

    def layout(self, name, pp, m, virtual, rank):
        return self.lists.stages_of(self.plan, rank), len(self.lists.placement(self.plan))


def replay(step, pp, m):
    """(problems, logs): the list replayed on fake stages, its streams matched in posting order."""
    try:
        logs, dist = step.replay("file", pp, m, "batched")
    except step.lists.ScheduleError as err:
        return [str(err)], None
    problems = match(dist.streams, pp)
    if not problems:
        problems = [f"rank {rank}: {p}" for rank, log in enumerate(logs) for p in check_consumed(log)]
    return problems, logs


def draw(step, logs, times, path):
    """The ideal timeline as the step's plots.py draws a measured one."""
    import matplotlib
    matplotlib.use("Agg")
    from support import outputs, plots
    boxes = ideal_passes(logs, times)
    events = [dict(kind="B" if b["split"] else KINDS[b["kind"]], microbatch=b["mb"], chunk=b["chunk"],
                   rank=b["rank"], step=0, start=float(b["start"]) / 1e3, end=float(b["end"]) / 1e3) for b in boxes]
    ax = plots.draw_timeline(events, 0, title=f"ideal timeline of {Path(path).stem} (1 unit = 1 ms)")
    with outputs.open_temporary(path, "wb") as f:  # the step's rule for every file the course writes
        ax.figure.savefig(f, format="png", bbox_inches="tight", metadata={"Software": DRAWING_MARK.decode()})
    os.replace(f.name, path)
    return path


def real_run(args, plan, lists):
    """Problems of a gloo run of the list against the single-device reference (tests/harness.py). The run's
    folder is deleted afterwards: a problem quotes what it needs of the ranks' output."""
    stages = len(lists.placement(plan))
    flags = ["--device", "cpu", "--schedule-file", str(Path(args.file).resolve()), "--pp", str(args.pp),
             "--microbatches", str(args.microbatches), "--batch-size", str(2 * args.microbatches),
             "--layers", str(stages), "--hidden", "32", "--heads", "2", "--seq-len", "16", "--timeout", "60"]
    with tempfile.TemporaryDirectory(prefix="lab-") as out:
        failed = run_cases(Path(args.step_dir), args.pp, [flags], Path(out), timeout=300)[0]
        return [failed] if failed else compare_case(Path(out) / "case0", args.pp, Path(args.file).name)


def table(rows):
    width = max(len(r[0]) for r in rows)
    for name, ok, detail in rows:
        print(f"{name:<{width}}  {'pass' if ok else 'FAIL'}  {detail}")


def main(argv=None):
    args = parse(argv)
    sys.path.insert(0, str(Path(args.step_dir).resolve()))
    import action_lists as lists
    import schedule_lab as lab
    from support import outputs
    problem = outputs.check_all([("--png", args.png, "drawing", is_drawing)], [("the list", args.file)])
    if problem:
        refuse(problem)
    plan, times = read(lists, args)
    pp, m = args.pp, args.microbatches
    rows = []
    problems = lists.order_problems(plan, m)
    for line in problems:
        print(line)
    rows.append(("validation", not problems, f"{len(problems)} problems" if problems else "each F before its "
                 "backward, each (stage, mb) once, I before W"))
    if problems:
        return finish(rows)
    step = ListStep(args.step_dir, lab, lists, plan)
    problems, logs = replay(step, pp, m)
    for line in problems:
        print(line)
    rows.append(("replay (in-order streams)", not problems, problems[0][:100] if problems else "deadlock-free, "
                 "every message where it belongs"))
    if problems:
        return finish(rows)
    f, b, w = times
    idle = ideal_idle(logs, {"F": f, "B": b, "W": w})
    rows.append((f"ideal idle at F:B:W = {args.times}", True, " ".join(f"r{r}:{float(i):g}" for r, i in enumerate(idle))))
    peaks = [lab.peak_stored(actions) for actions in plan]
    rows.append(("peak stored microbatches", True, " ".join(f"r{r}:{p}" for r, p in enumerate(peaks))))
    png = args.png or str(Path(tempfile.mkdtemp(prefix="lab-")) / (Path(args.file).stem + ".png"))
    rows.append(("drawing", True, draw(step, logs, {"F": f, "B": b, "W": w}, png)))
    if args.challenge:
        verdict = CHALLENGES[args.challenge](plan, pp, m, idle, peaks, lists, times)
        rows.append((f"challenge {args.challenge}", verdict is None, verdict or "met"))
    if not args.no_run:
        problems = real_run(args, plan, lists)
        for line in problems:
            print(line)
        rows.append(("gloo run vs one device", not problems, problems[0][:100] if problems else
                     "losses, gradients, weights equal (fp32, 1e-5)"))
    return finish(rows)


def finish(rows):
    table(rows)
    return 0 if all(ok for _, ok, _ in rows) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RunFailed as err:
        print(f"gloo run failed: {err}", file=sys.stderr)
        sys.exit(1)

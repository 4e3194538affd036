"""Run a step's own flag checks on many bad configurations in one process.

    python tests/check_bad_flags.py STEP_DIR CASES.json   ->  prints a JSON list, one entry per case

CASES.json holds [[world, [flags...]], ...]. For each case this process plays rank 0 of `world` ranks
(the environment torchrun would set) and calls the step's `train.parse_args(flags)`, exactly what
`train.main` does first, before any process group or model exists. It reports whether parsing ended
the program (SystemExit), with which code, the last line it wrote to stderr, and to stdout (an accepted
--resume says there which checkpoint it takes). One process for all
cases: starting Python and torch once per bad flag would cost a second or two each. That a refused
configuration also ends a real `torchrun` launch, with the same one line, is tested per step in
test_train.py (test_under_torchrun_rank_0_alone_speaks).

    python tests/check_bad_flags.py STEP_DIR --estimate WORLD FLAG...  ->  the step's memory estimate per stage

prints config.stages_bytes (budget.py's lower bounds) for `train.py FLAG...` on WORLD ranks, for
test_train.py to hold against the memory a real run measured.

    torchrun ... tests/check_bad_flags.py STEP_DIR --late LATE_S [--exit-at-once] FLAG...

is one rank of a refused launch under torchrun, with rank 0 reaching its check LATE_S seconds after the
others: the order of exits that lost the `error:` line before ranks other than 0 waited for rank 0
(config.refuse). --exit-at-once is that old behaviour, the control: those ranks exit as soon as they refuse.
"""
import io
import json
import os
import sys
import time
from contextlib import redirect_stderr, redirect_stdout


def check(train, world, flags):
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    err, out = io.StringIO(), io.StringIO()
    try:
        with redirect_stderr(err), redirect_stdout(out):
            train.parse_args(flags)
        code = None  # accepted: the check failed to refuse it
    except SystemExit as done:
        code = done.code
    lines, said = err.getvalue().strip().splitlines(), out.getvalue().strip().splitlines()
    return dict(exit_code=code, last_line=lines[-1] if lines else "", printed=said[-1] if said else "")


def estimate(world, flags):
    """The step's memory lower bounds per stage, as rank 0 of `world` computes them for these flags."""
    import config

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    args = config.check_config(config.build_parser().parse_args(flags), world, False)
    return config.stages_bytes(args)


def exit_at_once(err, rank):
    """The control: config.refuse as it was, every rank but 0 exiting at once, saying nothing."""
    if rank == 0:
        print(f"error: {err}", file=sys.stderr, flush=True)
    sys.exit(2)


def late_rank_0(train, late_s, flags, control):
    """Run train.main(flags) as this torchrun rank, rank 0 starting `late_s` seconds after the others."""
    import config

    if control:
        config.refuse = exit_at_once
    if int(os.environ["RANK"]) == 0:
        time.sleep(late_s)
    train.main(flags)


def main(step_dir, mode, *rest):
    sys.path.insert(0, os.path.abspath(step_dir))
    import train

    if mode == "--estimate":
        print(json.dumps(estimate(int(rest[0]), list(rest[1:]))))
    elif mode == "--late":
        control = rest[1:2] == ("--exit-at-once",)
        late_rank_0(train, float(rest[0]), list(rest[1 + control:]), control)
    else:
        with open(mode) as f:
            cases = json.load(f)
        print(json.dumps([check(train, world, flags) for world, flags in cases]))


if __name__ == "__main__":
    main(*sys.argv[1:])

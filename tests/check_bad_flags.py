"""Run a step's own flag checks on many bad configurations in one process.

    python tests/check_bad_flags.py STEP_DIR CASES.json   ->  prints a JSON list, one entry per case

CASES.json holds [[world, [flags...]], ...]. For each case this process plays rank 0 of `world` ranks
(the environment torchrun would set) and calls the step's `train.parse_args(flags)`, exactly what
`train.main` does first, before any process group or model exists. It reports whether parsing ended
the program (SystemExit), with which code, and the last line it wrote to stderr. One process for all
cases: starting Python and torch once per bad flag would cost a second or two each. That a refused
configuration also ends a real `torchrun` launch, with the same one line, is tested per step in
test_train.py (test_under_torchrun_rank_0_alone_speaks).
"""
import io
import json
import os
import sys
from contextlib import redirect_stderr, redirect_stdout


def check(train, world, flags):
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    err = io.StringIO()
    try:
        with redirect_stderr(err), redirect_stdout(io.StringIO()):
            train.parse_args(flags)
        code = None  # accepted: the check failed to refuse it
    except SystemExit as done:
        code = done.code
    lines = err.getvalue().strip().splitlines()
    return dict(exit_code=code, last_line=lines[-1] if lines else "")


def main(step_dir, cases_json):
    sys.path.insert(0, os.path.abspath(step_dir))
    import train

    with open(cases_json) as f:
        cases = json.load(f)
    print(json.dumps([check(train, world, flags) for world, flags in cases]))


if __name__ == "__main__":
    main(*sys.argv[1:3])

"""Check the formulas a step prints against tests/formulas.py, for every configuration its rules allow.

    python tests/check_formulas.py STEP_DIR   ->  prints a JSON report

train.py prints `bubble_formula(args)` and `peak_stored_microbatches(args, stage)`, each a (text, value)
pair from one function; this imports those functions from the step and compares their values. Step 08's
zb1p, dualpipe and dualpipev formulas also take the measured F, B and W times; they are checked for several,
dualpipe and dualpipev with each --pairs placement.
PipeDream's (step 04 on) come from the step's pipedream.py, with its peak_versions, over run lengths and flags.
"""
import importlib
import json
import os
import sys

import formulas

MAX_PP, MAX_M, MAX_V = 8, 32, 4
TIMES = [(1.0, 1.0, 1.0), (1.0, 1.2, 0.6), (2.0, 1.5, 0.5), (1.0, 3.0, 0.5), (1.0, 1.1, 2.0), (3.0, 1.0, 2.0),
         (1.0, 3.0, 4.0)]  # (F, B, W) for step 08's split schedules: each of DualPipe's six chains is longest in one
TIMES_SEQUENTIAL = [(1.0, 1.0, 1.0), (1.0, 1.1, 0.1), (1.0, 1.1, 1.2), (1.0, 1.6, 1.75), (1.0, 1.6, 0.1), (1.0, 0.1, 1.0),
                    (1.0, 0.6, 0.5), (1.0, 0.1, 0.5), (1.0, 0.3, 0.25), (1.0, 0.2, 0.1), (1.0, 0.1, 0.2)]  # --pairs sequential
SPLIT = ("zb1p", "dualpipe", "dualpipev", "zbv")
PIPEDREAM_FLAGS = [[], ["--vertical-sync"], ["--no-weight-stashing"], ["--steps", "1"], ["--steps", "3"]]


def configurations(parser):
    """Flag sets over pp, m, and where the step has them, schedules and virtual stages."""
    options = {action.dest: action for action in parser._actions}
    schedules = options["schedule"].help.split(" (")[0].split(" | ") if "schedule" in options else [None]
    for schedule in schedules:
        for pp in range(1, MAX_PP + 1):
            for m in range(1, MAX_M + 1) if "microbatches" in options else [1]:
                for v in range(1, MAX_V + 1) if "virtual_stages" in options else [1]:
                    flags = ["--pp", str(pp), "--layers", str(MAX_PP * MAX_V), "--device", "cpu"]
                    flags += ["--microbatches", str(m), "--batch-size", str(m)] if "microbatches" in options else []
                    flags += ["--schedule", schedule] if schedule else []
                    flags += ["--virtual-stages", str(v)] if v > 1 else []
                    for extra in PIPEDREAM_FLAGS if schedule and schedule.startswith("pipedream") else \
                            [[], ["--pairs", "sequential"]] if schedule in ("dualpipe", "dualpipev") else [[]]:
                        yield schedule, pp, m, v, flags + extra


def main(step_dir):
    sys.path.insert(0, os.path.abspath(step_dir))
    config = importlib.import_module("config")
    has_schedule = os.path.exists(os.path.join(step_dir, "schedule.py"))
    module = importlib.import_module("schedule" if has_schedule else "pipeline")
    default = "naive" if not hasattr(module, "peak_stored_microbatches") else "gpipe"
    parser, problems, count = config.build_parser(), [], 0
    for schedule, pp, m, v, flags in configurations(parser):
        args = parser.parse_args(flags)
        try:
            config.check_config(args, pp, False)
        except config.ConfigError:
            continue
        count += 1
        name = schedule or ("afab" if module.__name__ == "schedule" else default)
        if name.startswith("pipedream"):
            problems += pipedream_problems(importlib.import_module("pipedream"), args, f"{' '.join(flags)}")
            continue
        sequential = getattr(args, "pairs", None) == "sequential"
        family = config.family(args) if hasattr(config, "family") else module  # step 08: DualPipe's is its own
        for times in (TIMES_SEQUENTIAL if sequential else TIMES) if name in SPLIT else [None]:  # they take F, B, W
            text, value = family.bubble_formula(args, *[times] if times else [])
            expected = formulas.bubble(name, pp, m, v, times or (1, 1, 1), sequential)
            if expected is None:  # PyTorch's schedules outside their formula's rule: the list's own timeline
                continue
            if abs(value - expected) > 1e-12:
                problems.append(f"{name} pp={pp} m={m} v={v}: bubble {text} = {value}, expected {expected}")
        for stage in range(pp) if hasattr(module, "peak_stored_microbatches") else []:
            text, value = family.peak_stored_microbatches(args, stage)
            if formulas.peak_stored(name, pp, stage, m, v) not in (None, value):
                problems.append(f"{name} pp={pp} m={m} v={v} stage {stage}: peak stored {text} = {value}, "
                                f"expected {formulas.peak_stored(name, pp, stage, m, v)}")
    print(json.dumps(dict(configurations=count, problems=problems[:50])))


def pipedream_problems(pipedream, args, label):
    """PipeDream's three formulas: the run's one fill and drain, 1F1B's activations over the run, versions."""
    problems, n = [], args.steps * args.microbatches
    text, value = pipedream.bubble_formula(args)
    if abs(value - formulas.pipedream_bubble(args.pp, args.microbatches, args.steps)) > 1e-12:
        problems.append(f"{label}: bubble {text} = {value}")
    for stage in range(args.pp):
        text, value = pipedream.peak_stored_microbatches(args, stage)
        if value != formulas.peak_stored(args.schedule, args.pp, stage, n):
            problems.append(f"{label} stage {stage}: peak stored {text} = {value}")
        text, value = pipedream.peak_versions(args, stage)
        if value != formulas.peak_versions(args.schedule, args.vertical_sync, args.pp, stage, args.steps,
                                           not args.no_weight_stashing):
            problems.append(f"{label} stage {stage}: peak versions {text} = {value}")
    return problems


if __name__ == "__main__":
    main(sys.argv[1])

"""Replay PipeDream's weight versions without a model (step 04 on), in tests/replay.py's report.

Each rank's order of forwards and backwards over a run's N = steps x m microbatches
comes from replaying the step's own 1F1B schedule over N microbatches (replay.Step,
fake transport, fake stages). A real WeightVersions of the step's pipedream.py, over a
one-number stand-in for the stage's weights and plain SGD, is then driven through that
order as PipelineStage drives it: forward(mb) at each F, backward_done(mb) at each B.
Every forward's gradient is 1, so version k of the stand-in holds a known number.

Checked for every configuration the step's rules allow up to p 8, m 6, 3 steps, against
rules written here from the papers:

  * stashing: the weights under every backward hold, value for value, what its forward read;
  * PipeDream: stage s's forward of microbatch i reads version i-(p-s-1) (0 at first);
    with vertical sync, the version stage 0's forward of i read, i-(p-1); with 2BW, batch
    t reads W(t-1), and the weights change once per m backwards;
  * the peak of versions held, the live one included: p-s, p with vertical sync,
    min(2, steps) with 2BW (tests/formulas.py), and the step's own peak_versions.

Controls that must be caught: stashing off (a backward reads weights an update has
changed), vertical sync's rule one version off, 2BW updating after every backward.
"""
from types import SimpleNamespace

import torch

import formulas

MAX_PP, MAX_M, MAX_STEPS = 8, 6, 3
LR = 0.5  # version k of the stand-in weight holds -LR x (the gradients summed into its k updates)


def run_order(step, pp, n):
    """[[("F" or "B", mb), ...] per rank]: the step's 1F1B order over n microbatches, from the replay."""
    logs, _ = step.replay("1f1b", pp, n, "batched")
    return [[(e[0], e[1][1]) for e in log if e[0] in ("F", "B")] for log in logs]


def drive(pipedream, order, args, stashing=True, rule=None, every=None):
    """Run one rank's order through a real WeightVersions. Returns a namespace: versions; read, {mb: value
    its forward read}; problems, backwards that read another value; version_read, {mb: version its forward
    read}; landed, {mb: the live version when its gradient lands (before the update it may trigger)}."""
    weight = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.zeros_(weight.weight)
    rule = pipedream.version_rule(args) if rule is None else rule
    every = pipedream.updates_every(args) if every is None else every
    versions = pipedream.WeightVersions(weight, torch.optim.SGD(weight.parameters(), lr=LR),
                                        args.steps * args.microbatches, rule, every, stashing)
    read, problems, version_read, landed = {}, [], {}, {}
    for kind, mb in order:
        if kind == "F":
            leaves = versions.forward(mb)
            read[mb], version_read[mb] = leaves["weight"].item(), versions.in_flight[mb][0]
            leaves["weight"].grad = torch.ones_like(leaves["weight"])  # what its backward will give
        else:
            held = versions.weights(mb)["weight"].item()
            if held != read[mb]:
                problems.append(f"the backward of {mb} reads {held}, its forward read {read[mb]}")
            landed[mb] = versions.version
            versions.backward_done(mb)
    return SimpleNamespace(versions=versions, read=read, problems=problems, version_read=version_read, landed=landed)


def expected_version(args, stage, mb):
    """The version a forward reads, from the papers: PipeDream (2019) without and with vertical sync, 2BW (2021)."""
    if args.schedule == "pipedream-2bw":
        return max(0, mb // args.microbatches - 1)
    # Stage s runs p-s-1 backwards, each with its update, between a forward and its backward; stage 0, p-1.
    delay = args.pp - 1 if args.vertical_sync else args.pp - stage - 1
    return max(0, mb - delay)


def check_rank(pipedream, args, stage, order, stage0_reads):
    """One rank's problems: values under backwards, versions read, updates, peak of versions held.
    Returns (problems, {mb: version its forward read})."""
    driven = drive(pipedream, order, args)
    versions, read, problems, reads = driven.versions, driven.read, driven.problems, driven.version_read
    every = pipedream.updates_every(args)
    for mb, version in reads.items():
        expected = expected_version(args, stage, mb)
        if version != expected:
            problems.append(f"the forward of {mb} read version {version}, expected {expected}")
        if stage0_reads is not None and version != stage0_reads[mb]:
            problems.append(f"the forward of {mb} read version {version}, stage 0's read {stage0_reads[mb]}")
        if read[mb] != -LR * every * version:  # each update subtracted LR x its `every` summed gradients of 1
            problems.append(f"the forward of {mb} read {read[mb]}, not version {version}'s {-LR * every * version}")
    n = args.steps * args.microbatches
    if versions.version != n // every:
        problems.append(f"{versions.version} updates over {n} backwards, expected {n // every}")
    expected = formulas.peak_versions(args.schedule, args.vertical_sync, args.pp, stage, args.steps)
    if not versions.peak_versions == expected == pipedream.peak_versions(args, stage)[1]:
        problems.append(f"peak {versions.peak_versions} versions held, formula {expected}, "
                        f"the step's {pipedream.peak_versions(args, stage)[1]}")
    return problems, reads


def configurations(step):
    """(args, order of every rank) for each PipeDream configuration the step's rules allow."""
    orders = {}
    for schedule, vertical in (("pipedream", False), ("pipedream", True), ("pipedream-2bw", False)):
        for pp in range(1, MAX_PP + 1):
            for m in range(1, MAX_M + 1):
                for steps in range(1, MAX_STEPS + 1):
                    flags = ["--steps", str(steps)] + (["--vertical-sync"] if vertical else [])
                    args = step.args(schedule, pp, m, 1, "batched", flags)
                    if step.allowed_args(args, pp):
                        if (pp, steps * m) not in orders:
                            orders[pp, steps * m] = run_order(step, pp, steps * m)
                        yield args, orders[pp, steps * m]


def check_configuration(pipedream, args, order):
    problems, stage0_reads = [], None
    for stage in range(args.pp):
        found, reads = check_rank(pipedream, args, stage, order[stage], stage0_reads if args.vertical_sync else None)
        stage0_reads = stage0_reads or reads
        problems += [f"stage {stage}: {p}" for p in found]
    label = f"{args.schedule}{' --vertical-sync' if args.vertical_sync else ''} pp={args.pp} m={args.microbatches}"
    return [f"{label} steps={args.steps}: {p}" for p in problems]


def controls(step, pipedream):
    """Each broken variant, on p 4, m 4, 3 steps, must be caught."""
    order = run_order(step, 4, 12)
    plain = step.args("pipedream", 4, 4, 1, "batched", ["--steps", "3"])
    vertical = step.args("pipedream", 4, 4, 1, "batched", ["--steps", "3", "--vertical-sync"])
    two_bw = step.args("pipedream-2bw", 4, 4, 1, "batched", ["--steps", "3"])
    off_by_one = lambda mb: max(0, mb - 4)  # noqa: E731 (vertical sync's rule at p 4, one version too old)
    return dict(
        pipedream_stashing_off_caught=bool(drive(pipedream, order[0], plain, stashing=False).problems),
        pipedream_vertical_off_by_one_caught=bool(
            [p for s in range(4) for p in check_rank_with_rule(pipedream, vertical, s, order[s], off_by_one)]),
        pipedream_2bw_every_backward_caught=drive(pipedream, order[0], two_bw, every=1).versions.peak_versions > 2)


def check_rank_with_rule(pipedream, args, stage, order, rule):
    """Versions read under a given (broken) rule that differ from the papers' rule."""
    reads = drive(pipedream, order, args, rule=rule).version_read
    return [mb for mb, version in reads.items() if version != expected_version(args, stage, mb)]


def check_pipedream(step):
    """The report's pipedream_* entries."""
    import pipedream

    problems, count = [], 0
    for args, order in configurations(step):
        problems += check_configuration(pipedream, args, order)
        count += 1
    return dict(pipedream_configurations=count, pipedream_problems=problems[:50], **controls(step, pipedream))

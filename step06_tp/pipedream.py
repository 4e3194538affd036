"""PipeDream: the 1F1B order over a whole run, never flushed, and the weight versions it needs.

1F1B as step 04 runs it is PipeDream-Flush (Megatron-LM's default): m microbatches go
through, the pipeline drains, then every stage steps its optimizer. Every microbatch
saw the same weights, as on one device, at the price of one fill and one drain per
batch. PipeDream (Narayanan et al. 2019) never drains. It runs 1F1B's order over all
steps x m microbatches of the run, and each stage steps its optimizer after each of
its backwards, so the fill and drain happen once per run.

The weights then change under microbatches in flight. Between stage s's forward of
microbatch i and its backward, the stage runs p-s-1 other backwards, each followed by
an update. Three ways to live with that, one per flag:

  weight stashing (always on, unless --no-weight-stashing): the forward of i uses the
      stage's live version and keeps it; the backward of i reads that same version, so
      the gradient is a true gradient, of i's loss at the weights its forward saw. Its
      update still lands on newer weights: stage s's gradients are p-s-1 updates stale.
      A stage keeps up to p-s versions. Without stashing the backward reads weights
      that have changed since the forward: a gradient of no function at all.
  --vertical-sync: every stage runs microbatch i on the version stage 0 used for it, so
      one microbatch sees one consistent model, p-1 updates stale on every stage, at
      the cost of up to p versions on every stage.
  --schedule pipedream-2bw (Narayanan et al. 2021): the stages accumulate gradients
      over m microbatches, as 1F1B-Flush does, and make a new version every m. Batch t
      runs on W(t-1) and its gradient updates W(t):
          W(t+1) = W(t) - lr * grad f_t(W(t-1)),
      a delay of one version, whatever the depth, with 2 versions per stage.

The versions cost no copy when they are made. A forward reads its version's storage
in place; an update copies the live weights only when a microbatch still needs the
version it is about to overwrite (copy-on-write).

PipeDream is an add-on to step 04's 1F1B: it runs schedule.py's 1F1B function as it
is, over PipeDreamStages, which override two seams of stage.PipelineStage (weights,
backward_done). As every schedule family (config.family), this module exposes
SCHEDULES, bubble_formula, peak_stored_microbatches, stage_class, train_steps,
peaks and report_lines; train.py and report.py ask it, not the schedule's name.
Its flags and their rules are its own as well (add_flags, check_flags), which config.py
calls, as it calls checkpoint.py's.
"""
import time
from functools import partial

import torch

from data import get_batch
from support.distributed import wait_for_device
from schedule import one_f_one_b_forward_backward
from stage import PipelineStage


def version_rule(args):
    """microbatch -> the weight version its forward runs on, or None: the stage's live version."""
    if args.schedule == "pipedream-2bw":
        return lambda mb: max(0, mb // args.microbatches - 1)  # batch t runs on W(t-1); batches 0 and 1 on W(0)
    if args.vertical_sync:
        # Stage 0's live version at its forward of mb: it updates after each backward, and in 1F1B its
        # backward of j comes right after its forward of j + p-1.
        return lambda mb: max(0, mb - (args.pp - 1))
    return None


def updates_every(args) -> int:
    """Backwards per update: 2BW accumulates a batch of m microbatches, PipeDream none."""
    return args.microbatches if args.schedule == "pipedream-2bw" else 1


def bubble_formula(args, times=None):
    """(text, value): one fill and one drain for the whole run of N = steps x m microbatches (times: unused)."""
    n = args.steps * args.microbatches
    return "(p-1)/(N+p-1), N = steps x m", (args.pp - 1) / (n + args.pp - 1)


def peak_stored_microbatches(args, stage: int):
    """(text, value): 1F1B's in-flight bound, over the run's N microbatches instead of a batch's m."""
    return "min(p-stage, N)", min(args.pp - stage, args.steps * args.microbatches)


def peak_versions(args, stage: int):
    """(text, value): the most weight versions (the live one included) `stage` holds at once."""
    if args.no_weight_stashing:  # every version is written over the last, in place
        return "1 (no stashing)", 1
    if args.schedule == "pipedream-2bw":  # W(1) is made while batch 1 still runs on W(0)
        return "min(2, steps)", min(2, args.steps)
    if args.vertical_sync:
        return "p", args.pp
    return "p-stage", args.pp - stage


class WeightVersions:
    """One stage's weight versions: the live weights its optimizer steps, and the older ones
    that microbatches in flight, or still to come (vertical sync, 2BW), run on.

    model, optimizer: this stage's (optimizer None: a pass that never updates). microbatches: how many
    the run has. rule: version_rule(args). every: backwards per update. stashing: False leaves every
    version in the live storage, which each update overwrites. before_step: run before each optimizer
    step (the data-parallel average). PipeDreamStage calls forward(mb) for the weights of mb's forward
    and backward_done(mb) after its backward.
    """

    def __init__(self, model, optimizer, microbatches, rule=None, every=1, stashing=True, before_step=None):
        self.params = dict(model.named_parameters())
        self.optimizer, self.microbatches, self.rule, self.every = optimizer, microbatches, rule, every
        self.stashing, self.before_step = stashing, before_step
        self.version = 0  # updates so far: the live weights are this version
        self.frozen = {}  # older version -> {name: tensor}: the storage its microbatches read
        self.in_flight = {}  # mb -> (version, {name: leaf}) from its forward to its backward
        self.forwards = self.backwards = 0
        self.peak_versions = 1
        self.version_bytes = sum(p.numel() * p.element_size() for p in self.params.values())

    def live(self):
        """The live weights' storage, as tensors of their own: autograd does not see an update write it."""
        return {name: p.data for name, p in self.params.items()}

    def forward(self, mb):
        """The weights mb's forward runs on: leaves over its version's storage, whose .grad is mb's alone."""
        version = self.version if self.rule is None else self.rule(mb)
        assert version == self.version or version in self.frozen, \
            f"microbatch {mb} needs version {version}, which this stage does not hold (live: {self.version})"
        source = self.live() if version == self.version else self.frozen[version]
        leaves = {name: t.detach().requires_grad_() for name, t in source.items()}
        self.in_flight[mb] = (version, leaves)
        self.forwards = mb + 1  # forwards run in microbatch order
        return leaves

    def weights(self, mb):
        """mb's leaves again: a recompute runs the forward on the same version."""
        return self.in_flight[mb][1]

    def backward_done(self, mb):
        """mb's backward has run: add its gradient to the live weights' and update every `every` backwards."""
        _, leaves = self.in_flight.pop(mb)
        for name, p in self.params.items():
            grad = leaves[name].grad
            if grad is not None:
                p.grad = grad if p.grad is None else p.grad.add_(grad)
        self.backwards += 1
        self.frozen = {v: tensors for v, tensors in self.frozen.items() if self.needed(v)}
        if self.backwards % self.every == 0:
            self.update()
        self.peak_versions = max(self.peak_versions, len(self.frozen) + 1)

    def update(self):
        """Copy-on-write, then one optimizer step on the live weights."""
        if self.stashing and self.needed(self.version):
            # The graphs of the microbatches on this version read the live storage: it becomes the frozen
            # version, and the optimizer writes a copy.
            self.frozen[self.version] = self.live()
            for p in self.params.values():
                p.data = p.data.clone()
        if self.before_step:
            self.before_step()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1

    def needed(self, version) -> bool:
        """Whether a microbatch in flight runs on `version`, or one still to come will (rules only)."""
        if any(v == version for v, _ in self.in_flight.values()):
            return True
        upcoming = self.rule is not None and self.forwards < self.microbatches
        return upcoming and self.rule(self.forwards) <= version  # rules never decrease with mb


class PipeDreamStage(PipelineStage):
    """A stage that runs each microbatch on the weight version its rank's WeightVersions hands out, and hands
    each backward's gradient back to it, which updates the live weights as the run goes."""

    def __init__(self, model, *, versions, **options):
        super().__init__(model, **options)
        self.versions = versions  # one per rank, shared by its stages
        self.losses = []  # last stage only: each microbatch's mean loss, in microbatch order

    def weights(self, mb):
        """mb's version as leaves: handed out at its forward, the same leaves again at its recompute."""
        return self.versions.weights(mb) if mb in self.versions.in_flight else self.versions.forward(mb)

    def forward(self, mb, x, target):
        out = super().forward(mb, x, target)
        if self.is_last:  # one loss per microbatch of the run: train_steps averages them per step
            self.losses.append(out.detach())
        return out

    def backward(self, mb, x, out, out_grad, *rest):
        """The seed is that of one update's microbatches (2BW: m, else 1), not of the run's N. (rest: what
        later steps add to PipelineStage.backward, passed on.)"""
        if self.is_last:  # d(mean loss of the update's microbatches) / d(microbatch mean loss)
            out_grad = torch.full_like(out, 1 / self.versions.every)
        return super().backward(mb, x, out, out_grad, *rest)

    def backward_done(self, mb):
        """The gradient goes to the live weights, maybe an update (timed as part of the backward)."""
        self.versions.backward_done(mb)


def pipedream_forward_backward(stages, comm, microbatches):
    """1F1B's order over every microbatch of the run, no flush; each stage's WeightVersions steps as its
    backwards end. Returns the mean loss over the run on the last stage, else None."""
    return one_f_one_b_forward_backward(stages, comm, microbatches)


SCHEDULES = {"pipedream": pipedream_forward_backward, "pipedream-2bw": pipedream_forward_backward}


def stage_class(args, model, before_update):
    """PipeDreamStage, bound to this rank's WeightVersions over `model`, stepped by a plain AdamW of its own
    (each stage steps alone: no loss scale, no global norm). before_update: run before each optimizer
    step (the data-parallel average)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    versions = WeightVersions(model, optimizer, args.steps * args.microbatches, version_rule(args),
                              updates_every(args), not args.no_weight_stashing, before_update)
    return partial(PipeDreamStage, versions=versions)


def warm_up(run, microbatches):
    """PipeDream's run is one pass, with no first step that the measurements can leave out as train.py's
    flushed_steps leaves out step 0. So the first batch goes through the pipeline once before the clock
    starts, off the timeline and the meter, on weight versions that never update, and its gradients are
    dropped: the one-off costs of first passes (fresh memory, first calls, first messages) are paid outside
    the measurement, and the run trains from the same weights. (The optimizer's first step, which creates
    its state, still falls inside the run.)"""
    kept = [stage.versions for stage in run.stages]
    for stage in run.stages:  # every=len+1: this pass makes no update
        stage.versions = WeightVersions(run.model, None, len(microbatches), every=len(microbatches) + 1)
    run.timeline.enabled = run.meter.enabled = False
    run.comm.begin_step()
    pipedream_forward_backward(run.stages, run.comm, microbatches)
    run.comm.finish_sends()
    for stage, versions in zip(run.stages, kept):
        stage.versions = versions
        stage.losses.clear()
    run.model.zero_grad(set_to_none=True)


def train_steps(run, flushed_steps, replica_microbatches, share_loss, start_recording):
    """PipeDream's run: one 1F1B pass over its steps x m microbatches, recorded as one step, the stages
    updating as they go. Afterwards, one record per m microbatches: their mean loss, and the run's time
    shared out evenly, since no rank stops between them. (flushed_steps serves the flushed families.)"""
    args, m = run.args, run.args.microbatches
    batches = [get_batch(run.tokens, step, args.batch_size, args.seq_len, args.seed) for step in range(args.steps)]
    microbatches = [mb for inputs, targets in batches for mb in replica_microbatches(run, inputs, targets)]
    warm_up(run, microbatches[:m])
    run.timeline.enabled = run.meter.enabled = True
    start_recording(run, 0)
    start = time.perf_counter()
    run.comm.begin_step()
    pipedream_forward_backward(run.stages, run.comm, microbatches)
    run.comm.finish_sends()  # on NCCL this only makes the stream wait: the host's clock waits for the GPU
    wait_for_device(run.device)
    elapsed = time.perf_counter() - start
    run.timeline.end_step()
    losses = [loss for stage in run.stages for loss in stage.losses]  # the last stage's, else none
    tokens = args.batch_size * args.seq_len
    return [dict(step=step, loss=share_loss(run, sum(losses[step * m:(step + 1) * m]) / m if losses else None),
                 step_time_s=elapsed / args.steps, tokens_per_s=tokens * args.steps / elapsed)
            for step in range(args.steps)]


def peaks(run) -> dict:
    """This rank's peak of weight versions held at once (the live one included), and the bytes of one."""
    versions = run.stages[0].versions
    return dict(peak_weight_versions=versions.peak_versions, version_bytes=versions.version_bytes)


def report_lines(args, record, name, stage_of):
    """Each rank's peak of weight versions held, beside its formula, and what the extra ones cost.
    name, stage_of: rank -> its name in the report, and the stage it holds."""
    text, _ = peak_versions(args, 0)
    lines = [f"weight versions, {args.schedule}: peak held (the live one included), measured vs formula {text}"]
    for rank, (count, size) in enumerate(zip(record["peak_weight_versions"], record["version_bytes"])):
        _, expected = peak_versions(args, stage_of(rank))
        lines.append(f"  rank {rank} ({name(rank)}): {count} (formula {expected}), "
                     f"{count - 1} stashed x {size / 2**20:.2f} MiB = {(count - 1) * size / 2**20:.2f} MiB")
    return lines


def add_flags(group):
    """PipeDream's flags, in the pipeline group of train.py's --help (config.py)."""
    group.add_argument("--vertical-sync", action="store_true",
                       help="pipedream: every stage runs a microbatch on the weight version stage 0 used")
    group.add_argument("--no-weight-stashing", action="store_true",
                       help="pipedream: backwards read the live weights, changed since their forward (a foil)")


def check_flags(args, cuda_available: bool):
    """PipeDream's flags, and runs long enough for the version counts its report states: refused
    before any work with a ValueError of one line (config.py, which passes every add-on cuda_available)."""
    for flag, on in (("--vertical-sync", args.vertical_sync), ("--no-weight-stashing", args.no_weight_stashing)):
        if on and args.schedule != "pipedream":
            raise ValueError(f"{flag} needs --schedule pipedream, not {args.schedule}")
    if args.vertical_sync and args.no_weight_stashing:
        raise ValueError("--vertical-sync runs microbatches on versions older than the live weights, which "
                         "only weight stashing keeps: drop --no-weight-stashing")
    if args.schedule in SCHEDULES and (args.save or args.resume):
        raise ValueError(f"--{'save' if args.save else 'resume'} does not fit --schedule {args.schedule}: its "
                         "stages update at different times, weight versions in flight, so the run has no step "
                         "boundary to save or resume at")
    n, least = args.steps * args.microbatches, 2 * (args.pp - 1)
    if args.schedule == "pipedream" and n < least:
        raise ValueError(f"--steps {args.steps} x --microbatches {args.microbatches} = {n} must be at least "
                         f"2 x (--pp {args.pp} - 1) = {least} for pipedream: in a shorter run stage 0 never "
                         "reaches the steady state whose versions it reports")
    if args.schedule == "pipedream-2bw" and args.microbatches < args.pp - 1:
        raise ValueError(f"--microbatches {args.microbatches} must be at least --pp {args.pp} - 1 for "
                         "pipedream-2bw: stage 0 makes W(t+1) after the last backward of batch t, which follows "
                         "its forward p-2 microbatches into batch t+1; batch t+2 runs on W(t+1), so it must "
                         "start after that")

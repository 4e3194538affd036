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
"""
from schedule import Stash, one_f_one_b_forward_backward

SCHEDULES = ("pipedream", "pipedream-2bw")


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


def bubble_formula(args):
    """(text, value): one fill and one drain for the whole run of N = steps x m microbatches."""
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

    model, optimizer: this stage's. microbatches: how many the run has. rule: version_rule(args).
    every: backwards per update. stashing: False leaves every version in the live storage, which
    each update overwrites. before_step: run before each optimizer step (the data-parallel average).
    PipelineStage calls forward(mb) for the weights of mb's forward and backward_done(mb) after its
    backward.
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


def pipedream_forward_backward(stages, comm, microbatches, per_update):
    """1F1B's order over every microbatch of the run, no flush; each stage's WeightVersions steps as its
    backwards end. per_update: microbatches per update, whose mean loss an update follows (2BW m, else 1).
    Returns every microbatch's loss on the last stage, else []."""
    stash = Stash(stages, comm, microbatches, per_update)
    one_f_one_b_forward_backward(stages, comm, microbatches, stash)
    return stash.losses

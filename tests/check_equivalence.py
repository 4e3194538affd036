"""One rank of a gradient-equivalence run. Started by harness.py, never by pytest itself.

    python tests/check_equivalence.py STEP_DIR OUT_DIR CASES_JSON

Imports the step's own modules (its folder goes first on sys.path, so two steps
never meet in one process) and uses the step's public training API:

    train.parse_args(argv)        flags -> args (checks the rules)
    train.build(args, device)     -> run, with run.model and run.optimizer
    train.compute_gradients(run, step) -> loss (float, same on every rank)
    train.train_step(run, step)   -> dict with "loss", after an optimizer step
    config.family(args).train_steps(run, train.flushed_steps, train.replica_microbatches, train.share_loss,
        train.start_recording)    -> PipeDream (step 04 on, pipedream.py): the whole run, one record per step
    distributed.init_distributed(device, timeout_s)   on the device the cases' --device names (cuda: NCCL)

For every case it saves this rank's loss, gradients after step 0, and weights
and losses after REFERENCE_STEPS optimizer steps, with the rank's place in the
grid and, from step 06 on, the dimension each tensor-parallel shard was split on
(`tp_split_dim`), so that harness.py can put the shards back together. Once every case has run, the ranks
compute the single-device references, each rank those of every world-th case: the whole model on the whole
global batch, written here and not with the step's pipeline code, so it cannot share that code's bugs.
"""
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from moe_reference import reference_experts

REFERENCE_STEPS = 3


def status(out: Path, rank: int, text: str):
    """Last words of this rank, read by the harness if the run stalls."""
    (out / f"rank{rank}.status").write_text(text)


def pipelined(train, argv, device, out_case: Path, rank: int):
    args = train.parse_args(argv)
    run = train.build(args, device)
    case = f"[{' '.join(argv)}]"
    status(out_case.parent, rank, f"{case}: step 0 forward/backward")
    losses = [train.compute_gradients(run, 0)]
    memory = stored_microbatches(run, args, rank)
    # Step 07 in half precision: the fp32 sums of the microbatches' gradients (still times the loss scale).
    grads = {n: getattr(p, "main_grad", p.grad).detach().cpu().clone() for n, p in run.model.named_parameters()
             if getattr(p, "main_grad", p.grad) is not None}
    names = [n for n, _ in run.model.named_parameters()]
    records = [run.optimizer.step() or {}]  # step 07 returns loss_scale, skipped and grad_norm
    for step in range(1, REFERENCE_STEPS):
        status(out_case.parent, rank, f"{case}: step {step}")
        records.append(train.train_step(run, step))
        losses.append(records[-1]["loss"])
    weights = {n: p.detach().cpu().clone() for n, p in run.model.named_parameters()}
    masters = dict(zip(names, getattr(run.optimizer, "masters", [])))  # step 07: the fp32 master weights
    scales = [r.get("loss_scale") for r in records]
    splits = {n: getattr(p, "tp_split_dim", None) for n, p in run.model.named_parameters()}
    # (replica, TP rank, TP size): no data parallelism before step 03 (no run.pgm), no TP before step 06.
    pgm = getattr(run, "pgm", None)
    place = (getattr(pgm, "dp_rank", 0), getattr(pgm, "tp_rank", 0), getattr(pgm, "tp", 1))
    norms = [r.get("grad_norm") for r in records]  # step 07 on: the global gradient norm of each step
    torch.save(dict(losses=losses, grads=grads, names=names, weights=weights, splits=splits, place=place, memory=memory,
                    masters={n: t.detach().cpu().clone() for n, t in masters.items()}, scales=scales, norms=norms),
               out_case / f"rank{rank}.pt")
    return args


def stored_microbatches(run, args, rank: int):
    """The peak of microbatches the activation meter saw this rank hold in step 0, with what the formula
    needs: the schedule, pp, m (PipeDream: the run's steps x m), v and this rank's stage (rank = stage * dp
    * tp + ...). None in step 01."""
    meter = getattr(run, "meter", None)
    if meter is None:
        return None
    stage = rank // (getattr(args, "dp", 1) * getattr(args, "tp", 1))
    schedule = getattr(args, "schedule", "afab")
    m = args.microbatches * (args.steps if schedule.startswith("pipedream") else 1)
    return dict(peak=meter.peak_stored_microbatches, schedule=schedule, pp=args.pp, m=m,
                v=getattr(args, "virtual_stages", 1), stage=stage)


def record_versions(versions) -> list:
    """Log what a rank's WeightVersions hands out, as PipelineStage drives it: ("F", mb, the version its
    forward reads) and ("B", mb, the version the storage under its backward holds by then). The test's
    record, wrapped around the engine's two calls; harness.versions_errors reads it."""
    log, forward, backward_done = [], versions.forward, versions.backward_done

    def logged_forward(mb):
        leaves = forward(mb)
        log.append(("F", mb, versions.in_flight[mb][0]))
        return leaves

    def logged_backward_done(mb):
        log.append(("B", mb, held_version(versions, versions.in_flight[mb][1])))
        backward_done(mb)

    versions.forward, versions.backward_done = logged_forward, logged_backward_done
    return log


def held_version(versions, leaves) -> int:
    """The version now in the storage under `leaves`: a frozen one's, or else the live weights'."""
    name, leaf = next(iter(leaves.items()))
    storage = leaf.untyped_storage().data_ptr()
    frozen = [v for v, tensors in versions.frozen.items() if tensors[name].untyped_storage().data_ptr() == storage]
    return frozen[0] if frozen else versions.version


def pipedream_run(train, argv, device, out_case: Path, rank: int):
    """PipeDream (step 04 on): the whole run, then this rank's per-step losses, weights, and the log of the
    weight versions its forwards and backwards read."""
    args = train.parse_args(argv)
    run = train.build(args, device)
    status(out_case.parent, rank, f"[{' '.join(argv)}]: the PipeDream run")
    versions = run.stages[0].versions  # one per rank, shared by its stages
    log = record_versions(versions)
    records = train.family(args).train_steps(run, train.flushed_steps, train.replica_microbatches, train.share_loss,
                                             train.start_recording)
    losses = [record["loss"] for record in records]
    pgm = run.pgm
    torch.save(dict(losses=losses, names=[n for n, _ in run.model.named_parameters()],
                    weights={n: p.detach().cpu().clone() for n, p in run.model.named_parameters()},
                    splits={n: getattr(p, "tp_split_dim", None) for n, p in run.model.named_parameters()},
                    place=(pgm.dp_rank, getattr(pgm, "tp_rank", 0), getattr(pgm, "tp", 1)),
                    memory=stored_microbatches(run, args, rank),
                    versions=dict(log=log, peak=versions.peak_versions, stage=pgm.stage, pp=args.pp,
                                  schedule=args.schedule, vertical_sync=args.vertical_sync, steps=args.steps,
                                  stashing=not args.no_weight_stashing)),
               out_case / f"rank{rank}.pt")
    return args


def reference(args, out_case: Path):
    """The whole model on one device: plain forward, mean cross-entropy, backward, AdamW."""
    import data
    import model

    cfg = model.ModelConfig(n_layers=args.layers, hidden=args.hidden, n_heads=args.heads, seq_len=args.seq_len)
    if getattr(args, "tie_embeddings", False):  # step 06: one matrix for the embedding and the LM head
        cfg.tie_embeddings = True
    net = model.Transformer(cfg, seed=args.seed)
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr)
    tokens = data.load_tokens(args.data)
    losses, grads = [], None
    for step in range(REFERENCE_STEPS):
        inputs, targets = data.get_batch(tokens, step, args.batch_size, args.seq_len, args.seed)
        optimizer.zero_grad()
        logits = net(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = {n: p.grad.clone() for n, p in net.named_parameters()}
        optimizer.step()
    weights = {n: p.detach().clone() for n, p in net.named_parameters()}
    torch.save(dict(losses=losses, grads=grads, weights=weights), out_case / "reference.pt")


class Scaler:
    """The loss scale as the reference sees it: x2 after `window` clean steps, x0.5 (floored) on an
    overflow once `hysteresis` overflows have happened since the last growth; 1 when not scaling."""

    def __init__(self, args):
        self.dynamic = args.precision == "fp16" and not args.loss_scale
        self.scale = args.loss_scale or (args.initial_loss_scale if self.dynamic else 1.0)
        self.window, self.hysteresis, self.floor = args.loss_scale_window, args.hysteresis, args.min_loss_scale
        self.clean = self.overflows = 0

    def update(self, overflow: bool):
        if not self.dynamic:
            return
        if overflow:
            self.clean, self.overflows = 0, self.overflows + 1
            if self.overflows >= self.hysteresis:
                self.scale = max(self.scale / 2, self.floor)
        else:
            self.clean += 1
            if self.clean == self.window:
                self.scale, self.clean, self.overflows = self.scale * 2, 0, 0


def reference_microbatched(args, out_case: Path, file="reference.pt"):
    """The whole model on one device in the run's type, computed as a pipeline computes it: microbatch
    by microbatch, each microbatch's loss scaled by S / m, its gradients added into fp32 sums in
    microbatch order, the replicas' sums added in replica order and divided by dp; unscaled, skipped on
    any inf or nan, clipped, then AdamW on fp32 master weights, cast back into the (half) weights. Tied
    embeddings: the head is a second copy of the embedding, as on a pipeline's last stage, and its fp32
    sum is added to the embedding's (one master for both)."""
    import data
    import model

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.precision]
    cfg = model.ModelConfig(n_layers=args.layers, hidden=args.hidden, n_heads=args.heads, seq_len=args.seq_len)
    net = model.Transformer(cfg, seed=args.seed).to(dtype)
    tied = getattr(args, "tie_embeddings", False)
    if tied:  # the last stage's copy of the embedding, as the head: its fp32 sum is added to the embedding's
        with torch.no_grad():
            net.head.weight.copy_(net.embed.weight)
    params = dict(net.named_parameters())
    masters = {n: p.detach().float() for n, p in params.items() if not (tied and n == "head.weight")}
    optimizer = torch.optim.AdamW(masters.values(), lr=args.lr)
    scaler = Scaler(args)
    tokens, m, rows = data.load_tokens(args.data), args.microbatches, args.batch_size // args.dp
    losses, grads, scales = [], None, []
    for step in range(REFERENCE_STEPS):
        inputs, targets = data.get_batch(tokens, step, args.batch_size, args.seq_len, args.seed)
        total, loss_sum, scales = None, 0.0, scales + [scaler.scale]
        for d in range(args.dp):
            sums = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in params.items()}
            replica_loss = None
            for x, y in zip(inputs[d * rows:(d + 1) * rows].chunk(m), targets[d * rows:(d + 1) * rows].chunk(m)):
                logits = net(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
                loss.backward(torch.full_like(loss, scaler.scale / m))
                replica_loss = loss.detach() if replica_loss is None else replica_loss + loss.detach()
                for n, p in params.items():
                    sums[n] += p.grad.float()
                    p.grad = None
            loss_sum += (replica_loss / m).item()
            if tied:
                sums["embed.weight"] = sums["embed.weight"] + sums.pop("head.weight")
            total = sums if total is None else {n: total[n] + sums[n] for n in sums}
        total = {n: g / args.dp for n, g in total.items()} if args.dp > 1 else total
        losses.append(loss_sum / args.dp)
        if step == 0:
            grads = {n: g.clone() for n, g in total.items()}
        unscaled = {n: g * (1 / scaler.scale) for n, g in total.items()}
        overflow = any(not torch.isfinite(g).all() for g in unscaled.values())
        scaler.update(overflow)
        if overflow:
            continue
        norm = torch.sqrt(sum(g.pow(2).sum() for g in unscaled.values())).item()
        coeff = args.clip_grad / (norm + 1e-6) if args.clip_grad else 1.0
        for n, master in masters.items():
            master.grad = unscaled[n] * coeff if coeff < 1 else unscaled[n]
        optimizer.step()
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(masters["embed.weight" if tied and n == "head.weight" else n])
    weights = {n: p.detach().clone() for n, p in params.items() if n in masters}
    torch.save(dict(losses=losses, grads=grads, weights=weights, masters=masters, scales=scales), out_case / file)


def reference_pipedream(args, out_case: Path):
    """The whole model on one device, updated as PipeDream updates it (step 04 on), microbatch by microbatch.

    Microbatch i runs each stage's parameters at the version that stage uses for it: PipeDream's stage s has
    made i-(p-s-1) updates by its forward of i, vertical sync uses stage 0's i-(p-1), and 2BW runs batch t on
    W(t-1). Each replica sums the gradients of its microbatches' losses at those weights (2BW: over the m of
    a batch, each loss weighted 1/m); at each update the replicas' sums are added in replica order, divided
    by dp, and stepped by AdamW from the live weights. The stages' layer split is model.py's.
    """
    import data
    import model

    cfg = model.ModelConfig(n_layers=args.layers, hidden=args.hidden, n_heads=args.heads, seq_len=args.seq_len)
    net = model.Transformer(cfg, seed=args.seed)
    params = dict(net.named_parameters())
    optimizer = torch.optim.AdamW(params.values(), lr=args.lr)
    layers = model.split_layers(args.layers, args.pp)

    def stage_of(name):
        if name.startswith("layers."):
            return next(s for s, ids in enumerate(layers) if int(name.split(".")[1]) in ids)
        return 0 if name.startswith("embed") else args.pp - 1  # the embedding, else the final norm and head

    def version(stage, i):
        if args.schedule == "pipedream-2bw":
            return max(0, i // args.microbatches - 1)
        return max(0, i - (args.pp - 1 if args.vertical_sync else args.pp - 1 - stage))

    every = args.microbatches if args.schedule == "pipedream-2bw" else 1
    tokens, m, rows = data.load_tokens(args.data), args.microbatches, args.batch_size // args.dp
    history = [{n: p.detach().clone() for n, p in params.items()}]  # the weights after each update
    losses, sums = [[] for _ in range(args.dp)], [{} for _ in range(args.dp)]
    for i in range(args.steps * m):
        inputs, targets = data.get_batch(tokens, i // m, args.batch_size, args.seq_len, args.seed)
        for d in range(args.dp):
            x, y = inputs[d * rows:(d + 1) * rows].chunk(m)[i % m], targets[d * rows:(d + 1) * rows].chunk(m)[i % m]
            weights = {n: history[version(stage_of(n), i)][n].clone().requires_grad_() for n in params}
            logits = torch.func.functional_call(net, weights, (x,))
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            loss.backward(torch.full_like(loss, 1 / every))
            losses[d].append(loss.detach())
            sums[d] = {n: w.grad if n not in sums[d] else sums[d][n].add_(w.grad) for n, w in weights.items()}
        if (i + 1) % every == 0:
            for n, p in params.items():
                total = sums[0][n]
                for d in range(1, args.dp):
                    total = total + sums[d][n]
                p.grad = total / args.dp if args.dp > 1 else total
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            history.append({n: p.detach().clone() for n, p in params.items()})
            sums = [{} for _ in range(args.dp)]
    step_losses = [sum((sum(replica[k * m:(k + 1) * m]) / m).item() for replica in losses) / args.dp
                   for k in range(args.steps)]
    weights = {n: p.detach().clone() for n, p in params.items()}
    torch.save(dict(losses=step_losses, weights=weights), out_case / "reference.pt")


def plant(argv):
    """A negative control named by a case's leading `--control NAME` (not a train.py flag): (the flags without
    it, a function that takes the planted bug out again). Step 08's experts: expert-grads-over-dp averages the
    expert gradients over the whole data-parallel group, as a dense layer's are, instead of the experts' own
    groups; expert-norm-of-one-replica sums the global gradient norm over one replica, as if it held every expert
    (pgm.ep set to 1 after the build: only the norm and the overflow check read it); expert-weights-without-decay
    puts the experts in an AdamW group of their own with weight_decay 0 (as a no-decay group for norms and biases
    would): the gradients are untouched, the weights drift by lr * 0.01 a step."""
    if argv[:1] != ["--control"]:
        return argv, lambda: None
    import finalize_grads
    import train

    original, build = finalize_grads.average_expert_gradients, train.build

    def one_replica_build(args, device):
        run = build(args, device)
        run.pgm.ep = 1
        return run

    def no_decay_build(args, device):
        run = build(args, device)
        experts = [getattr(p, "expert", False) for p in run.optimizer.masters]  # fp32: the parameters themselves
        dense, moe = ([p for p, e in zip(run.optimizer.masters, experts) if e == side] for side in (False, True))
        run.optimizer.adamw = torch.optim.AdamW([dict(params=dense), dict(params=moe, weight_decay=0.0)], lr=args.lr)
        return run

    if argv[1] == "expert-grads-over-dp":
        finalize_grads.average_expert_gradients = finalize_grads.average_gradients
    else:
        assert argv[1] in ("expert-norm-of-one-replica", "expert-weights-without-decay"), argv[1]
        train.build = one_replica_build if argv[1] == "expert-norm-of-one-replica" else no_decay_build

    def undo():
        finalize_grads.average_expert_gradients, train.build = original, build

    return argv[2:], undo


def single_device_references(args, out_case: Path, pipedream: bool):
    """The references a case is held to, written in out_case: the test's own model, never the step's pipeline."""
    half = getattr(args, "precision", "fp32") != "fp32"
    if getattr(args, "experts", 0):  # step 08's mixture of experts: the test's own MoE (moe_reference.py)
        reference_experts(args, out_case)
    else:
        (reference_pipedream if pipedream else reference_microbatched if half else reference)(args, out_case)
    # DualPipeV, dense: also bitwise against this one
    if getattr(args, "schedule", None) == "dualpipev" and not half and not getattr(args, "experts", 0):
        reference_microbatched(args, out_case, "reference_microbatched.pt")


def main(step_dir: str, out_dir: str, cases_json: str):
    sys.path.insert(0, os.path.abspath(step_dir))
    torch.set_num_threads(1)
    from support import distributed
    import torch.distributed as dist
    import train

    out, rank = Path(out_dir), int(os.environ["RANK"])
    cases = json.loads(cases_json)
    status(out, rank, "joining the process group")
    choice = cases[0][cases[0].index("--device") + 1] if "--device" in cases[0] else "cpu"  # cuda: NCCL
    if choice == "cuda":  # fp32 against the CPU reference: no TF32 (tests/test_cuda.py also sets the environment)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    device = distributed.init_distributed(choice, float(os.environ.get("PP_TEST_PG_TIMEOUT", 60)))
    finished = []
    for i, argv in enumerate(cases):
        out_case = out / f"case{i}"
        out_case.mkdir(exist_ok=True)
        pipedream = "--schedule" in argv and argv[argv.index("--schedule") + 1].startswith("pipedream")
        argv, undo = plant(argv)
        args = (pipedream_run if pipedream else pipelined)(train, argv, device, out_case, rank)
        undo()
        finished.append((argv, args, out_case, pipedream))
        dist.barrier()
    # The references, side by side: rank r makes those of cases r, r + world, ... No rank waits for another's.
    for argv, args, out_case, pipedream in finished[rank::dist.get_world_size()]:
        status(out, rank, f"[{' '.join(argv)}]: single-device reference")
        single_device_references(args, out_case, pipedream)
    status(out, rank, "done")
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])

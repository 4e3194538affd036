"""One rank of a gradient-equivalence run. Started by harness.py, never by pytest itself.

    python tests/worker.py STEP_DIR OUT_DIR CASES_JSON

Imports the step's own modules (its folder goes first on sys.path, so two steps
never meet in one process) and uses the step's public training API:

    train.parse_args(argv)        flags -> args (checks the rules)
    train.build(args, device)     -> run, with run.model and run.optimizer
    train.compute_gradients(run, step) -> loss (float, same on every rank)
    train.train_step(run, step)   -> dict with "loss", after an optimizer step
    distributed.init_distributed(device, timeout_s)

For every case it saves this rank's loss, gradients after step 0, and weights
and losses after REFERENCE_STEPS optimizer steps, with the rank's place in the
grid and, from step 06 on, the dimension each tensor-parallel shard was split on
(`tp_split_dim`), so that harness.py can put the shards back together. Rank 0 then computes the
single-device reference: the whole model on the whole global batch, written
here and not with the step's pipeline code, so it cannot share that code's bugs.
"""
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

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
    grads = {n: p.grad.detach().cpu().clone() for n, p in run.model.named_parameters() if p.grad is not None}
    names = [n for n, _ in run.model.named_parameters()]
    run.optimizer.step()
    for step in range(1, REFERENCE_STEPS):
        status(out_case.parent, rank, f"{case}: step {step}")
        losses.append(train.train_step(run, step)["loss"])
    weights = {n: p.detach().cpu().clone() for n, p in run.model.named_parameters()}
    splits = {n: getattr(p, "tp_split_dim", None) for n, p in run.model.named_parameters()}
    # (replica, TP rank, TP size): no data parallelism before step 03 (no run.pgm), no TP before step 06.
    pgm = getattr(run, "pgm", None)
    place = (getattr(pgm, "dp_rank", 0), getattr(pgm, "tp_rank", 0), getattr(pgm, "tp", 1))
    torch.save(dict(losses=losses, grads=grads, names=names, weights=weights, splits=splits, place=place),
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


def main(step_dir: str, out_dir: str, cases_json: str):
    sys.path.insert(0, os.path.abspath(step_dir))
    torch.set_num_threads(1)
    import distributed
    import torch.distributed as dist
    import train

    out, rank = Path(out_dir), int(os.environ["RANK"])
    cases = json.loads(cases_json)
    status(out, rank, "joining the process group")
    device = distributed.init_distributed("cpu", float(os.environ.get("PP_TEST_PG_TIMEOUT", 60)))
    for i, argv in enumerate(cases):
        out_case = out / f"case{i}"
        out_case.mkdir(exist_ok=True)
        args = pipelined(train, argv, device, out_case, rank)
        if rank == 0:
            status(out, rank, f"[{' '.join(argv)}]: single-device reference")
            reference(args, out_case)
        dist.barrier()
    status(out, rank, "done")
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])

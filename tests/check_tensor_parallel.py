"""Step 06's tensor-parallel pieces, one at a time, against the operations they split.

    python tests/check_tensor_parallel.py STEP_DIR layout OUT.json         # pure arithmetic, no processes
    (2 ranks)  python tests/check_tensor_parallel.py STEP_DIR blocks OUT.json
    (4 ranks)  python tests/check_tensor_parallel.py STEP_DIR scatter OUT.json

Run as ranks by test_tensor_parallel.py (through harness.launch); rank 0 writes
what it found as JSON, which the test reads. Every check also runs on a broken
variant, its negative control, which must fail: the all-reduce it depends on
skipped (by wrapping the step's own tensor_parallel.all_reduce), the wrong
rank's slice taken, a vocabulary range off by one (the cross-entropy on every
target id) or the row maxima summed (the cross-entropy on logits near 1000). A
check that cannot fail would pass both.
"""
import json
import os
import sys
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F

TOL = 1e-6  # relative: the split changes how partial sums are grouped, nothing else


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def verdict(pairs):
    """{"rel": worst relative error, "bitwise": all equal, "ok": within TOL} of (got, expected) pairs."""
    worst = max(rel_err(got, want) for got, want in pairs)
    return dict(rel=worst, bitwise=all(torch.equal(got, want) for got, want in pairs), ok=worst <= TOL)


@contextmanager
def skipping(tp_module, what):
    """The negative control: the step's all-reduce named `what` does nothing."""
    real = tp_module.all_reduce
    tp_module.all_reduce = lambda x, tp, name, *a, **k: x if name == what else real(x, tp, name, *a, **k)
    try:
        yield
    finally:
        tp_module.all_reduce = real


def inputs(*shape, requires_grad=True):
    """The same random tensor on every rank (the checks below split it themselves)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape) * 7 + shape[-1])) \
        .requires_grad_(requires_grad)


def linear_reference():
    """x [4, 6, 16], W [12, 16] and y = x W^T on one device, backpropagated from ones."""
    x, w = inputs(4, 6, 16), inputs(12, 16)
    y = F.linear(x, w)
    y.backward(torch.ones_like(y))
    return x, w, y


def split_layer_backward(layer, w_slice, x):
    """Load the layer with its slice of W, run it on x and backpropagate from ones; returns its output."""
    layer.weight.data.copy_(w_slice)
    y = layer(x)
    y.backward(torch.ones_like(y))
    return y


def column(tpm, tp):
    """f, then a column-parallel linear: output slice and input gradient against x W^T."""
    x, w, y = linear_reference()
    layer, xs = tpm.ColumnParallelLinear(16, 12, tp), x.detach().clone().requires_grad_()
    ys = split_layer_backward(layer, w.detach().chunk(tp.size, 0)[tp.rank], tpm.copy_to_tp_region(xs, tp))
    return [(ys, y.chunk(tp.size, -1)[tp.rank]), (xs.grad, x.grad),
            (layer.weight.grad, w.grad.chunk(tp.size, 0)[tp.rank])]


def row(tpm, tp):
    """A row-parallel linear, g included: the summed output and the input slice's gradient."""
    x, w, y = linear_reference()
    layer, xs = tpm.RowParallelLinear(16, 12, tp), x.detach().chunk(tp.size, -1)[tp.rank].clone().requires_grad_()
    ys = split_layer_backward(layer, w.detach().chunk(tp.size, 1)[tp.rank], xs)
    return [(ys, y), (xs.grad, x.grad.chunk(tp.size, -1)[tp.rank]),
            (layer.weight.grad, w.grad.chunk(tp.size, 1)[tp.rank])]


def embedding(tpm, tp):
    """Vocab-parallel embedding: rows and the weight gradient's slice against F.embedding."""
    tokens = torch.randint(0, 256, (4, 6), generator=torch.Generator().manual_seed(1))
    w = inputs(256, 8)
    out = F.embedding(tokens, w)
    out.backward(torch.arange(out.numel(), dtype=out.dtype).view_as(out))
    layer = tpm.VocabParallelEmbedding(256, 8, tp)
    layer.weight.data.copy_(w.detach().chunk(tp.size, 0)[tp.rank])
    outs = layer(tokens)
    outs.backward(torch.arange(outs.numel(), dtype=outs.dtype).view_as(outs))
    return [(outs, out), (layer.weight.grad, w.grad.chunk(tp.size, 0)[tp.rank])]


def cross_entropy(tpm, tp):
    """Vocab-parallel cross-entropy: loss and logits gradient against F.cross_entropy on the full logits."""
    targets = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(2))
    return cross_entropy_pairs(tpm, tp, inputs(24, 256, requires_grad=False) * 4, targets)


def cross_entropy_every_target(tpm, tp):
    """Every vocabulary id once as a target: 0, each shard's first and last id, the vocabulary's last."""
    return cross_entropy_pairs(tpm, tp, inputs(256, 256, requires_grad=False) * 4, torch.arange(256))


def cross_entropy_large_logits(tpm, tp):
    """Logits near 1000: exp() stays in range only when shifted by the true row maximum (a sum of the
    shards' maxima shifts by about 2000, and every exp() underflows to 0)."""
    targets = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(3))
    return cross_entropy_pairs(tpm, tp, inputs(24, 256, requires_grad=False) + 1000, targets)


def cross_entropy_pairs(tpm, tp, logits, targets):
    """(got, expected) for the loss and this rank's slice of the logits gradient."""
    logits = logits.requires_grad_()
    loss = F.cross_entropy(logits, targets)
    loss.backward()
    mine = logits.detach().chunk(tp.size, -1)[tp.rank].clone().requires_grad_()
    loss_tp = tpm.vocab_parallel_cross_entropy(mine, targets, tp)
    loss_tp.backward()
    return [(loss_tp, loss.detach()), (mine.grad, logits.grad.chunk(tp.size, -1)[tp.rank])]


@contextmanager
def shifted_vocab_range(tp_module):
    """The negative control of the boundary check: each rank's vocabulary range one id too high, as an
    off-by-one in the owner test would make it (a shard's first id counted outside it)."""
    real = tp_module.vocab_range
    tp_module.vocab_range = lambda vocab_size, tp: tuple(i + 1 for i in real(vocab_size, tp))
    try:
        yield
    finally:
        tp_module.vocab_range = real


@contextmanager
def summed_maxima(tp_module):
    """The negative control of the stability check: the shards' row maxima combined with SUM, not MAX."""
    real = tp_module.all_reduce
    tp_module.all_reduce = lambda x, tp, name, *a, **k: real(x, tp, name) if name == "loss max" else \
        real(x, tp, name, *a, **k)
    try:
        yield
    finally:
        tp_module.all_reduce = real


def init(model, tp, tie, wrong_rank=False):
    """Every shard of a TP-built model is the slice of the single-device parameter; replicated ones equal."""
    cfg = model.ModelConfig(n_layers=2, hidden=32, n_heads=2, seq_len=16, tie_embeddings=tie)
    whole = dict(model.Transformer(cfg).named_parameters())
    rank = (tp.rank + 1) % tp.size if wrong_rank else tp.rank
    pairs = []
    for first, last in ((True, True), (True, False), (False, True)):
        for name, p in model.Transformer(cfg, first=first, last=last, tp=tp).named_parameters():
            dim = getattr(p, "tp_split_dim", None)
            full = whole[name].detach()
            pairs.append((p.detach(), full if dim is None else full.chunk(tp.size, dim)[rank]))
    return pairs


BLOCKS = {"column": (column, partial(skipping, what="f backward")), "row": (row, partial(skipping, what="g forward")),
          "embedding": (embedding, partial(skipping, what="g forward")),
          "cross_entropy": (cross_entropy, partial(skipping, what="loss max")),
          "cross_entropy every target": (cross_entropy_every_target, shifted_vocab_range),
          "cross_entropy large logits": (cross_entropy_large_logits, summed_maxima)}


def blocks():
    import model
    import tensor_parallel as tpm
    import torch.distributed as dist

    tp = tpm.TPGroup(dist.group.WORLD, dist.get_rank(), dist.get_world_size())
    found = {}
    for name, (check, control) in BLOCKS.items():
        found[name] = verdict(check(tpm, tp))
        with control(tpm):
            found[name]["control"] = verdict(check(tpm, tp))
    for tie in (False, True):
        found[f"init tie={tie}"] = dict(verdict(init(model, tp, tie)), control=verdict(init(model, tp, tie, True)))
    return found


def scatter():
    """tp 2 x pp 2: what a stage receives with --scatter-gather, against a full send."""
    import p2p
    import process_groups
    from support import timeline
    import torch.distributed as dist

    pgm = process_groups.ProcessGroupManager(2, 1, 30, tp=2)
    found = {}
    for shape in ((2, 6, 8), (3, 5, 7)):  # 96 values split in two; 105 do not (sent whole)
        sent = {kind: inputs(*shape, requires_grad=False) * (1 + i) for i, kind in enumerate(("act", "grad"))}
        got, wire = {}, {}
        for sg in (False, True, "wrong slice"):
            trace = timeline.Timeline(dist.get_rank())
            timeline.install(trace)  # this rank's own recorder: the bytes each send put on the wire
            comm = p2p.PipelineComm(pgm, shape, torch.float32, "cpu", scatter_gather=bool(sg))
            if sg == "wrong slice":
                comm.tp_rank = 0  # control: both TP ranks send the first slice
            if pgm.stage == 0:
                comm.send_forward(sent["act"])
                got[sg] = comm.recv_backward()
            else:
                got[sg] = comm.recv_forward()
                comm.send_backward(sent["grad"])
            comm.finish_sends()
            wire[sg] = sum(e["bytes"] for e in trace.events if e["kind"] == "send")
        expected = sent["grad" if pgm.stage == 0 else "act"]
        found[str(shape)] = dict(full=torch.equal(got[False], expected), sg=torch.equal(got[True], expected),
                                 control=torch.equal(got["wrong slice"], expected),
                                 bytes_full=wire[False], bytes_sg=wire[True], split=comm.split)
    return found


def layout():
    """grid_groups and grid_coordinates for every (tp, pp, dp) with tp * pp * dp <= 64."""
    import process_groups as pg

    shapes = [(tp, pp, dp) for tp in range(1, 65) for pp in range(1, 65) for dp in range(1, 65) if tp * pp * dp <= 64]
    return {f"{tp} {pp} {dp}": dict(groups=pg.grid_groups(tp, pp, dp),
                                    coords=[pg.grid_coordinates(r, dp, tp) for r in range(tp * pp * dp)])
            for tp, pp, dp in shapes}


def main(step_dir, mode, out):
    sys.path.insert(0, os.path.abspath(step_dir))
    torch.set_num_threads(1)
    if mode == "layout":
        found = layout()
    else:
        from support import distributed
        import torch.distributed as dist

        distributed.init_distributed("cpu", 60)
        found = [None] * dist.get_world_size()  # each rank's findings, in rank order
        dist.all_gather_object(found, {"blocks": blocks, "scatter": scatter}[mode]())
    if int(os.environ.get("RANK", 0)) == 0:
        with open(out, "w") as f:
            json.dump(found, f)
    if mode != "layout":
        distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])

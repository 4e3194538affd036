"""Step 08's experts (experts.py) one piece at a time, on 2 ranks (one expert group, ep 2, 4 experts).
Started by test_experts.py through harness.launch, never by pytest itself.

    python tests/check_experts.py STEP_DIR OUT_DIR

Each check returns ok (and its numbers); each has a control, a planted bug, that must fail it:
- round trip: collect(dispatch(rows)) is rows, bitwise, with uneven splits;
- adjoint: <dispatch(x), y> = <x, collect(y)> summed over the group, and dispatch's backward is collect;
  control: the backward's splits not swapped;
- a layer (router, dispatch, experts, combine) against moe_reference.dense_moe on both ranks' tokens in one
  process: outputs, input and parameter gradients; with a random router at top-k 2, and with a router of
  zeros at top-k 1, which ties every expert: every token goes to expert 0 and experts 2 and 3 get none;
- tie-break: ties go to the lower index; control: torch.topk's order;
- aux loss: its injected gradient equals (loss + coef * aux).backward(); control: no injection;
- volume: with balanced routing, each all-to-all sends (ep-1)/ep x tokens x k x hidden x bytes to the other rank.
"""
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

HIDDEN, TOKENS, N_EXPERTS = 8, 12, 4


def close(a, b, rtol=1e-6) -> bool:
    return bool(torch.allclose(a, b, rtol=rtol, atol=rtol * b.abs().max().item()))


def layer(experts_mod, model, ep, k, seed=0):
    """(this rank's MoE, the whole MoE of 4 experts) with the same weights: drawn by model.init_weights."""
    cfg = model.ModelConfig(n_layers=1, hidden=HIDDEN, n_heads=2, seq_len=4, experts=N_EXPERTS, top_k=k)
    whole = model.Transformer(cfg, first=False, last=False, seed=seed).layers["0"].mlp
    mine = model.Transformer(cfg, first=False, last=False, seed=seed, ep=ep).layers["0"].mlp
    return mine, whole


def plan_of(moe, chosen):
    """moe's rows and plan for a given routing [T, k] (the router bypassed)."""
    k = chosen.size(1)
    moe.route = lambda x2: (torch.full((len(x2), N_EXPERTS), 1 / N_EXPERTS), chosen, torch.full((len(x2), k), 1 / k))
    return moe.route_and_permute(torch.randn(TOKENS, HIDDEN))


def check_dispatch(experts_mod, model, ep, rank):
    """Round trip and adjoint with uneven splits (each rank routes differently); the control's backward
    does not swap the splits."""
    moe, _ = layer(experts_mod, model, ep, 2)
    gen = torch.Generator().manual_seed(rank)
    t = torch.arange(TOKENS)  # rank 0 keeps every row (it sends none to rank 1); rank 1 sends to both
    chosen = torch.stack([t * 0, t * 0 + 1] if rank == 0 else [t % 4, (t + 2) % 4], 1)
    rows, plan = plan_of(moe, chosen)
    arrived = moe.dispatch(rows, plan)
    round_trip = torch.equal(moe.collect(arrived, plan), rows)
    x = torch.randn(rows.shape, generator=gen).requires_grad_()
    y = torch.randn(arrived.shape, generator=gen)
    out = moe.dispatch(x, plan)
    (out * y).sum().backward()
    sides = torch.stack([(out * y).sum(), (x * moe.collect(y, plan)).sum()]).detach()
    dist.all_reduce(sides)
    adjoint = close(sides[0], sides[1]) and torch.equal(x.grad, moe.collect(y, plan))

    class Unswapped(experts_mod.AllToAll):
        @staticmethod
        def backward(ctx, grad):  # the planted bug: the same splits as the forward
            fits = torch.tensor([float(sum(ctx.send) == len(grad))])
            dist.all_reduce(fits, op=dist.ReduceOp.MIN)  # both ranks give up together, rather than one hanging
            if not fits.item():
                raise RuntimeError("the forward's splits do not fit the gradient's rows")
            return experts_mod.exchange(grad, ctx.send, ctx.recv, ctx.ep, "backward"), None, None, None

    x.grad, original = None, experts_mod.AllToAll
    experts_mod.AllToAll = Unswapped
    try:
        (moe.dispatch(x, plan) * y).sum().backward()
        control = torch.equal(x.grad, moe.collect(y, plan))
    except RuntimeError:
        control = False
    finally:
        experts_mod.AllToAll = original
    return dict(ok=round_trip and adjoint, round_trip=round_trip, adjoint=adjoint,
                send=plan.send, recv=plan.recv, control=dict(ok=control))


def check_layer(experts_mod, model, ep, rank, k, zero_router):
    """This rank's MoE on its tokens against the whole MoE on both ranks' tokens; parameter gradients: an
    expert's against the whole's, the router's summed over the two ranks first."""
    from moe_reference import dense_moe

    moe, whole = layer(experts_mod, model, ep, k)
    if zero_router:
        for m in (moe, whole):
            torch.nn.init.zeros_(m.router.weight)
    gen = torch.Generator().manual_seed(10 + rank)
    x, g = torch.randn(2, 3, HIDDEN, generator=gen).requires_grad_(), torch.randn(2, 3, HIDDEN, generator=gen)
    y = moe(x)
    (y * g).sum().backward()
    xs, gs = [torch.empty_like(x) for _ in range(2)], [torch.empty_like(g) for _ in range(2)]
    dist.all_gather(xs, x.detach())
    dist.all_gather(gs, g)
    x_all = torch.cat(xs).requires_grad_()
    y_all = dense_moe(whole, x_all, k, [])
    (y_all * torch.cat(gs)).sum().backward()
    ok = close(y, y_all[2 * rank:2 * rank + 2].detach()) and close(x.grad, x_all.grad[2 * rank:2 * rank + 2])
    router = moe.router.weight.grad.clone()
    dist.all_reduce(router)
    ok = ok and close(router, whole.router.weight.grad)
    whole_params = dict(whole.experts.named_parameters())
    missing = [n for n, p in moe.experts.named_parameters() if p.grad is None]
    ok = ok and not missing and all(close(p.grad, whole_params[n].grad) for n, p in moe.experts.named_parameters())
    norms = {n: p.grad.norm().item() for n, p in moe.experts.named_parameters() if p.grad is not None}
    return dict(ok=ok, missing=missing, grad_norms=norms)


def check_tie_break(experts_mod, model):
    """A router of zeros ties all 4 experts: top-k 2 must choose 0 and 1, as moe_reference.choose does.
    Control: torch.topk's order of ties."""
    moe, _ = layer(experts_mod, model, experts_mod.EPGroup(), 2)
    torch.nn.init.zeros_(moe.router.weight)
    probs, chosen, _ = moe.route(torch.randn(TOKENS, HIDDEN))
    from moe_reference import choose

    expected = choose(probs, 2)
    ok = torch.equal(torch.zeros_like(probs).scatter_(1, chosen, 1.0), expected)
    control = torch.equal(torch.zeros_like(probs).scatter_(1, torch.topk(probs, 2).indices, 1.0), expected)
    return dict(ok=ok, chosen=chosen[0].tolist(), control=dict(ok=control))


def check_aux(experts_mod, model, coef=0.5):
    """One device: the aux loss injected by AuxLossScaler gives the gradients of (loss + coef * aux)."""
    from moe_reference import dense_moe

    moe, whole = layer(experts_mod, model, experts_mod.EPGroup(), 2)
    gen = torch.Generator().manual_seed(3)
    x, g = torch.randn(2, 6, HIDDEN, generator=gen), torch.randn(2, 6, HIDDEN, generator=gen)
    aux = []
    (dense_moe(whole, x, 2, aux) * g).sum().add(coef * aux[0]).backward()
    found = {}
    for name, scale in (("ok", coef), ("control", 0.0)):  # the control: the injection dropped
        moe.zero_grad()
        experts_mod.AuxLossScaler.scale = scale
        (moe(x) * g).sum().backward()
        found[name] = close(moe.router.weight.grad, whole.router.weight.grad, 1e-5)
    experts_mod.AuxLossScaler.scale = 0.0
    return dict(ok=found["ok"], control=dict(ok=found["control"]))


def check_volume(experts_mod, model, ep):
    """Balanced routing (token t to experts t % 2 and 2 + t % 2, one on each rank): each all-to-all of
    dispatch and combine sends exactly (ep-1)/ep x tokens x k x hidden x 4 bytes, forward and backward."""
    moe, _ = layer(experts_mod, model, ep, 2)
    chosen = torch.stack([torch.arange(TOKENS) % 2, 2 + torch.arange(TOKENS) % 2], 1)
    experts_mod.Stats.reset()
    rows, plan = plan_of(moe, chosen)
    rows.requires_grad_()
    moe.collect(moe.dispatch(rows, plan), plan).sum().backward()
    formula = 2 * (ep.size - 1) / ep.size * TOKENS * 2 * HIDDEN * 4
    sent = dict(experts_mod.Stats.sent)
    return dict(ok=sent["forward"] == formula and sent["backward"] == formula, formula=formula, sent=sent)


def main(step_dir: str, out_dir: str):
    sys.path.insert(0, os.path.abspath(step_dir))
    torch.set_num_threads(1)
    from support import distributed
    import experts as experts_mod
    import model

    distributed.init_distributed("cpu", 60)
    rank = dist.get_rank()
    ep = experts_mod.EPGroup(dist.new_group([0, 1]), rank, 2)
    torch.manual_seed(0)
    found = dict(dispatch=check_dispatch(experts_mod, model, ep, rank),
                 layer_top2=check_layer(experts_mod, model, ep, rank, 2, False),
                 layer_skewed=check_layer(experts_mod, model, ep, rank, 1, True),
                 tie_break=check_tie_break(experts_mod, model),
                 aux=check_aux(experts_mod, model),
                 volume=check_volume(experts_mod, model, ep))
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(found))
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])

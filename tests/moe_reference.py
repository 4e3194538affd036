"""The single-device reference of a mixture-of-experts model (step 08's experts.py), written here, not
with the step's MoE code: every expert in one process, run on every token, weighted by a gate that is zero
for the experts a token did not choose. No permutation, no all-to-all, no split sizes.

    dense_moe(moe, x, k, aux_terms)   one layer's MoE, from the step's parameters (its names and init)
    reference_experts(args, out_case) 3 AdamW steps of the whole model, saved as check_equivalence saves, with
                                      each step's global gradient norm (under ep the norm sums every expert)

The routing rule written independently: softmax in fp32, then k times the argmax (torch.argmax returns the
first of equal maxima, so the lower expert index wins a tie), the k probabilities renormalised. The aux
loss is Switch Transformer's E * sum_i f_i * P_i per layer and microbatch, added to the microbatch's loss:
(loss + coef * sum of aux) / m is what each microbatch backpropagates, so the gradients are those of
the mean over microbatches and replicas of (loss + coef * aux), and the printed loss is the loss alone.

The equality is not bitwise: a pipeline's expert multiplies only its routed rows, here every row, so the
matrix products have other shapes and sum in other orders; and a token's k outputs are added in another
order. Each difference is a rounding, so fp32 agrees to 1e-5.
"""
from pathlib import Path

import torch
import torch.nn.functional as F


def choose(probs, k: int):
    """[T, E] -> a 0/1 mask [T, E] of each token's k largest probabilities, ties to the lower index."""
    mask, left = torch.zeros_like(probs), probs.detach().clone()
    for _ in range(k):
        best = left.argmax(-1, keepdim=True)
        mask.scatter_(1, best, 1.0)
        left.scatter_(1, best, -1.0)
    return mask


def dense_moe(moe, x, k: int, aux_terms: list):
    """The MoE of one layer on x [b, t, h], every expert on every token. Appends the layer's aux loss."""
    x2 = x.reshape(-1, x.size(-1))
    probs = torch.softmax(F.linear(x2, moe.router.weight).float(), dim=-1)  # [T, E]
    mask = choose(probs, k)
    gates = probs * mask
    gates = gates / gates.sum(-1, keepdim=True)
    n_experts = probs.size(1)
    aux_terms.append(n_experts * ((mask.sum(0) / mask.sum()) * probs.mean(0)).sum())
    y = torch.zeros_like(x2)
    for e, expert in moe.experts.items():
        hidden = F.silu(F.linear(x2, expert.gate.weight)) * F.linear(x2, expert.up.weight)
        y = y + gates[:, int(e)].unsqueeze(-1).to(x2.dtype) * F.linear(hidden, expert.down.weight)
    return y.view_as(x)


def reference_experts(args, out_case: Path):
    """The whole model with all its experts on one device, microbatch by microbatch as each replica cuts its
    rows, each microbatch's (loss + coef * aux) / m backpropagated, the replicas' sums averaged, AdamW."""
    import data
    import model

    cfg = model.ModelConfig(n_layers=args.layers, hidden=args.hidden, n_heads=args.heads, seq_len=args.seq_len,
                            experts=args.experts, top_k=args.top_k)
    net = model.Transformer(cfg, seed=args.seed)  # for the parameters, their names and their initial values
    aux_terms = []
    for layer in net.layers.values():
        layer.mlp.forward = lambda x, moe=layer.mlp: dense_moe(moe, x, args.top_k, aux_terms)
    params = dict(net.named_parameters())
    optimizer = torch.optim.AdamW(params.values(), lr=args.lr)
    tokens, m, rows = data.load_tokens(args.data), args.microbatches, args.batch_size // args.dp
    losses, grads, norms = [], None, []
    for step in range(3):
        inputs, targets = data.get_batch(tokens, step, args.batch_size, args.seq_len, args.seed)
        total, loss_sum = {n: torch.zeros_like(p) for n, p in params.items()}, 0.0
        for d in range(args.dp):
            for x, y in zip(inputs[d * rows:(d + 1) * rows].chunk(m), targets[d * rows:(d + 1) * rows].chunk(m)):
                aux_terms.clear()
                logits = net(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
                ((loss + args.aux_loss_coef * sum(aux_terms)) / m).backward()
                loss_sum += loss.item() / m
                for n, p in params.items():
                    total[n] += p.grad
                    p.grad = None
        losses.append(loss_sum / args.dp)
        for n, p in params.items():
            p.grad = total[n] / args.dp
        norms.append(torch.sqrt(sum(p.grad.pow(2).sum() for p in params.values())).item())
        if step == 0:
            grads = {n: p.grad.clone() for n, p in params.items()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    weights = {n: p.detach().clone() for n, p in params.items()}
    torch.save(dict(losses=losses, grads=grads, weights=weights, norms=norms), out_case / "reference.pt")

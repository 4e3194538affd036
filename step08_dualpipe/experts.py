"""Mixture of experts (MoE) with expert parallelism: a side road of step 08, read after dualpipe.py.

    torchrun --nproc_per_node 4 step08_dualpipe/train.py --pp 2 --dp 2 --experts 4 --top-k 2 --ep 2

DualPipe was made for DeepSeek-V3, a mixture of experts. --experts E replaces each layer's SwiGLU with E
SwiGLU experts and a router that sends every token to k of them (--top-k); the layer's output is the
k experts' outputs, weighted by the router. Each token pays for k experts, the model holds E.

Expert parallelism (--ep N): the N ranks of an expert group hold the same stage in N different data-parallel
replicas, and each holds E/N of the experts (--ep divides --dp; attention and the router stay replicated).
A token whose expert lives on another rank travels there and back. One layer's MoE, in four pieces (the
nodes that DualPipe's overlap cuts a layer into):

    1. route_and_permute  router -> top-k -> the token rows sorted by expert, hence by destination rank;
                          the counts exchanged (an all-to-all of E numbers), so each rank knows what arrives
    2. dispatch           all_to_all_single with uneven splits: each rank's rows to their experts' ranks
    3. run_experts        the local experts, each on the rows that arrived for it
    4. combine            the inverse all-to-all (the splits swapped), then the rows back into token order,
                          each weighted by its router weight and summed over the token's k experts

Dispatch and combine are linear maps, and each is the other's adjoint: the backward of an all-to-all is
the all-to-all with its splits swapped (AllToAll). Routing is dropless: every token reaches its k experts,
however many choose the same one (no capacity factor, so no token is dropped).

Ordering. gloo and NCCL match collectives by the order in which each rank posts them. Every rank of an
expert group holds the same stage and runs the same schedule, so it runs the same layers' forwards and
backwards in the same order and posts the same all-to-alls in the same order. The code relies on this:
a rank that skipped a layer's dispatch would pair its next all-to-all with a peer's other one.

The load-balancing loss of the Switch Transformer (Fedus et al. 2021), per layer and microbatch:
aux = E * sum_i f_i * P_i, f_i the fraction of the microbatch's token-expert assignments that go to
expert i and P_i the mean router probability of expert i. It is added to the gradient, not to the printed
loss: AuxLossScaler, as Megatron-LM's MoEAuxLossAutoScaler, passes the activation through and gives the
aux loss the gradient --aux-loss-coef x (the seed of the microbatch's language-model loss).
"""
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from support import timeline
from support.timeline import ALL_TO_ALL  # the span kind of dispatch, combine and the count exchange
from weight_grad_store import linear


@dataclass(frozen=True)
class EPGroup:
    """The ranks that share one layer's experts: their process group, this rank's index, their number.
    EPGroup() is one device, holding every expert."""
    group: object = None
    rank: int = 0
    size: int = 1


class Stats:
    """This process's measurements of the step now running: tokens per (layer, expert), the aux losses, the
    bytes each all-to-all sent to other ranks and how many all-to-alls ran (train.py reads and resets them)."""
    counts = {}  # layer -> tokens routed to each expert [E], summed over the step's microbatches
    aux_sum = 0.0  # the aux losses of the step's (layer, microbatch) pairs, summed
    sent = {"forward": 0, "backward": 0}  # bytes sent to other ranks by dispatch and combine
    calls = {"forward": 0, "backward": 0}

    @classmethod
    def reset(cls):
        cls.counts, cls.aux_sum = {}, 0.0
        cls.sent, cls.calls = {"forward": 0, "backward": 0}, {"forward": 0, "backward": 0}


def account(x, send: list, ep: EPGroup, direction: str) -> int:
    """Count an all-to-all of send[r] rows of x to each rank r in Stats; the bytes it sends to other ranks."""
    sent = (sum(send) - send[ep.rank]) * math.prod(x.shape[1:]) * x.element_size()
    Stats.sent[direction] += sent
    Stats.calls[direction] += 1
    return sent


def exchange(x, send: list, recv: list, ep: EPGroup, direction: str):
    """all_to_all_single: send[r] rows of x (in rank order) to rank r, recv[r] rows from rank r, in rank order."""
    if ep.size == 1:
        return x
    sent = account(x, send, ep, direction)
    with timeline.span(ALL_TO_ALL, what=f"{direction} rows", bytes=sent):
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=ep.group)
    return out


class AllToAll(torch.autograd.Function):
    """Rows to other ranks (dispatch, or combine with the splits swapped). Its backward is the same exchange
    with send and recv swapped: the gradient of a row goes back to the rank the row came from."""

    @staticmethod
    def forward(ctx, x, send, recv, ep):  # [sum(send), h] -> [sum(recv), h]
        ctx.send, ctx.recv, ctx.ep = send, recv, ep
        return exchange(x, send, recv, ep, "forward")

    @staticmethod
    def backward(ctx, grad):  # [sum(recv), h] -> [sum(send), h]
        return exchange(grad, ctx.recv, ctx.send, ctx.ep, "backward"), None, None, None


class AuxLossScaler(torch.autograd.Function):
    """Megatron-LM's MoEAuxLossAutoScaler: the forward returns the activation unchanged; the backward also
    gives the aux loss the gradient `scale`, so autograd adds d(scale x aux) to every parameter behind it.
    The printed loss stays the language model's, and the aux loss never travels between stages."""
    scale = 0.0  # coef x loss scale / m: set before each step (start_step)

    @staticmethod
    def forward(ctx, activation, aux):
        ctx.save_for_backward(aux)
        return activation

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, AuxLossScaler.scale)


def top_k(probs, k: int):
    """The k largest probabilities of each token, ties broken towards the lower expert index (a stable
    sort), so that every rank and the one-device reference pick the same experts. torch.topk leaves the
    order of ties unspecified (here, on CPU, it returned the higher index first). [T, E] -> indices, values [T, k]."""
    chosen = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]
    return chosen, probs.gather(1, chosen)


def load_balancing_loss(probs, chosen, n_experts: int):
    """Switch Transformer's E * sum_i f_i * P_i: 1 when the router is uniform and balanced, up to E when it
    sends everything to one expert. f_i counts assignments (it has no gradient), P_i carries the gradient."""
    f = torch.bincount(chosen.flatten(), minlength=n_experts).float() / chosen.numel()  # [E]
    return n_experts * (f * probs.mean(0)).sum()


@dataclass
class Plan:
    """Who sends how many rows to whom in one layer's dispatch (combine reverses it).

    order: the token-expert assignments sorted by expert; send[r], recv[r]: rows to and from rank r;
    regroup: the received rows (by source rank, then expert) sorted by local expert; per_expert: rows per local
    expert; token: the token of each sorted assignment; weights [T, k]; shape of the MoE's input."""
    order: torch.Tensor
    token: torch.Tensor
    send: list
    recv: list
    regroup: torch.Tensor
    per_expert: list
    weights: torch.Tensor
    shape: torch.Size


def split_counts(chosen, n_experts: int, ep: EPGroup):
    """The count exchange. chosen [T, k] -> (send[r], recv[r]: rows to and from rank r; received [ep, E/ep]:
    the rows rank src sends to this rank's expert j; counts [E]: this rank's rows for each expert). A collective,
    before dispatch: both sides of the all-to-all must know its sizes, and .tolist() waits for them on the host.
    Rank r holds experts r*E/ep .. (r+1)*E/ep - 1, so a rank's rows are its experts' counts summed."""
    counts = torch.bincount(chosen.flatten(), minlength=n_experts)  # [E], experts of rank r contiguous
    local = n_experts // ep.size
    received = counts
    if ep.size > 1:
        with timeline.span(ALL_TO_ALL, what="counts", bytes=(n_experts - local) * counts.element_size()):
            received = torch.empty_like(counts)
            dist.all_to_all_single(received, counts, group=ep.group)  # equal splits: E/ep counts per rank
    received = received.view(ep.size, local)
    return counts.view(ep.size, local).sum(1).tolist(), received.sum(1).tolist(), received, counts


def permutation(chosen, received):
    """Dispatch's two reorderings. chosen [T, k]: each token's experts (assignment t*k+j is token t's j-th);
    received [ep, E/ep]: the rows each rank sends to each of this rank's experts (split_counts).
    -> order [T*k]: the assignments sorted by expert, so by destination rank (stable: by token within an expert);
       regroup [R]: the arrived rows, which come by source rank and then by expert, sorted by local expert."""
    order = torch.sort(chosen.flatten(), stable=True).indices
    local_expert = torch.arange(received.size(1), device=chosen.device).repeat(received.size(0))  # [ep * E/ep]
    regroup = torch.sort(local_expert.repeat_interleave(received.flatten()), stable=True).indices
    return order, regroup


class MoE(nn.Module):
    """A mixture-of-experts MLP: a router and this rank's experts (named by their global index, so that a
    parameter has the same name on every layout). expert: builds one expert (model.py: a SwiGLU)."""

    def __init__(self, hidden: int, n_experts: int, k: int, ep: EPGroup, expert, layer: int = 0):
        super().__init__()
        self.n_experts, self.k, self.ep, self.layer = n_experts, k, ep, layer
        self.router = nn.Module()
        self.router.weight = nn.Parameter(torch.empty(n_experts, hidden))  # model.init_weights fills it
        local = n_experts // ep.size
        self.experts = nn.ModuleDict({str(j): expert() for j in range(ep.rank * local, (ep.rank + 1) * local)})
        for p in self.experts.parameters():
            p.expert = True  # reduced over the ranks that hold this expert only (finalize_grads.py)

    def route(self, x):
        """[T, h] -> probabilities [T, E] (softmax in fp32), chosen experts [T, k], their weights [T, k].

        Softmax over all E, keep the top k, renormalise them to sum to 1: Mixtral's convention (its top-k of
        the logits, then a softmax over the k, gives the same weights). DeepSeek-V3 instead scores each
        expert with a sigmoid and normalises the k chosen scores; DeepSeek-V2 keeps softmax weights
        unnormalised. Renormalised, a token's output has the scale of one expert's, whatever k."""
        probs = torch.softmax(linear(x, self.router.weight).float(), dim=-1)
        chosen, weights = top_k(probs, self.k)
        return probs, chosen, weights / weights.sum(-1, keepdim=True)

    def record(self, probs, chosen, weights):
        """The aux loss attached to the router's weights (when it has a coefficient), and the step's stats.
        Only forwards that build a graph count: with --recompute the first forward runs without one."""
        aux = load_balancing_loss(probs, chosen, self.n_experts)
        if torch.is_grad_enabled():  # kept on the device: no synchronisation until the step's end
            Stats.aux_sum = Stats.aux_sum + aux.detach()
            counts = torch.bincount(chosen.flatten(), minlength=self.n_experts)
            Stats.counts[self.layer] = Stats.counts.get(self.layer, 0) + counts
            if AuxLossScaler.scale:
                weights = AuxLossScaler.apply(weights, aux)
        return weights

    def route_and_permute(self, x):
        """Node 1 (after attention and the norm): route x [b, t, h], sort its token-expert rows by expert
        (so by destination rank), exchange the counts. -> (rows [T*k, h], plan)."""
        x2 = x.reshape(-1, x.size(-1))  # [T, h]
        probs, chosen, weights = self.route(x2)
        weights = self.record(probs, chosen, weights)
        send, recv, received, _ = split_counts(chosen, self.n_experts, self.ep)
        order, regroup = permutation(chosen, received)
        token = order // self.k  # the token of each sorted assignment
        plan = Plan(order, token, send, recv, regroup, received.sum(0).tolist(), weights, x.shape)
        return x2[token], plan  # [T*k, h]

    def dispatch(self, rows, plan):
        """Node 2: each row to its expert's rank; arrivals grouped by local expert. [T*k, h] -> [R, h]."""
        return AllToAll.apply(rows, plan.send, plan.recv, self.ep)[plan.regroup]

    def run_experts(self, rows, plan):
        """Node 3: each local expert on its contiguous rows. [R, h] -> [R, h]."""
        parts = rows.split(plan.per_expert)
        return torch.cat([expert(part) for expert, part in zip(self.experts.values(), parts)])

    def collect(self, out, plan):
        """Dispatch's inverse: the rows back to the ranks they came from, in the order they left. [R, h] -> [T*k, h]"""
        return AllToAll.apply(ungroup(out, plan), plan.recv, plan.send, self.ep)  # the splits swapped

    def combine(self, out, plan):
        """Node 4: the rows back to their tokens' ranks (collect), each times its router weight, summed over
        the token's k experts. [R, h] -> [b, t, h]."""
        return unpermute(self.collect(out, plan), plan.weights, plan)

    def forward(self, x):  # [b, t, h] -> [b, t, h]
        rows, plan = self.route_and_permute(x)
        return self.combine(self.run_experts(self.dispatch(rows, plan), plan), plan)


def ungroup(out, plan):
    """Undo the grouping by local expert: the rows in the order they arrived. [R, h] -> [R, h]"""
    back = torch.empty_like(out)
    back[plan.regroup] = out
    return back


def unpermute(rows, weights, plan):
    """The returned rows [T*k, h] (sorted by expert) back to their tokens, each times its router weight
    (weights [T, k]), summed over the token's k experts. -> [b, t, h]"""
    weighted = rows * weights.flatten()[plan.order].unsqueeze(-1).to(rows.dtype)
    y = torch.zeros(plan.shape, dtype=rows.dtype, device=rows.device).view(-1, rows.size(-1))
    return y.index_add(0, plan.token, weighted).view(plan.shape)


def add_flags(parser):
    """The experts' flags, a group of their own in train.py's --help (config.py)."""
    group = parser.add_argument_group("experts", "a mixture of experts in every layer (experts.py)")
    group.add_argument("--experts", type=int, default=0, help="experts per layer (0: the dense SwiGLU)")
    group.add_argument("--top-k", type=int, default=1, help="experts each token is sent to")
    group.add_argument("--ep", type=int, default=1,
                       help="expert-parallel ranks: replicas of a stage that split its experts (divides --dp)")
    group.add_argument("--aux-loss-coef", type=float, default=1e-2,
                       help="weight of the load-balancing loss in the gradient (Switch Transformer's 1e-2)")
    group.add_argument("--capacity-factor", type=float, default=None,
                       help="not supported: routing is dropless (refused)")
    group.add_argument("--link-latency-ms", type=float, default=0.0,
                       help="simulate a slow network: each dispatch and combine completes this long after it is "
                       "posted (overlap.py; dualpipe and dualpipev on a CPU, --ep 2 or more)")


def check_flags(args):
    """The experts' rules, refused before any work with a ValueError of one line (config.py)."""
    if args.experts < 0:
        raise ValueError(f"--experts {args.experts} must be 0 (dense) or a positive number of experts")
    if args.capacity_factor is not None:
        raise ValueError(f"--capacity-factor {args.capacity_factor}: token dropping is not supported, routing "
                         "is dropless (every token reaches its --top-k experts)")
    check_link(args)
    if not args.experts:
        if args.ep != 1 or args.top_k != 1:
            raise ValueError(f"--ep {args.ep} and --top-k {args.top_k} need --experts (the model is dense)")
        return
    if not 1 <= args.top_k <= args.experts:
        raise ValueError(f"--top-k {args.top_k} must be between 1 and --experts {args.experts}")
    if args.ep < 1 or args.experts % args.ep:
        raise ValueError(f"--ep {args.ep} must divide --experts {args.experts}: each rank holds as many experts")
    if args.dp % args.ep:
        raise ValueError(f"--ep {args.ep} must divide --dp {args.dp}: an expert group is --ep replicas of a stage")
    if not 0 <= args.aux_loss_coef < math.inf:
        raise ValueError(f"--aux-loss-coef {args.aux_loss_coef} must be 0 or positive, and finite")
    if args.tp > 1:
        raise ValueError(f"--tp {args.tp} with --experts is not supported: the experts and the router would need "
                         "splitting over TP, and the dispatch its TP-sharded rows")
    if args.schedule.startswith("pipedream"):
        raise ValueError(f"--schedule {args.schedule} with --experts is not supported: its stages update alone, "
                         "each averaging every gradient over the whole --dp group, not the experts' own groups")
    if args.save or args.resume:
        raise ValueError("--save and --resume with --experts are not supported: a checkpoint does not record "
                         "--experts, so a resumed run could not tell a dense model from a mixture")


def check_link(args):
    """The overlapped pair's rules (overlap.py): a simulated link where its all-to-alls are posted, and no
    recompute inside a pair of nodes (torchtitan refused the same)."""
    latency = args.link_latency_ms
    if not 0 <= latency <= 1000:
        raise ValueError(f"--link-latency-ms {latency} must be between 0 and 1000 (a simulated network's delay)")
    if latency and not (args.experts and args.ep > 1 and args.schedule in ("dualpipe", "dualpipev")
                        and args.device == "cpu"):
        raise ValueError(f"--link-latency-ms {latency} needs --experts with --ep 2 or more, --schedule dualpipe or "
                         "dualpipev and --device cpu: it delays the overlapped pair's all-to-alls on the host")
    if args.experts and args.recompute and args.pairs == "overlapped" and args.schedule in ("dualpipe", "dualpipev"):
        raise ValueError("--pairs overlapped with --recompute and --experts is not supported: a pair interleaves "
                         "nodes whose graphs the recompute would rebuild; use --pairs sequential")


def ep_group(args, pgm) -> EPGroup:
    """This rank's expert group (EPGroup() without experts)."""
    return EPGroup(pgm.ep_group, pgm.ep_rank, args.ep) if args.experts else EPGroup()


def start_step(args, loss_scale: float):
    """Before a step: forget the last one's stats, and seed the aux losses as the schedule seeds each
    microbatch's loss, loss scale / m (stage.py), times the coefficient."""
    Stats.reset()
    AuxLossScaler.scale = args.aux_loss_coef * loss_scale / args.microbatches if args.experts else 0.0


def step_record(args, device) -> dict:
    """What the step's line shows (all ranks call it; {} without experts): the aux loss, a mean over the
    replicas and microbatches of its sum over the layers, and the most and least loaded expert's tokens
    (over every layer, every replica). Each layer's tokens are counted where they were routed, once."""
    if not args.experts:
        return {}
    counts = torch.zeros(args.layers, args.experts, dtype=torch.float64)
    for layer, c in Stats.counts.items():
        counts[layer] += c.cpu()
    summed = torch.cat([counts.flatten(), torch.tensor([float(Stats.aux_sum)], dtype=torch.float64)]).to(device)
    dist.all_reduce(summed)  # every layer is held by one stage per replica (DualPipe: two, each half the batch)
    counts, aux = summed[:-1].view(args.layers, args.experts).cpu(), summed[-1].item()
    return dict(aux_loss=aux / (args.dp * args.microbatches), expert_tokens_max=int(counts.max()),
                expert_tokens_min=int(counts.min()))


def report_lines(args) -> list:
    """The all-to-all's volume on this rank, measured over the last step, beside its formula."""
    if not args.experts or args.ep == 1:
        return []
    tokens = args.batch_size // (args.dp * args.microbatches) * args.seq_len  # of one microbatch
    element = 2 if args.precision in ("bf16", "fp16") else 4
    formula = 2 * (args.ep - 1) / args.ep * tokens * args.top_k * args.hidden * element
    measured = {d: 2 * Stats.sent[d] / max(Stats.calls[d], 1) for d in Stats.sent}  # 2 all-to-alls a layer
    return [f"all-to-all per layer each way, rank 0: formula 2(ep-1)/ep x tokens x k x hidden x bytes = "
            f"{formula / 2**10:.1f} KiB (balanced routing); measured forward {measured['forward'] / 2**10:.1f} KiB, "
            f"backward {measured['backward'] / 2**10:.1f} KiB"]

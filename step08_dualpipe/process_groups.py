"""Where a rank sits in the (pipeline x data-parallel x tensor-parallel) grid, and the groups it talks in.

Layout, as in Megatron-LM: rank = stage * (dp * tp) + dp_rank * tp + tp_rank, the
tensor-parallel index fastest. With tp=2, pp=2, dp=2:

    stage 0: ranks 0 1 | 2 3      <- TP groups (0 1) and (2 3): one layer split over two ranks
    stage 1: ranks 4 5 | 6 7         DP groups (0 2), (1 3), ...: same shard, different data
             replica 0 | replica 1   PP groups (0 4), (1 5), ...: a pipeline of one shard

TP all-reduces a whole microbatch activation twice per layer in every forward
and twice in every backward, and every layer waits for it: by far the most
traffic, on the critical path. DP all-reduces the gradients once per step, PP
sends one activation and one gradient per stage boundary per microbatch (tp-fold
less with scatter-gather); both can overlap compute. Adjacent ranks sit in one
node on the fastest links, so TP gets them, and the pipeline, whose messages go
between two ranks only, is the one that crosses nodes (notebook, section 6).

A rank sends activations to the same (dp_rank, tp_rank) of the next stage, and
averages its gradients with the same (stage, tp_rank) of the other replicas.
With tp=1 this is step 05's layout.
"""
from datetime import timedelta

import torch.distributed as dist


def grid_rank(stage: int, dp_rank: int, tp_rank: int, dp: int, tp: int) -> int:
    """The global rank at (stage, dp_rank, tp_rank): TP varies fastest, then DP, then the stage."""
    return (stage * dp + dp_rank) * tp + tp_rank


def grid_coordinates(rank: int, dp: int, tp: int):
    """(stage, dp_rank, tp_rank) of a rank."""
    stage, within = divmod(rank, dp * tp)
    return (stage, *divmod(within, tp))


def grid_groups(tp: int, pp: int, dp: int, twins: bool = False, ep: int = 0) -> dict:
    """Every group of the grid, as lists of ranks, in the order all ranks create them.

    tp: the ranks of one (stage, replica); dp: of one (stage, tp_rank); pp: of one
    (replica, tp_rank); model_parallel: tp x pp of one replica (all its model, once);
    embedding: first and last stage of each pipeline, which hold the tied embedding.
    twin (step 08, DualPipe only): stages s and pp-1-s of each pipeline, which hold copies of each other's.
    ep and expert_dp (step 08, with experts only; ep divides dp): ep consecutive replicas of a stage, which
    split its experts between them (experts.py), and the dp/ep replicas that hold the same experts.
    """
    ranks = lambda s, d, t: grid_rank(s, d, t, dp, tp)  # noqa: E731
    return dict(
        tp=[[ranks(s, d, t) for t in range(tp)] for s in range(pp) for d in range(dp)],
        dp=[[ranks(s, d, t) for d in range(dp)] for s in range(pp) for t in range(tp)],
        pp=[[ranks(s, d, t) for s in range(pp)] for d in range(dp) for t in range(tp)],
        model_parallel=[[ranks(s, d, t) for s in range(pp) for t in range(tp)] for d in range(dp)],
        embedding=[[ranks(0, d, t), ranks(pp - 1, d, t)] for d in range(dp) for t in range(tp)] if pp > 1 else [],
        twin=[[ranks(s, d, t), ranks(pp - 1 - s, d, t)] for s in range(pp // 2) for d in range(dp) for t in range(tp)]
        if twins else [],
        **(dict(ep=[[ranks(s, g + e, t) for e in range(ep)] for s in range(pp) for g in range(0, dp, ep)
                    for t in range(tp)],
                expert_dp=[[ranks(s, d, t) for d in range(e, dp, ep)] for s in range(pp) for e in range(ep)
                           for t in range(tp)]) if ep else {}),
    )


class ProcessGroupManager:
    """Where this rank sits in the grid and who its partners are: its coordinates (stage, dp_rank, and
    tp_rank from step 06), its process groups (one per kind of partner: made collectively, every rank
    creating every group in the same order) and its previous and next rank in the pipeline's ring.
    train.build makes one per rank; everything else asks it these questions."""

    def __init__(self, pp: int, dp: int, timeout_s: float, tp: int = 1, twins: bool = False, ep: int = 0):
        rank = dist.get_rank()
        self.pp, self.dp, self.tp, self.ep = pp, dp, tp, max(ep, 1)
        self.stage, self.dp_rank, self.tp_rank = grid_coordinates(rank, dp, tp)
        self.ep_rank = self.dp_rank % self.ep  # with experts: which share of them this rank holds
        timeout = timedelta(seconds=timeout_s)
        self.embedding_group = None  # pp = 1: the one stage holds the tied embedding once
        self.twin_group = None  # no DualPipe: each stage is held once
        # new_group is collective: every rank creates every group, in the same order.
        for kind, groups in grid_groups(tp, pp, dp, twins, ep).items():
            for members in groups:
                group = dist.new_group(members, timeout=timeout)
                if rank in members:
                    setattr(self, f"{kind}_group", group)
        # Neighbours in this rank's pipeline, as a ring: the last stage's next is the first stage.
        # Schedules never send past the ends until step 05, where activations go round the ring.
        self.next_rank = grid_rank((self.stage + 1) % pp, self.dp_rank, self.tp_rank, dp, tp)
        self.prev_rank = grid_rank((self.stage - 1) % pp, self.dp_rank, self.tp_rank, dp, tp)


def describe_rank(rank: int, dp: int, tp: int = 1) -> str:
    """A rank's place in the grid, as the messages name it ('stage s, dp d', and ', tp t' with TP)."""
    stage, dp_rank, tp_rank = grid_coordinates(rank, dp, tp)
    return f"stage {stage}, dp {dp_rank}" + (f", tp {tp_rank}" if tp > 1 else "")

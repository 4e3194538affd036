"""Where a rank sits in the (pipeline x data-parallel) grid, and the groups it talks in.

Layout, as in Megatron-LM: rank = stage * dp + dp_rank. With pp=2, dp=2:

    stage 0: ranks 0 1      <- a data-parallel group: same layers, different data
    stage 1: ranks 2 3
             |  |
             pipelines: ranks (0, 2) and (1, 3), each a full copy of the model

A rank sends activations to the same dp_rank of the next stage, and averages
its gradients with the other ranks of its stage.
"""
from datetime import timedelta

import torch.distributed as dist


class ProcessGroupManager:
    """Where this rank sits in the grid and who its partners are: its coordinates (stage, dp_rank, and
    tp_rank from step 06), its process groups (one per kind of partner: made collectively, every rank
    creating every group in the same order) and its previous and next rank in the pipeline's ring.
    train.build makes one per rank; everything else asks it these questions."""

    def __init__(self, pp: int, dp: int, timeout_s: float):
        rank = dist.get_rank()
        self.pp, self.dp = pp, dp
        self.stage, self.dp_rank = divmod(rank, dp)
        timeout = timedelta(seconds=timeout_s)
        # new_group is collective: every rank creates every group, in the same order.
        for d in range(dp):
            group = dist.new_group([s * dp + d for s in range(pp)], timeout=timeout)
            if d == self.dp_rank:
                self.pp_group = group
        for s in range(pp):
            group = dist.new_group([s * dp + d for d in range(dp)], timeout=timeout)
            if s == self.stage:
                self.dp_group = group
        # Neighbours in this rank's pipeline, as a ring: the last stage's next is the first stage.
        # Schedules never send past the ends until step 05, where activations go round the ring.
        self.next_rank = ((self.stage + 1) % pp) * dp + self.dp_rank
        self.prev_rank = ((self.stage - 1) % pp) * dp + self.dp_rank


def describe_rank(rank: int, dp: int) -> str:
    """A rank's place in the grid, as the messages name it: 'stage s, dp d'."""
    stage, dp_rank = divmod(rank, dp)
    return f"stage {stage}, dp {dp_rank}"

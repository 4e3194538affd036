"""The order check of step 08's overlapped pair: every rank of an expert group must post the same all-to-alls
in the same order, since gloo and NCCL pair the k-th collective of one rank with the k-th of another.

    python tests/overlap_order.py STEP_DIR [--plant RANK]   ->  prints JSON: each rank's sequence, the problems

One process, no process group: like tests/replay.py, the step's own code runs (its model, its LayerNodes and
its interleave) over a fake transport. torch.distributed.all_to_all_single is replaced by one that only
records and returns zeros of the right shape (the count exchange returns the rank's own counts, so each
simulated rank stays self-consistent), so a wrong order shows up as a named difference, never as a hang; an
order the passes cannot follow (interleave names the node) is reported as a problem too.
Each simulated rank of an expert group of 2 runs a 2-layer stage through F0, then the pair (F1 with B0), then
B1, and its posted collectives are read from the step's own timeline (the count exchange, then each post).

--plant RANK: the negative control. That rank's pair runs the forward's attention before the backward's
combine (the first two entries of pair_order() swapped), so its first collective is the forward's count
exchange where its peer's is the backward's combine; the check must name the rank and both operations.
"""
import json
import os
import sys

import torch


class FakeWork:
    """What an async collective returns: here already complete."""

    def wait(self):
        return True


def fake_all_to_all_single(out, x, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    """Records nothing itself (the timeline does); the counts come back as sent, rows as zeros."""
    if out.shape == x.shape and output_split_sizes is None:
        out.copy_(x)  # the count exchange: as if the peer had routed the same way
    else:
        out.zero_()
    return FakeWork() if async_op else None


def posted_sequence(step, rank: int, planted: bool):
    """The collectives simulated `rank` posts over F0, (F1 with B0), B1: [(what, microbatch)] in order."""
    model, experts, overlap, stage_mod, timeline = step
    cfg = model.ModelConfig(n_layers=2, hidden=32, n_heads=2, seq_len=16, experts=4, top_k=2)
    chunk = model.Transformer(cfg, [0, 1], first=True, last=True, seed=0, ep=experts.EPGroup("fake", rank, 2))
    stage = stage_mod.PipelineStage(chunk)
    stage.nodes = overlap.LayerNodes(stage)
    recorder = timeline.Timeline(rank)
    previous = timeline.install(recorder)
    order = overlap.pair_order
    try:
        gen = torch.Generator().manual_seed(rank)
        data = [(torch.randint(0, 256, (2, 16), generator=gen), torch.randint(0, 256, (2, 16), generator=gen))
                for _ in range(2)]
        loss0 = stage_mod.drive(stage.forward_steps(0, data[0][0], data[0][1]))
        if planted:
            first, second, *rest = order()
            overlap.pair_order = lambda: [second, first, *rest]
        forward = stage.forward_steps(1, data[1][0], data[1][1])
        backward = stage.backward_steps(0, data[0][0], loss0, torch.ones_like(loss0))
        stage.overlapped_forward_backward(lambda: forward, lambda: backward)
        overlap.pair_order = order
        loss1 = stage.nodes.passes[1][-1].post.outputs[0]
        stage_mod.drive(stage.backward_steps(1, data[1][0], loss1, torch.ones_like(loss1)))
    finally:
        overlap.pair_order = order
        timeline.install(previous)
    collectives = [e for e in recorder.events if e["kind"] in (overlap.POST, timeline.ALL_TO_ALL)]
    return [(e["what"], e["microbatch"]) for e in sorted(collectives, key=lambda e: e["start"])]


def problems(sequences) -> list:
    """Where a rank's posted sequence leaves rank 0's: the rank, the position, both operations."""
    found = []
    for rank, seq in enumerate(sequences[1:], start=1):
        for k, (mine, theirs) in enumerate(zip(seq, sequences[0])):
            if mine != theirs:
                found.append(f"rank {rank} posted {mine[0]!r} (microbatch {mine[1]}) as its collective #{k}, where "
                             f"rank 0 posted {theirs[0]!r} (microbatch {theirs[1]}): gloo and NCCL would pair them")
                break
        else:
            if len(seq) != len(sequences[0]):
                found.append(f"rank {rank} posted {len(seq)} collectives, rank 0 {len(sequences[0])}")
    return found


def main(step_dir, *rest):
    sys.path.insert(0, os.path.abspath(step_dir))
    torch.set_num_threads(1)
    import torch.distributed as dist
    import experts
    import model
    import overlap
    import stage
    from support import timeline

    plant = int(rest[1]) if rest[:1] == ("--plant",) else None
    real, dist.all_to_all_single = dist.all_to_all_single, fake_all_to_all_single
    sequences, raised = [], []
    try:
        for rank in range(2):
            try:
                sequences.append(posted_sequence((model, experts, overlap, stage, timeline), rank, rank == plant))
            except Exception as err:  # an order the passes cannot follow (interleave says which node), or none yet
                raised.append(f"rank {rank}'s pair raised {type(err).__name__}: {err}")
                sequences.append([])
    finally:
        dist.all_to_all_single = real
    print(json.dumps(dict(sequences=sequences, problems=raised or problems(sequences))))


if __name__ == "__main__":
    main(*sys.argv[1:])

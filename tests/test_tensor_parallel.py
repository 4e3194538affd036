"""Step 06's tensor parallelism, piece by piece: the grid's layout, each split layer against the operation
it splits, the exact initialisation, scatter-gather pipeline messages, and the harness's reassembly.

The whole model is checked against one device in test_equivalence.py; these tests say which piece is wrong.
"""
import json
import sys

import pytest
import torch

from conftest import STEPS
import harness
from harness import REPO, launch, whole_tensors

TP_STEPS = [s for s in STEPS if s >= "step06"]
CHECKS = REPO / "tests" / "check_tensor_parallel.py"


def run_checks(step_dir, mode: str, world: int, tmp_path):
    out = tmp_path / "found.json"
    if world == 1:
        harness.run([sys.executable, str(CHECKS), str(step_dir), mode, str(out)], check=True, timeout=120)
    else:
        launch([sys.executable, str(CHECKS), str(step_dir), mode, str(out)], world, tmp_path, timeout=120)
    return json.loads(out.read_text())


def layout_problems(tp: int, pp: int, dp: int, groups: dict, coords: list) -> list:
    """What is wrong with a grid, by Megatron-LM's rule rank = stage*(dp*tp) + dp_rank*tp + tp_rank."""
    world = tp * pp * dp
    problems = [f"rank {r} sits at {tuple(c)}" for r, c in enumerate(coords)
                if tuple(c) != (r // (tp * dp), r // tp % dp, r % tp)]
    for kind, size in (("tp", tp), ("dp", dp), ("pp", pp), ("model_parallel", tp * pp)):
        if sorted(r for g in groups[kind] for r in g) != list(range(world)):
            problems.append(f"the {kind} groups do not partition the {world} ranks")
        problems += [f"{kind} group {g} has {len(g)} ranks, not {size}" for g in groups[kind] if len(g) != size]
    for kind, stride in (("tp", 1), ("dp", tp), ("pp", tp * dp)):
        problems += [f"{kind} group {g} does not have stride {stride}" for g in groups[kind]
                     if any(b - a != stride for a, b in zip(g, g[1:]))]
    problems += [f"pipeline {g} mixes (dp_rank, tp_rank)" for g in groups["pp"]
                 if len({(r // tp % dp, r % tp) for r in g}) != 1]
    problems += [f"model-parallel group {g} mixes replicas" for g in groups["model_parallel"]
                 if len({r // tp % dp for r in g}) != 1]
    ends = sorted([r, r + (pp - 1) * tp * dp] for r in range(tp * dp)) if pp > 1 else []
    if sorted(groups["embedding"]) != ends:
        problems.append(f"embedding groups {groups['embedding']} are not first and last stage: {ends}")
    return problems


@pytest.mark.parametrize("step", TP_STEPS)
def test_grid_layout_for_every_shape_up_to_64_ranks(step, step_dirs, tmp_path):
    grids = run_checks(step_dirs[step], "layout", 1, tmp_path)
    shapes = [(tp, pp, dp) for tp in range(1, 65) for pp in range(1, 65) for dp in range(1, 65) if tp * pp * dp <= 64]
    assert sorted(tuple(map(int, k.split())) for k in grids) == sorted(shapes)
    for key, grid in grids.items():
        tp, pp, dp = map(int, key.split())
        assert not layout_problems(tp, pp, dp, grid["groups"], grid["coords"]), key
        if tp == 1:  # step 05's layout: rank = stage * dp + dp_rank
            assert [tuple(c) for c in grid["coords"]] == [(*divmod(r, dp), 0) for r in range(pp * dp)], key
    # Negative control: the same checker on a dp-fastest layout (tp 2, dp 2) must object.
    wrong = grids["2 1 2"]
    swapped = dict(wrong["groups"], tp=wrong["groups"]["dp"], dp=wrong["groups"]["tp"])
    assert layout_problems(2, 1, 2, swapped, wrong["coords"])


@pytest.mark.parametrize("step", TP_STEPS)
def test_each_split_layer_matches_the_operation_it_splits(step, step_dirs, tmp_path):
    """Column, row, vocab-parallel embedding and cross-entropy (also with every vocabulary id as a target,
    shard boundaries included, and with logits near 1000), forward and backward, at 2 ranks, within 1e-6
    relative (only the grouping of partial sums changes); the embedding and the initialisation, which only
    pick rows and slices, bitwise. Each control (its all-reduce skipped, the wrong rank's slice, the
    vocabulary range off by one, the row maxima summed) must fail."""
    for rank, found in enumerate(run_checks(step_dirs[step], "blocks", 2, tmp_path)):
        for name, result in found.items():
            assert result["ok"], (f"rank {rank}, {name}: the split layer's outputs or gradients differ from the "
                                  f"unsplit operation's by {result['rel']:.2e} relative (1e-6 allowed)")
            assert not result["control"]["ok"], f"rank {rank}, {name}: the broken variant passed too"
            if name.startswith(("embedding", "init")):
                assert result["bitwise"], f"rank {rank}, {name} should be bitwise equal"


@pytest.mark.parametrize("step", TP_STEPS)
def test_scatter_gather_delivers_what_a_full_send_does(step, step_dirs, tmp_path):
    """tp 2 x pp 2: the activation and the gradient arrive bitwise equal, with half the bytes on the wire;
    a size that does not split in two is sent whole. Control: both TP ranks send the same slice."""
    for rank, found in enumerate(run_checks(step_dirs[step], "scatter", 4, tmp_path)):
        split, whole = found["(2, 6, 8)"], found["(3, 5, 7)"]
        assert split["full"] and split["sg"] and not split["control"], (rank, split)
        assert split["split"] and split["bytes_sg"] * 2 == split["bytes_full"] == 2 * 6 * 8 * 4, (rank, split)
        assert whole["sg"] and not whole["split"] and whole["bytes_sg"] == whole["bytes_full"], (rank, whole)


def test_shards_are_put_back_together_and_copies_must_agree():
    """harness.whole_tensors on hand-made results: the split weight is concatenated in TP order, and a
    replicated gain or a tied embedding copy that differs by one ulp is reported."""
    w, gain = torch.arange(8.0).view(4, 2), torch.ones(2)

    def rank(tp_rank, gain_value, embed_value):  # one rank's results: a split weight, a gain, an embedding
        tensors = {"w": w.chunk(2, 0)[tp_rank], "norm.weight": gain_value, "embed.weight": embed_value}
        return dict(grads=tensors, splits={"w": 0, "norm.weight": None, "embed.weight": None}, place=(0, tp_rank, 2))

    ulp = torch.nextafter(gain, gain + 1)
    good = [rank(0, gain, gain), rank(1, gain, gain), rank(0, gain, gain), rank(1, gain, gain)]  # two stages
    errors = []
    whole = whole_tensors(good, "grads", errors, "good")
    assert not errors and torch.equal(whole[0, "w"], w) and torch.equal(whole[0, "norm.weight"], gain)
    replicated = [rank(0, gain, gain), rank(1, ulp, gain)]  # a norm gain on two TP ranks
    tied = [rank(0, gain, gain), rank(0, gain, ulp), rank(1, gain, gain), rank(1, gain, gain)]  # tied copies
    for broken in (replicated, tied):
        errors = []
        whole_tensors(broken, "grads", errors, "broken")
        assert errors

"""Step 08's overlapped pair (overlap.py): the order of its all-to-alls across an expert group, the time its
order leaves exposed, and its arithmetic.

The pair's arithmetic is proven in test_equivalence.py (overlapped = sequential, bitwise, pp 2 x dp 2, both
schedules; both against one device); here once more on one small launch, as exercise 08.overlap's check.
tests/overlap_order.py runs the step's own nodes and interleave over a fake transport, one process, in
seconds: every rank of an expert group must post the same collectives in the same order, and a planted rank
that posts them in another order must be named, with both operations, never found by a hang.
tests/overlap_lanes.py lays the step's order on the ideal lanes (compute, link): what it leaves exposed.
"""
import json
import sys

from harness import REPO, run, run_cases
from test_equivalence import EP2, TINY, bitwise_differences


def posted(step_dirs, *flags, script="overlap_order.py"):
    done = run([sys.executable, str(REPO / "tests" / script), str(step_dirs["step08_dualpipe"]), *flags],
               cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_the_pairs_order_is_legal_and_the_same_on_every_rank(step_dirs):
    """pair_order, as interleave runs it: each pass's nodes in their own order, every node run, and both ranks
    of an expert group post the same collectives in the same order (exercise 08.overlap's first check)."""
    problems = posted(step_dirs)["problems"]
    assert not problems, "\n".join(problems)


def test_the_pairs_order_hides_the_link_on_the_ideal_lanes(step_dirs):
    """On the ideal lanes (tests/overlap_lanes.py: node times in units, a link of 2 per all-to-all), the step's
    order leaves at most half an all-to-all exposed over a pair of 2-layer chunks; the sequential pair, the
    control, exposes every all-to-all whole."""
    lanes = posted(step_dirs, script="overlap_lanes.py")
    assert lanes["sequential"] >= 6 * lanes["target"], lanes  # the control: the lanes do measure waiting
    assert lanes["exposed"] <= lanes["target"], (
        f"the order leaves {lanes['exposed']:g} units exposed, the target is at most {lanes['target']:g} "
        f"(the sequential pair: {lanes['sequential']:g}); {'; '.join(lanes['waits'])}")


def test_the_overlapped_pair_is_bitwise_the_sequential_pair(step_dirs, tmp_path):
    """One launch of dualpipev with experts (pp 2 x dp 2, ep 2, top-k 2, 4 layers), overlapped and sequential:
    losses, gradients and weights after three steps equal bit for bit (exercise 08.overlap's last check)."""
    flags = [*TINY, *EP2, "--layers", "4", "--microbatches", "4", "--experts", "4", "--top-k", "2",
             "--schedule", "dualpipev"]
    failures = run_cases(step_dirs["step08_dualpipe"], 4, [flags, [*flags, "--pairs", "sequential"]], tmp_path,
                         timeout=120)
    assert not any(failures.values()), failures
    errors = bitwise_differences(tmp_path / "case0", tmp_path / "case1", 4)
    assert not errors, "overlapped and sequential pairs differ:\n" + "\n".join(errors[:10])


def test_every_rank_of_an_expert_group_posts_the_same_all_to_alls_in_megatrons_order(step_dirs):
    found = posted(step_dirs)
    assert found["problems"] == [], found["problems"]
    sequence = [tuple(s) for s in found["sequences"][0]]
    # The pair (F of microbatch 1, B of microbatch 0) opens with B's combine of the last layer, posted before
    # F's attention exchanges its counts; F's dispatch goes out before B's dispatch of the same layer pair.
    pair = sequence.index(("post backward combine of layer 1", 0))
    assert sequence[pair + 1] == ("counts", None), sequence
    assert sequence.index(("post forward dispatch of layer 0", 1)) < sequence.index(
        ("post backward dispatch of layer 1", 0)) < sequence.index(("post forward combine of layer 0", 1))


def test_a_rank_that_posts_in_another_order_is_named(step_dirs):
    """The control: rank 1 runs the forward's attention before the backward's combine."""
    problems = posted(step_dirs, "--plant", "1")["problems"]
    assert len(problems) == 1 and problems[0].startswith("rank 1 posted 'counts'"), problems
    assert "rank 0 posted 'post backward combine of layer 1'" in problems[0], problems

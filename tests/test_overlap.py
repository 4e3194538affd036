"""Step 08's overlapped pair (overlap.py): the order of its all-to-alls across an expert group.

The pair's arithmetic is proven in test_equivalence.py (overlapped = sequential, bitwise; both against one
device). Here tests/overlap_order.py runs the step's own nodes and interleave over a fake transport, one
process, in seconds: every rank of an expert group must post the same collectives in the same order, and a
planted rank that posts them in another order must be named, with both operations, never found by a hang.
"""
import json
import sys

from harness import REPO, run


def posted(step_dirs, *flags):
    done = run([sys.executable, str(REPO / "tests" / "overlap_order.py"), str(step_dirs["step08_dualpipe"]), *flags],
               cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


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

"""Step 08: a backward split into B and W computes the same gradients as one backward, bitwise.

The schedule built on it, zb1p, is replayed in test_schedules.py and checked against the single-device
references in test_equivalence.py.
"""
import json
import sys

import pytest

from conftest import STEPS
import harness
from harness import REPO, launch

SPLIT_STEPS = [s for s in STEPS if s >= "step08"]


@pytest.mark.parametrize("step", SPLIT_STEPS)
def test_b_then_w_equals_one_backward_bitwise(step, step_dirs, tmp_path):
    """Two microbatches through a whole model (tp 1) and a TP-split one (tp 2), fp32 and bf16: B of both,
    then W of both, gives every gradient bitwise equal to two whole backwards, and leaves the store
    empty. Control: without the W's the Linear weights have no gradient, and the check must see it."""
    out = tmp_path / "found.json"
    launch([sys.executable, str(REPO / "tests" / "check_weight_grad_store.py"), str(step_dirs[step]), str(out)], 2, tmp_path, 120)
    for rank, found in enumerate(json.loads(out.read_text())):
        assert set(found) == {f"tp{tp} torch.{d}" for tp in (1, 2) for d in ("float32", "bfloat16")}, found
        for case, result in found.items():
            assert result["equal"] and result["store_empty"], (rank, case, result)
            assert not result["control_equal"] and result["deferred"] > 0, (rank, case, result)


ORDER_CHECK = """
import sys
sys.path.insert(0, sys.argv[1])
from weight_grad_store import WeightGradStore
ran = []
for key in [(0, 0), (1, 0)]:  # two split B's: chunk 0 then chunk 1 of microbatch 0
    with WeightGradStore.split(key):
        WeightGradStore.put(lambda key=key: ran.append(key))
order = [(0, 0), (1, 0)] if sys.argv[2] == "in order" else [(1, 0), (0, 0)]
try:
    print(WeightGradStore.oldest(), end=" ")
    for key in order:
        WeightGradStore.pop(key)
    print("ran", ran, "empty", not WeightGradStore.queue)
except AssertionError as err:
    print("refused:", err)
"""


@pytest.mark.parametrize("step", SPLIT_STEPS)
def test_store_runs_each_w_under_its_key_oldest_first(step, step_dirs):
    """The store files each W under its (chunk, microbatch), says which is oldest, runs them in the order of
    their B's and ends empty. Control: asking for the newer W first is refused, naming both."""
    def run(order):
        done = harness.run([sys.executable, "-c", ORDER_CHECK, str(step_dirs[step]), order],
                           capture_output=True, text=True, timeout=60)
        return done.stdout.strip()
    assert run("in order") == "(0, 0) ran [(0, 0), (1, 0)] empty True"
    assert run("newest first") == "(0, 0) refused: W of (1, 0) before the W of (0, 0), whose B ran first"

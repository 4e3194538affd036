"""Step 08: a backward split into B and W computes the same gradients as one backward, bitwise.

The schedule built on it, zb1p, is replayed in test_schedules.py and checked against the single-device
references in test_equivalence.py.
"""
import json
import sys

import pytest

from conftest import STEPS
from harness import REPO, launch

SPLIT_STEPS = [s for s in STEPS if s >= "step08"]


@pytest.mark.parametrize("step", SPLIT_STEPS)
def test_b_then_w_equals_one_backward_bitwise(step, step_dirs, tmp_path):
    """Two microbatches through a whole model (tp 1) and a TP-split one (tp 2), fp32 and bf16: B of both,
    then W of both, gives every gradient bitwise equal to two whole backwards, and leaves the store
    empty. Control: without the W's the Linear weights have no gradient, and the check must see it."""
    out = tmp_path / "found.json"
    launch([sys.executable, str(REPO / "tests" / "split_checks.py"), str(step_dirs[step]), str(out)], 2, tmp_path, 120)
    for rank, found in enumerate(json.loads(out.read_text())):
        assert set(found) == {f"tp{tp} torch.{d}" for tp in (1, 2) for d in ("float32", "bfloat16")}, found
        for case, result in found.items():
            assert result["equal"] and result["store_empty"], (rank, case, result)
            assert not result["control_equal"] and result["deferred"] > 0, (rank, case, result)

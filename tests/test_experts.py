"""Step 08's experts (experts.py), piece by piece, on 2 ranks (tests/check_experts.py): dispatch and combine,
a layer against the test's one-process MoE (moe_reference.py), the tie-break, the aux loss, the all-to-all
volume. Each check has a planted bug that must fail it. The whole model is in test_equivalence.py."""
import json
import sys

import pytest

from harness import REPO, launch

CHECKS = ["dispatch", "layer_top2", "layer_skewed", "tie_break", "aux", "volume"]
CONTROLLED = ["dispatch", "tie_break", "aux"]


@pytest.fixture(scope="module")
def found(step_dirs, tmp_path_factory):
    """Each rank's results of check_experts.py, one launch of 2 ranks."""
    out = tmp_path_factory.mktemp("experts")
    launch([sys.executable, str(REPO / "tests" / "check_experts.py"), str(step_dirs["step08_dualpipe"]), str(out)], 2,
           out, timeout=120)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("check", CHECKS)
def test_expert_piece_matches_its_reference(check, found):
    for rank, results in enumerate(found):
        assert results[check]["ok"], f"rank {rank}, {check}: {results[check]}"


@pytest.mark.parametrize("check", CONTROLLED)
def test_expert_piece_control_fails(check, found):
    for rank, results in enumerate(found):
        assert not results[check]["control"]["ok"], f"rank {rank}, {check}: the planted bug passed"


def test_an_expert_with_no_tokens_gets_a_zero_gradient(found):
    """The skewed router (all ties, top-k 1) sends every token to expert 0: rank 1's experts 2 and 3 get no
    rows, and their gradients are zeros, not missing (the expert-dp all-reduce needs every one)."""
    skewed = found[1]["layer_skewed"]
    assert not skewed["missing"] and skewed["grad_norms"] and not any(skewed["grad_norms"].values())
    assert any(found[0]["layer_skewed"]["grad_norms"].values())


def test_uneven_splits_were_exercised(found):
    """The dispatch check's routing gives unequal send and receive splits, and a zero one."""
    d0 = found[0]["dispatch"]
    assert d0["send"] != d0["recv"] and 0 in d0["send"]

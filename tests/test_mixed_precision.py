"""Step 07: every rank skips an overflowed step together, and the global gradient norm counts each number once
(step 08: also under DualPipe, where each stage lives on two ranks).

Equivalence with the microbatch-wise half-precision reference, overflow skips included, is in
test_equivalence.py; the loss scaler's rules in test_loss_scaler.py.
"""
import json
import sys

import pytest

from conftest import STEPS
from harness import REPO, RTOL, WEIGHT_RTOL, launch

MP_STEPS = [s for s in STEPS if s >= "step07"]
DUALPIPE_STEPS = [s for s in STEPS if s >= "step08"]
CHECKS = REPO / "tests" / "check_mixed_precision.py"
FP16_NORM_REL = 1e-3  # two fp16 roundings (2 x 4.9e-4): its weights, activations and messages round to 11 bits;
#                       measured 4.3e-5 on this model, against the scale times (65536 or 1024) a missed unscale gives


def run_checks(step_dir, mode, tmp_path, world=4):
    launch([sys.executable, str(CHECKS), str(step_dir), mode, str(tmp_path / "found.json")], world, tmp_path, 180)
    return json.loads((tmp_path / "found.json").read_text())


@pytest.mark.parametrize("step", MP_STEPS)
def test_an_inf_on_one_rank_makes_every_rank_skip(step, step_dirs, tmp_path):
    """tp 2 x pp 2 in fp16, an inf put into one gradient of rank 3 only: found_inf is True on every rank,
    every rank skips, weights and masters stay bitwise, no optimizer state appears. Control: a found_inf
    that reads the rank's own gradients alone finds it on rank 3 only. The same run shows the types: half
    weights and pipeline messages, fp32 main gradients."""
    found = run_checks(step_dirs[step], "inf", tmp_path)
    answers = [f["found"] for f in found]
    missed = [rank for rank, answer in enumerate(answers) if not answer]
    assert not missed, (f"an inf on rank 3 only: found_inf returned {answers} on ranks 0-3, so ranks {missed} "
                        f"would step while rank 3 skips; every rank of the model-parallel group must find it")
    assert [f["skip"] for f in found] == [True] * 4
    assert [f["control"] for f in found] == [False, False, False, True]
    for rank, f in enumerate(found):
        assert f["unchanged"] and f["optimizer_state"] == 0, (rank, f)
        assert f["dtypes"] == dict(params=["torch.float16"], main_grads=["torch.float32"],
                                   received=["torch.float16"]), (rank, f["dtypes"])


@pytest.mark.parametrize("step", MP_STEPS)
def test_global_norm_counts_every_number_once_and_clips(step, step_dirs, tmp_path):
    """tp 2 x pp 2, tied embeddings, fp32: every rank's norm is clip_grad_norm_ of the single-device
    gradients (1e-6 relative). A double count moves the norm by only about 1e-4, so the set of counted
    parameters is checked itself: a split parameter on each TP rank, a replicated one on one rank only,
    the last stage's copy of the tied embedding nowhere. With --clip-grad 0.5 every rank scales its
    gradients by 0.5 / (norm + 1e-6), bitwise (the test checks that the norm is above 0.5: clipping is active)."""
    found = run_checks(step_dirs[step], "norm", tmp_path)
    reference = found[0]["reference"]
    assert reference > 0.5, "the check needs a norm above the clip, or clipping is a no-op"
    for name in sorted({n for f in found for n in f["splits"]}):  # first: a double count names its parameter
        ranks = [rank for rank, f in enumerate(found) if name in f["counted"]]
        split = next(f["splits"][name] for f in found if name in f["splits"])
        rule = ("split over TP: each TP rank counts its slice, and a tied copy is not counted" if split is not None
                else "replicated over TP: only TP rank 0 counts it")
        assert len(ranks) == (2 if split is not None else 1), f"{name} is counted on ranks {ranks}; it is {rule}"
    for rank, f in enumerate(found):
        assert abs(f["norm"] - reference) <= 1e-6 * reference, \
            f"rank {rank}: global_norm {f['norm']:.8g}, the single-device norm {reference:.8g}"
        assert f["clipped"], f"rank {rank}: its gradients are not scaled by clip / (norm + 1e-6)"


@pytest.mark.parametrize("step", MP_STEPS)
def test_clipping_under_a_loss_scale_sees_the_unscaled_gradients(step, step_dirs, tmp_path):
    """tp 2 x pp 2, --clip-grad 0.5 under a loss scale: the logged grad_norm is the single-device fp32 norm,
    1e-6 relative with a constant scale of 1024 in fp32 (a power of two: the unscale is exact), and within
    FP16_NORM_REL in fp16 (its weights, activations and messages round to 11 bits); every rank scales its
    unscaled gradients by exactly 0.5 / (norm + 1e-6). Control: with the unscale left out, the norm is the
    scale times too large."""
    found = run_checks(step_dirs[step], "scaled", tmp_path)
    reference = found[0]["reference"]
    assert reference > 0.5, "the check needs a norm above the clip, or clipping is a no-op"
    for rank, f in enumerate(found):
        assert abs(f["constant"]["norm"] - reference) <= 1e-6 * reference, (rank, f, reference)
        assert abs(f["fp16"]["norm"] - reference) <= FP16_NORM_REL * reference, (rank, f, reference)
        assert f["constant"]["clipped"] and f["fp16"]["clipped"], (rank, f)
        assert abs(f["control"]["norm"] - reference) > FP16_NORM_REL * reference, (rank, f, reference)


@pytest.mark.parametrize("step", DUALPIPE_STEPS)
def test_dualpipe_norm_counts_each_stage_once_and_clips_as_one_device(step, step_dirs, tmp_path, replay_passes):
    """dualpipe (each stage on two ranks) and dualpipev, pp 2, --clip-grad 0.5, three steps: each step's logged
    grad_norm is the single-device model's (RTOL: the two copies' gradients are summed in another order), and
    the clipped weights are its clipped weights (WEIGHT_RTOL). Control: chunk 1's parameters counted the other
    way must fail: dualpipe's reverse-direction copies counted too give sqrt(2) times the norm, a clip too hard
    and weights off the reference; dualpipev's second chunk left out gives a smaller norm."""
    for schedule in ("dualpipe", "dualpipev"):
        replay_passes(step, schedule)
    found = run_checks(step_dirs[step], "twins", tmp_path, world=2)
    reference = found[0]["reference"]
    assert min(reference) > 0.5, "the check needs norms above the clip, or clipping is a no-op"
    for schedule in ("dualpipe", "dualpipev"):
        for rank, f in enumerate(found):
            norms, errors = f[schedule]["norms"], f[schedule]["weight_errors"]
            assert norms == pytest.approx(reference, rel=RTOL, abs=0), (rank, schedule, norms, reference)
            assert max(errors.values()) <= WEIGHT_RTOL, (rank, schedule, errors)
        held = {name for f in found for name in f[schedule]["weight_errors"]}
        assert held == set(found[0]["names"]), f"{schedule}: not every parameter was compared"
    for rank, f in enumerate(found):  # the controls
        twice = [n / r for n, r in zip(f["dualpipe_control"]["norms"], reference)]
        assert twice == pytest.approx([2 ** 0.5] * len(reference), rel=RTOL, abs=0), (rank, twice)
        assert max(f["dualpipe_control"]["weight_errors"].values()) > WEIGHT_RTOL, (rank, f["dualpipe_control"])
        assert all(n < r * (1 - RTOL) for n, r in zip(f["dualpipev_control"]["norms"], reference)), (rank, f)

"""Step 08's experts (experts.py), piece by piece, on 2 ranks (tests/check_experts.py): dispatch and combine,
a layer against the test's one-process MoE (moe_reference.py), the tie-break, the aux loss, the all-to-all
volume. Each check has a planted bug that must fail it. The whole model is in test_equivalence.py."""
import json
import re
import sys

import pytest

from harness import REPO, launch, run
from test_train import bound_problem, read_log, train_py

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


SMALL = ["--seq-len", "64", "--steps", "2"]
EP_RUN = ["--pp", "2", "--dp", "2", "--experts", "4", "--top-k", "2", "--ep", "2", *SMALL]


@pytest.fixture(scope="module")
def expert_run(step_dirs, tmp_path_factory):
    """(what rank 0 printed, the log, the trace) of a run at pp 2 x dp 2 with 4 experts, ep 2, hidden 128."""
    out = tmp_path_factory.mktemp("expert-run")
    stdout = train_py(step_dirs["step08_dualpipe"], 4, *EP_RUN, "--log-json", str(out / "log.jsonl"),
                      "--trace", str(out / "trace.json"), out=out)
    return stdout, read_log(out / "log.jsonl"), json.loads((out / "trace.json").read_text())["traceEvents"]


def test_the_report_shows_the_experts(expert_run):
    """Each step's line has the aux loss and the least and most loaded expert's tokens (of 2 x 8 x 64 token-expert
    assignments per layer: 256 per expert when balanced, at most the 512 tokens); the bubble report the
    all-to-all's share on every rank; the trace the all-to-all as boxes of their own; the volume line the formula
    2(ep-1)/ep x tokens x k x hidden x bytes: 64 tokens a microbatch, so 2 x 1/2 x 64 x 2 x 128 x 4 B = 64 KiB."""
    stdout, records, trace = expert_run
    assert all(0 <= r["expert_tokens_min"] <= 256 <= r["expert_tokens_max"] <= 512 and r["aux_loss"] > 0
               for r in records), records
    assert len(re.findall(r"^step +\d+  loss [0-9.]+  aux [0-9.]+  expert tokens \d+\.\.\d+ ", stdout, re.M)) == 2
    assert len(re.findall(r"rank \d .*bubble [0-9.]+  of which all-to-all [0-9.]+", stdout)) == 4, stdout
    assert any(e.get("cat") == "all-to-all" for e in trace)
    assert "x bytes = 64.0 KiB (balanced routing); measured forward" in stdout, stdout


def test_memory_estimate_counts_the_experts(step_dirs, expert_run):
    """budget.py with experts: each rank's parameters (E/ep experts and a router a layer) a close lower bound of
    the logged param_bytes; the activations (k dispatched rows a token, each with its SwiGLU's 4 x mlp_hidden)
    a close lower bound of the sum over an expert group's ranks, which routing shares unevenly between them."""
    last = expert_run[1][-1]
    measured = last["peak_activation_bytes"]
    groups = [measured[0] + measured[1], measured[2] + measured[3]]

    def problems(flags):
        done = run([sys.executable, str(REPO / "tests" / "check_bad_flags.py"),
                               str(step_dirs["step08_dualpipe"]), "--estimate", "4", *flags], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        estimates = json.loads(done.stdout)
        weights = [e["parameters"] / 4 for e in estimates for _ in range(2)]  # 2 ranks per stage
        return bound_problem(weights, last["param_bytes"]), bound_problem([2 * e["activations"] for e in estimates],
                                                                           groups)

    assert problems(EP_RUN) == (None, None)
    dense = problems(["--pp", "2", "--dp", "2", *SMALL])  # the control: the same run's estimate without experts
    assert dense[0] is not None and dense[1] is not None, dense

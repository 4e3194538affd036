"""Schedules checked two ways: replayed without a model (order, deadlock freedom) and by measured memory."""
import json
import sys

import pytest

import formulas
from conftest import STEPS
import harness
from harness import REPO, launch, memory_report_problems, throughput_problem

SCHEDULED = [s for s in STEPS if s >= "step04"]  # steps whose schedule.py offers a choice of schedules


@pytest.mark.parametrize("step", SCHEDULED)
def test_schedule_order_is_complete_and_deadlock_free(step, replay_report):
    report = replay_report(step)
    assert report["configurations"] >= 1000, report
    assert not report["problems"], "\n".join(report["problems"])
    assert not report["refused_but_safe"], f"the rules refuse configurations the replay proves safe: {report}"
    assert not report["schedules_at_fault"], report["schedules_at_fault"]  # the gate of conftest.replay_passes


@pytest.mark.parametrize("step", SCHEDULED)
def test_replay_catches_broken_schedules(step, replay_report):
    """Negative controls: each broken variant of the step's own schedule must be caught."""
    controls = {k: v for k, v in replay_report(step).items() if k.endswith(("_caught", "_deadlocks"))}
    assert len(controls) >= 3 and all(controls.values()), controls


@pytest.mark.parametrize("step", SCHEDULED)
def test_timeout_line_counts_the_messages_of_this_step(step, replay_report):
    """tests/timeout_count.py: a receive that times out in a rank's second step names activation 0, not the
    count of the whole run (control: a begin_step that keeps the count must be caught)."""
    report = replay_report(step)
    assert report["timeout_count_problem"] is None, report["timeout_count_problem"]
    assert report["timeout_count_control_caught"]


ZERO_BUBBLE = [s for s in SCHEDULED if s >= "step08"]


@pytest.mark.parametrize("step", ZERO_BUBBLE)
def test_zb1p_ideal_timeline_idles_p_minus_1_times_f_plus_b_minus_w(step, replay_report):
    """The replayed zb1p order of every allowed (pp, m), each pass as early as its data allows, with exact
    rational pass times (F = B = W, and F = 1, B = 1.2, W = 0.6): every rank idles (p-1)(F+B-W).
    Control: 1F1B's order, whose backward is B and W at once, must fail the same check."""
    report = replay_report(step)
    assert report["zb1p_bubble_configurations"] >= 400 and not report["zb1p_bubble_problems"], report
    assert report["one_f_one_b_bubble_caught"]


@pytest.mark.parametrize("step", ZERO_BUBBLE)
def test_dualpipe_and_dualpipev_follow_the_eight_phases(step, replay_report):
    """tests/two_way.py: every allowed DualPipe (p = 2..8, even) and DualPipeV (p = 1..8) with m from 2p to
    2p+12: the phase counts, F before B before W, W's in FIFO order, messages matched, peak PP+1, the ideal
    timeline's idle, with pairs as DeepSeek runs them and with --pairs sequential; DualPipeV's order equal to
    torch's ScheduleDualPipeV; and six controls caught."""
    report = replay_report(step)
    assert report["two_way_configurations"] >= 100 and not report["two_way_problems"], report["two_way_problems"]
    assert report["torch_dualpipev_compared"] >= 40 and not report["torch_dualpipev_differences"], report
    controls = {k: v for k, v in report.items() if k.startswith("two_way_") and k.endswith(("_caught", "_deadlocks"))}
    assert len(controls) == 6 and all(controls.values()), controls


@pytest.mark.parametrize("step", SCHEDULED)
def test_pipedream_weight_versions(step, replay_report):
    """tests/weight_versions.py: every allowed PipeDream, vertical-sync and 2BW run up to p 8, m 6, 3 steps:
    each backward reads the weights its forward read, each forward the papers' version, the peak of
    versions held is the formula's; controls: stashing off, vertical sync's rule off by one, 2BW updating
    after every backward."""
    report = replay_report(step)
    assert report["pipedream_configurations"] >= 200 and not report["pipedream_problems"], report["pipedream_problems"]
    controls = {k: v for k, v in report.items() if k.startswith("pipedream_") and k.endswith("_caught")}
    assert len(controls) == 3 and all(controls.values()), controls


@pytest.mark.parametrize("step", STEPS)
def test_printed_formulas_match_the_papers(step, step_dirs):
    """bubble_formula and peak_stored_microbatches, which train.py prints, against tests/formulas.py."""
    done = harness.run([sys.executable, str(REPO / "tests" / "check_formulas.py"), str(step_dirs[step])],
                       capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["configurations"] >= 8 and not report["problems"], report


# Through train.py's own log, with data parallelism (the equivalence runs check the meter against the
# formula in many more layouts, every schedule included): one case per step, its newest flushed schedule
# (step 03: afab, its only one, which has neither --schedule nor --deallocate).
MEMORY_CASES = [(step, "zb1p", 2, 2, 4, 1) if step >= "step08" else (step, "interleaved", 2, 2, 2, 2)
                if step >= "step05" else (step, "1f1b", 2, 2, 4, 1) for step in SCHEDULED]
MEMORY_CASES.insert(0, ("step03_afab", "afab", 2, 2, 4, 1))
SEQ_LEN = 16


@pytest.mark.parametrize("step, schedule, pp, dp, m, v", MEMORY_CASES)
def test_measured_peak_activations_match_formula(step, schedule, pp, dp, m, v, step_dirs, tmp_path, replay_passes):
    """train.py's log and its printed report give each rank's peak of stored microbatches as its own stage's
    formula says (with dp 2, rank r is stage r // 2); and each rank
    all-reduces its gradients once per step, after its last backward (after its last W, in zb1p: the
    weight gradients are complete only then). The same run's tokens_per_s, logged and printed, counts every
    replica's tokens: --batch-size x --seq-len over the step's time (control: one replica's, half that, fails)."""
    if step in SCHEDULED:
        replay_passes(step, schedule)
    log, trace = tmp_path / "log.jsonl", tmp_path / "trace.json"
    flags = ["--device", "cpu", "--pp", str(pp), "--dp", str(dp), "--microbatches", str(m), "--batch-size",
             str(dp * m), "--layers", "8", "--hidden", "32", "--heads", "2", "--seq-len", str(SEQ_LEN), "--steps", "2",
             "--log-json", str(log), "--trace", str(trace), "--timeout", "60"]
    if step in SCHEDULED:
        flags += ["--schedule", schedule, "--deallocate"]
    if v > 1:
        flags += ["--virtual-stages", str(v)]
    stdout = launch([sys.executable, str(step_dirs[step] / "train.py"), *flags], pp * dp, tmp_path, timeout=120)[0]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    tokens = dp * m * SEQ_LEN
    assert throughput_problem(records, stdout, tokens) is None, throughput_problem(records, stdout, tokens)
    one_replica = [dict(r, tokens_per_s=r["tokens_per_s"] / dp) for r in records]
    assert throughput_problem(one_replica, stdout, tokens) is not None
    # the printed report, row by row (control: a report read with each rank on the wrong stage must differ)
    assert not memory_report_problems(stdout, schedule, pp, dp, 1, m, v), memory_report_problems(stdout, schedule, pp,
                                                                                                 dp, 1, m, v)
    assert memory_report_problems(stdout, schedule, pp, dp, 1, m, v, grid=lambda r: r % pp)
    record = json.loads(log.read_text().splitlines()[-1])
    expected = [formulas.peak_stored(schedule, pp, rank // dp, m, v) for rank in range(pp * dp)]
    assert record["peak_stored_microbatches"] == expected
    assert all(b > 0 for b in record["peak_activation_bytes"])
    boxes = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    for rank in range(pp * dp):
        mine = [e for e in boxes if e["args"]["rank"] == rank and e["args"]["step"] == 1]  # step 0 is not traced
        syncs = [e for e in mine if e["cat"] == "allreduce"]
        last_backward = max(e["ts"] + e["dur"] for e in mine if e["cat"] in ("backward", "B", "W"))
        assert len(syncs) == 1 and syncs[0]["ts"] >= last_backward, (rank, syncs)

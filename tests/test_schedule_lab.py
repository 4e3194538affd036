"""Step 08's schedules as data (schedule_lab.py): PyTorch's notation read and written, lists checked,
every course schedule's dumped list run bitwise equal to its function, and the lab (tests/lab.py)."""
import json
import subprocess
import sys

import pytest

from harness import REPO, launch

STEP = "step08_dualpipe"
SMALL = ["--device", "cpu", "--pp", "2", "--microbatches", "4", "--batch-size", "8", "--layers", "4",
         "--hidden", "32", "--heads", "2", "--seq-len", "16", "--timeout", "60"]
COURSE = [["--schedule", "afab"], ["--schedule", "1f1b"], ["--schedule", "interleaved", "--virtual-stages", "2"],
          ["--schedule", "zb1p"], ["--schedule", "dualpipev"]]


@pytest.fixture(scope="module")
def lab(step_dirs):
    """The step's schedule_lab module, imported from its folder."""
    sys.path.insert(0, str(step_dirs[STEP]))
    import schedule_lab
    return schedule_lab


def test_torch_notation_reads_and_writes_back(lab, tmp_path):
    """PyTorch's cells, empty cells and communication actions included, read as computes; written back as PyTorch writes them."""
    path = tmp_path / "list.csv"
    path.write_text("0F0,,0SEND_F0,0I0,0W0,0REDUCE_GRAD\n1F0,1RECV_F0,2B3\n")
    plan = lab.read_schedule(str(path))
    assert [[str(a) for a in row] for row in plan] == [["0F0", "0I0", "0W0"], ["1F0", "2B3"]]
    lab.write_schedule(str(tmp_path / "out.csv"), plan)
    assert (tmp_path / "out.csv").read_text().splitlines() == ["0F0,0I0,0W0", "1F0,2B3"]


@pytest.mark.parametrize("cell", ["0X1", "F1", "0F", "zero"])
def test_an_unknown_action_is_named_with_its_rank(lab, cell):
    with pytest.raises(lab.ScheduleError, match=f"rank 1, action 0 '{cell}'"):
        lab.parse_rows([["0F0"], [cell]])


def one_f_one_b(lab):
    return lab.parse_rows([["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]])


def test_a_valid_list_has_no_problems_and_lowers(lab):
    plan = one_f_one_b(lab)
    assert lab.layout_problems(plan, 2, 2) == [] and lab.order_problems(plan, 2) == []
    lowered = lab.lower(plan)
    assert lowered[1][:2] == [("recv F", 1, 0), ("compute", lab.Action(1, "F", 0))]  # posted when stage 0 computes
    assert lab.ideal_idle(plan) == [3, 3]  # (p-1)(F+B), a full B taking B + W


def test_invalid_lists_are_named_by_rank_and_action(lab):
    plan = lab.parse_rows([["0F0", "0B1", "0F1", "0W0"], ["1F0", "1B0", "1F1", "1B1", "1B1"]])
    problems = lab.order_problems(plan, 2)
    assert "rank 0, action 1 0B1: before its 0F1" in problems
    assert "rank 0, action 3 0W0: before its 0I0" in problems
    assert "rank 1, action 4 1B1: runs twice" in problems
    assert lab.layout_problems(plan, 3, 2)[0] == "the list has 2 rows (ranks), but --pp is 3"
    bad_stage = lab.parse_rows([["0F0", "0B0"], ["5F0", "5B0"]])
    assert "rank 1, action 0 5F0: stage 5 does not exist" in lab.layout_problems(bad_stage, 2, 1)[0]


def test_a_deadlocking_list_names_where_each_rank_waits(lab):
    """Stage 0 waits for a gradient before it has sent the activation that would make it."""
    plan = lab.parse_rows([["0B0", "0F0"], ["1F0", "1B0"]])
    with pytest.raises(lab.ScheduleError, match="deadlock: rank 0 waits at 0B0; rank 1 waits at 1F0"):
        lab.lower(plan)


def test_each_course_schedule_runs_bitwise_as_a_list(step_dirs, tmp_path):
    """Each hand-written schedule's recorded list, run by the list runtime, gives bitwise its gradients;
    the same list on the next batch must not (control). One launch of two ranks for all five."""
    cases = [SMALL + c for c in COURSE]
    launch([sys.executable, str(REPO / "tests" / "check_lab_lists.py"), str(step_dirs[STEP]), str(tmp_path),
            json.dumps(cases)], 2, tmp_path, timeout=240)
    report = json.loads((tmp_path / "report.json").read_text())
    assert len(report) == len(COURSE) and all(rank == [True, True] for ranks in report.values() for rank in ranks), report

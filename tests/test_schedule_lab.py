"""Step 08's schedules as data (action_lists.py, schedule_lab.py): PyTorch's notation read and written, lists checked,
every course schedule's dumped list run bitwise equal to its function, and the lab (tests/lab.py)."""
import json
import sys
from fractions import Fraction
from pathlib import Path

import pytest

import harness
from exercises_design import one_at_a_time, one_f_one_b as one_f_one_b_plan
from harness import REPO, launch

STEP = "step08_dualpipe"
SMALL = ["--device", "cpu", "--pp", "2", "--microbatches", "4", "--batch-size", "8", "--layers", "4",
         "--hidden", "32", "--heads", "2", "--seq-len", "16", "--timeout", "60"]
COURSE = [["--schedule", "afab"], ["--schedule", "1f1b"], ["--schedule", "interleaved", "--virtual-stages", "2"],
          ["--schedule", "zb1p"], ["--schedule", "dualpipev"], ["--schedule", "zbv"], ["--schedule", "looped-bfs"]]


@pytest.fixture(scope="module")
def lab(step_dirs):
    """The step's schedule_lab module, imported from its folder."""
    sys.path.insert(0, str(step_dirs[STEP]))
    import schedule_lab
    return schedule_lab


@pytest.fixture(scope="module")
def lists(lab):
    """The step's action_lists module: the notation read, written and checked (its folder put first by `lab`)."""
    import action_lists
    return action_lists


def test_torch_notation_reads_and_writes_back(lists, tmp_path):
    """PyTorch's cells, empty cells and communication actions included, read as computes; written back as PyTorch writes them."""
    path = tmp_path / "list.csv"
    path.write_text("0F0,,0SEND_F0,0I0,0W0,0REDUCE_GRAD\n1F0,1RECV_F0,2B3\n")
    plan = lists.read_schedule(str(path))
    assert [[str(a) for a in row] for row in plan] == [["0F0", "0I0", "0W0"], ["1F0", "2B3"]]
    lists.write_schedule(str(tmp_path / "out.csv"), plan)
    assert (tmp_path / "out.csv").read_text().splitlines() == ["0F0,0I0,0W0", "1F0,2B3"]


@pytest.mark.parametrize("cell", ["0X1", "F1", "0F", "zero"])
def test_an_unknown_action_is_named_with_its_rank(lists, cell):
    with pytest.raises(lists.ScheduleError, match=f"rank 1, action 0 '{cell}'"):
        lists.parse_rows([["0F0"], [cell]])


def one_f_one_b(lists):
    return lists.parse_rows([["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]])


def test_a_valid_list_has_no_problems_and_lowers(lab, lists):
    plan = one_f_one_b(lists)
    assert lists.layout_problems(plan, 2, 2) == [] and lists.order_problems(plan, 2) == []
    lowered = lab.lower(plan)
    assert lowered[1][:2] == [("recv F", 1, 0), ("compute", lists.Action(1, "F", 0))]  # posted when stage 0 computes
    assert lab.ideal_idle(plan) == [3, 3]  # (p-1)(F+B), a full B taking B + W


def test_invalid_lists_are_named_by_rank_and_action(lists):
    plan = lists.parse_rows([["0F0", "0B1", "0F1", "0W0"], ["1F0", "1B0", "1F1", "1B1", "1B1"]])
    problems = lists.order_problems(plan, 2)
    assert "rank 0, action 1 0B1: before its 0F1" in problems
    assert "rank 0, action 3 0W0: before its 0I0" in problems
    assert "rank 1, action 4 1B1: runs twice" in problems
    assert lists.layout_problems(plan, 3, 2)[0] == "the list has 2 rows (ranks), but --pp is 3"
    bad_stage = lists.parse_rows([["0F0", "0B0"], ["5F0", "5B0"]])
    assert "rank 1, action 0 5F0: stage 5 does not exist" in lists.layout_problems(bad_stage, 2, 1)[0]


def test_a_deadlocking_list_names_where_each_rank_waits(lab, lists):
    """Stage 0 waits for a gradient before it has sent the activation that would make it."""
    plan = lists.parse_rows([["0B0", "0F0"], ["1F0", "1B0"]])
    with pytest.raises(lists.ScheduleError, match="deadlock: rank 0 waits at 0B0; rank 1 waits at 1F0"):
        lab.lower(plan)


def test_each_schedule_dumped_runs_back_bitwise(step_dirs, tmp_path):
    """For each schedule of the step that PyTorch's format holds (all but dualpipe and PipeDream's), the file
    `train.py --dump-schedule` writes, run back through --schedule-file, gives bitwise the gradients of the
    schedule's own function; the same list on the next batch must not (control). One launch of two ranks for
    all seven (tests/check_lab_lists.py)."""
    cases = [SMALL + c for c in COURSE]
    launch([sys.executable, str(REPO / "tests" / "check_lab_lists.py"), str(step_dirs[STEP]), str(tmp_path),
            json.dumps(cases)], 2, tmp_path, timeout=240)
    report = json.loads((tmp_path / "report.json").read_text())
    assert len(report) == len(COURSE) and all(rank == [True, True] for ranks in report.values() for rank in ranks), report


class MockStage:
    """What torch's schedules read of a stage to build their order: no model, no process group."""

    def __init__(self, index, n_stages, pp, rank):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, n_stages, pp, rank
        self.is_first, self.is_last, self.submod = index == 0, index == n_stages - 1, None


def torch_csv(path, kind, pp, m, virtual=1):
    """The CSV torch's own _dump_csv writes for one of its schedules (rank 0's object: every rank builds
    the whole order). Schedule1F1B is a single-stage schedule without _dump_csv: PipelineScheduleMulti's
    writes its pipeline_order."""
    from torch.distributed.pipelining import schedules
    stages = [MockStage(rank + c * pp, pp * virtual, pp, 0) for rank in (0,) for c in range(virtual)]
    schedule = getattr(schedules, kind)(stages[0] if kind == "Schedule1F1B" else stages, m)
    if kind == "Schedule1F1B":
        schedules.PipelineScheduleMulti._dump_csv(schedule, str(path))
    else:
        schedule._dump_csv(str(path), format="compute_only")
    return path


def run_lab(path, *flags):
    """tests/lab.py on the list at path; its drawing beside the list (not in a new temporary folder) unless flags
    name one."""
    png = [] if "--png" in flags else ["--png", str(Path(path).with_suffix(".png"))]
    return harness.run([sys.executable, str(REPO / "tests" / "lab.py"), str(path), *flags, *png],
                       capture_output=True, text=True, timeout=300, cwd=REPO)


@pytest.mark.parametrize("virtual", [1, 2])
def test_torch_interleaved_csv_passes_the_lab(tmp_path, virtual):
    """torch's ScheduleInterleaved1F1B, with one stage per rank (its 1F1B as a runtime list) and with two:
    its _dump_csv runs in the lab, the gloo run included, and passes."""
    path = torch_csv(tmp_path / f"interleaved{virtual}.csv", "ScheduleInterleaved1F1B", 4, 8, virtual)
    done = run_lab(path, "--pp", "4", "--microbatches", "8", "--png", str(tmp_path / "t.png"))
    assert done.returncode == 0 and "gloo run vs one device       pass" in done.stdout, done.stdout + done.stderr
    assert (tmp_path / "t.png").stat().st_size > 0


def test_torch_schedule_1f1b_csv_is_refused_naming_rank_and_action(tmp_path):
    """torch 2.13's Schedule1F1B._get_pipeline_order (the IR its _dump_csv would write) numbers the last rank's
    forwards from 1: its 3F8 does not exist, its 3F0 is missing. The lab refuses it in one line."""
    done = run_lab(torch_csv(tmp_path / "1f1b.csv", "Schedule1F1B", 4, 8), "--pp", "4", "--microbatches", "8")
    assert done.returncode == 2 and done.stdout == "", done.stdout
    assert "rank 3, action 14 3F8: microbatch 8 does not exist" in done.stderr, done.stderr


@pytest.mark.parametrize("rows, line", [
    ("0F0,0B1,0F1,0B0\n1F0,1B0,1F1,1B1\n", "rank 0, action 1 0B1: before its 0F1"),  # invalid
    ("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n", "deadlock: rank 0 waits at 0B0; rank 1 waits at 1F1"),
    ("0F0,0B0,0F1,0B1\n1F0,1B0,1F1,1B1\n", "rank 0: 0F2 is missing"),  # --microbatches 3: microbatch 2 never runs
])
def test_invalid_and_deadlocking_lists_fail_naming_rank_and_action(tmp_path, rows, line):
    """The lab's verdict on a list that is out of order, deadlocks, or never names a microbatch of
    --microbatches (a complete list of fewer microbatches would train on less than the batch)."""
    path = tmp_path / "list.csv"
    path.write_text(rows)
    m = "3" if "missing" in line else "2"
    done = run_lab(path, "--pp", "2", "--microbatches", m, "--no-run")
    assert done.returncode == 1 and line in done.stdout and "FAIL" in done.stdout, done.stdout + done.stderr


@pytest.fixture(scope="module")
def generators(lab):
    """The step's torch_schedules module (the lab fixture put its folder first on the path)."""
    import torch_schedules
    return torch_schedules


def write(lists, path, plan):
    """A list of (stage, kind, mb) per rank, as a CSV file."""
    lists.write_schedule(str(path), [[lists.Action(*a) for a in row] for row in plan])


def torch_order(kind, pp, m):
    """torch's own order, per rank, of ScheduleZBVZeroBubble (V placement), ScheduleLoopedBFS or
    ScheduleInterleaved1F1B (interleaved placement), two stages per rank."""
    from torch.distributed.pipelining import schedules
    cls = {"zbv": schedules.ScheduleZBVZeroBubble, "looped-bfs": schedules.ScheduleLoopedBFS,
           "interleaved": schedules.ScheduleInterleaved1F1B}[kind]
    order = []
    for rank in range(pp):
        second = 2 * pp - 1 - rank if kind == "zbv" else rank + pp
        built = cls([MockStage(rank, 2 * pp, pp, rank), MockStage(second, 2 * pp, pp, rank)], m)
        order.append([(a.stage_index, a.computation_type.value, a.microbatch_index)
                      for a in built.pipeline_order[rank] if a is not None])
    return order


@pytest.mark.parametrize("kind", ["zbv", "looped-bfs"])
def test_generators_build_torch_order(generators, kind):
    """Every p from 1 to 5 and m from 1 to 12: the generator's lists are torch's, action for action.
    Control: the other generator's lists are not."""
    other = {"zbv": "looped-bfs", "looped-bfs": "zbv"}[kind]
    for pp in range(1, 6):
        for m in range(1, 13):
            assert generators.GENERATORS[kind](pp, m) == torch_order(kind, pp, m), (kind, pp, m)
    assert generators.GENERATORS[other](4, 8) != torch_order(kind, 4, 8)


GRID = [Fraction(k, 4) for k in (1, 3, 4, 7, 10)]  # F, B, W: B > 2W, B = 2W, B < 2W, F > B and W > B all occur


@pytest.mark.parametrize("kind", ["zbv", "looped-bfs"])
def test_generators_idle_and_peak_as_their_formulas(lab, lists, generators, kind):
    """torch_schedules' formulas against the exact ideal timeline (schedule_lab.ideal_idle, pass times of one
    stage), for p 2..5, m on each side of each formula's rule, and F, B, W on a grid, wherever a formula claims to hold:
    ZB-V (m >= 2p-1, F <= B, W <= B) idles (p-1) max(B, 2(B-W)) on every rank and stores 2p (stage,
    microbatch) pairs; Looped BFS (m >= p) idles (p-1)(F+B+W) and stores 2m. Controls: each idle formula
    fails on the other schedule's lists, and (p-1)B alone fails ZB-V where B > 2W."""
    other = {"zbv": "looped-bfs", "looped-bfs": "zbv"}[kind]
    checked, control_caught, b_alone_caught = 0, False, False
    for pp in range(2, 6):
        for m in sorted({1, pp - 1, pp, 2 * pp - 2, 2 * pp - 1, 2 * pp, 3 * pp + 1} - {0}):  # each side of each rule
            plan, wrong = ([[lists.Action(*a) for a in row] for row in generators.GENERATORS[k](pp, m)]
                           for k in (kind, other))
            peak = generators.peak_formula(kind, pp, m)
            if peak:
                assert [lab.peak_stored(row) for row in plan] == [peak[1]] * pp, (pp, m)
            for times in ((f, b, w) for f in GRID for b in GRID for w in GRID):
                formula = generators.idle_formula(kind, pp, m, *times)
                if formula is None:
                    continue
                checked += 1
                assert lab.ideal_idle(plan, times) == [formula[1]] * pp, (pp, m, times)
                control_caught |= lab.ideal_idle(wrong, times) != [formula[1]] * pp
                b_alone_caught |= kind == "zbv" and lab.ideal_idle(plan, times) != [(pp - 1) * times[1]] * pp
    assert checked > 500 and control_caught and (b_alone_caught or kind != "zbv")


@pytest.mark.parametrize("kind", ["zbv", "looped-bfs"])
def test_generated_lists_train_bitwise_as_torch(step_dirs, tmp_path, kind):
    """--schedule zbv and --schedule looped-bfs, run by step 08's runtime, give bitwise the gradients of torch's
    own ScheduleZBVZeroBubble and ScheduleLoopedBFS on the same model, weights and batch (tests/torch_pp.py);
    control: torch on the next batch must differ (ZB-V)."""
    modes = ["grads", "control"] if kind == "zbv" else ["grads"]
    for mode in modes:
        out = tmp_path / f"{mode}.json"
        flags = ["--device", "cpu", "--schedule", kind, "--microbatches", "8", "--batch-size", "16",
                 "--layers", "8", "--hidden", "64", "--heads", "4", "--seq-len", "32", "--timeout", "60"]
        launch([sys.executable, str(REPO / "tests" / "torch_pp.py"), str(step_dirs[STEP]), mode, str(out), *flags],
               2, tmp_path / mode, timeout=120)
        bitwise = [rank["bitwise"] for rank in json.loads(out.read_text())["ranks"]]
        assert bitwise == ([True, True] if mode == "grads" else [False, False]), (mode, bitwise)


@pytest.mark.parametrize("name, meets, misses, m", [
    ("stage0-two", lambda: one_f_one_b_plan(4, 8, lambda s: min(4 - s - 1, 1)),
     lambda: one_f_one_b_plan(4, 8, lambda s: 4 - s - 1), 8),
    ("beat-1f1b", lambda: one_f_one_b_plan(4, 8, lambda s: 4 - s - 1, split=True),
     lambda: one_f_one_b_plan(4, 8, lambda s: 4 - s - 1), 8),
    ("interleaved-m6", lambda: torch_order("interleaved", 4, 6), lambda: one_at_a_time(4, 6), 6),
])
def test_challenges_are_graded(lists, tmp_path, name, meets, misses, m):
    """Each challenge passes a list that meets it and fails one that does not (1F1B itself, for the first two)."""
    for plan, expected in ((meets(), 0), (misses(), 1)):
        path = tmp_path / f"{expected}.csv"
        write(lists, path, plan)
        done = run_lab(path, "--pp", "4", "--microbatches", str(m), "--no-run", "--challenge", name)
        assert done.returncode == expected and f"challenge {name}" in done.stdout, done.stdout + done.stderr



def test_the_catalogues_interleaved_m6_answer_is_torchs_order():
    """The right answer tests/exercises_design.py gives for interleaved-m6 is torch's ScheduleInterleaved1F1B at
    p 4, m 6, action for action. Control: torch's order at m 4 is not it."""
    from exercises_design import TORCH_INTERLEAVED_4_6, csv_text
    assert csv_text(torch_order("interleaved", 4, 6)) == TORCH_INTERLEAVED_4_6
    assert csv_text(torch_order("interleaved", 4, 4)) != TORCH_INTERLEAVED_4_6

"""Checkpoints (checkpoint.py, step 03 on): a resumed run continues bitwise, a checkpoint loads into another
layout, a crash in the middle of a save leaves the previous checkpoint loadable, bad inputs are refused.

Each launch runs several train.py runs in one process group (tests/check_checkpoints.py): a run of 6 steps
that saves at steps 3 and 6, then runs that resume from a copy of its step-3 checkpoint. The checkpoints
themselves are the evidence: the one an uninterrupted run saved after step 6 and the one the resumed run
saved after step 6 are read back here with DCP (no course module is imported) and compared tensor by
tensor, bitwise: weights (step 07: the fp32 masters), AdamW's moments and step counts, and the facts
(step, shape; step 07: the loss scaler). The losses come from --log-json, the gradients of the first
resumed step from the worker's records (TP shards put back together)."""
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from checkpoint_inputs import SMALL, bad_inputs, damage, parse_as_rank_0, step_name, taken_inputs
from harness import REPO, RunFailed, launch

WORKER = REPO / "tests" / "check_checkpoints.py"
RESHARD_RTOL = 1e-6


class Plan:
    """The cases of one launch, and where each writes."""

    def __init__(self, out: Path):
        self.out, self.cases = out, []

    def run(self, name, *flags, steps=6, every=3, grads_at=None, resume=None, resume_in=None, **hooks):
        """A train.py run saving into out/name (every `every` steps) and logging into out/name.jsonl; it
        resumes from a copy of out/<resume>'s step-3 checkpoint, its log out/name.jsonl holding out/<resume>.jsonl's
        lines before step 5 and half of step 5's (that run went on past its checkpoint, then stopped writing), or
        from out/<resume_in> itself."""
        case = dict(flags=[*SMALL, *flags, "--steps", str(steps), "--save", str(self.out / name),
                           "--save-every", str(every), "--log-json", str(self.out / f"{name}.jsonl")], name=name,
                    **hooks)
        if resume:  # the checkpoint and log of a run that saved step 3, trained steps 3-5, and died writing 5's record
            case["copy"] = [str(self.out / resume / step_name(3)), str(self.out / name / step_name(3))]
            case["log_head"] = [str(self.out / f"{resume}.jsonl"), str(self.out / f"{name}.jsonl"), 5]
        if resume or resume_in:
            case["flags"] += ["--resume", str(self.out / (resume_in or name))]
        if grads_at is not None:
            case["grads"] = [grads_at, str(self.out / f"{name}.grads")]
        self.cases.append(case)

    def launch(self, step_dir, world, expect_failure=False):
        cmd = [sys.executable, str(WORKER), str(step_dir), str(self.out), json.dumps(self.cases)]
        try:
            launch(cmd, world, self.out / f"launch{world}_{self.cases[0]['name']}", timeout=240)
        except RunFailed as failed:
            if not expect_failure:
                pytest.fail(str(failed), pytrace=False)
            return
        assert not expect_failure, "the launch was to end with a killed rank, and ended normally"


def read_checkpoint(path: Path) -> dict:
    """Every entry of a checkpoint, whole, read in this process from DCP's index."""
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) if isinstance(m, TensorStorageMetadata) else None
             for k, m in meta.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP says it loads in a single process: it does
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def checkpoint_differences(a: Path, b: Path) -> list:
    """Where two checkpoints differ: missing entries, or any bit of any tensor or fact."""
    x, y = read_checkpoint(a), read_checkpoint(b)
    problems = [f"{k} only in {a.name if k in x else b.name}" for k in sorted(set(x) ^ set(y))]
    for k in sorted(set(x) & set(y)):
        same = torch.equal(bits(x[k]), bits(y[k])) if isinstance(x[k], torch.Tensor) else x[k] == y[k]
        if not same:
            problems.append(f"{k} differs")
    return problems


def records(path: Path) -> list:
    """The step records of a --log-json file, in its order."""
    return [r for r in map(json.loads, path.read_text().splitlines()) if isinstance(r, dict) and "step" in r]


def losses(path: Path) -> dict:
    return {r["step"]: r["loss"] for r in records(path)}


def whole_grads(case_dir: Path) -> dict:
    """The first replica's gradients, TP shards put back together along their split dimension."""
    shards = {}
    for f in sorted(case_dir.glob("rank*.pt")):
        got = torch.load(f)
        if got["dp_rank"] == 0:
            for name, (grad, dim) in got["grads"].items():
                shards.setdefault(name, []).append((got["tp_rank"], grad, dim))
    whole = {}
    for name, parts in shards.items():
        parts.sort(key=lambda p: p[0])
        dim = parts[0][2]
        whole[name] = parts[0][1] if dim is None else torch.cat([p[1] for p in parts], dim)
    return whole


def grad_differences(a: Path, b: Path, rtol: float) -> list:
    """Gradients of the same step in two cases: the same names, equal bitwise (rtol 0) or within rtol."""
    x, y = whole_grads(a), whole_grads(b)
    problems = [f"{k}: gradient only in {a.name if k in x else b.name}" for k in sorted(set(x) ^ set(y))]
    for k in sorted(set(x) & set(y)):
        err = ((x[k] - y[k]).norm() / y[k].norm().clamp_min(1e-12)).item()
        if (not torch.equal(x[k], y[k])) if rtol == 0 else err > rtol:
            problems.append(f"{k}: gradient differs, relative error {err:.1e}")
    return problems


def bitwise_resume_problems(out: Path, straight: str, resumed: str) -> list:
    """The resumed run against the uninterrupted one: its log (the earlier run's lines before step 3 as they
    were, then steps 3, 4, 5), its losses, then its final checkpoint, bitwise."""
    mine, theirs = losses(out / f"{resumed}.jsonl"), losses(out / f"{straight}.jsonl")
    steps, lines = [r["step"] for r in records(out / f"{resumed}.jsonl")], (out / f"{straight}.jsonl").read_text()
    problems = [] if steps == list(range(6)) else [f"{resumed}'s log holds steps {steps}, not 0 to 5: the earlier "
                                                   "run's records before the checkpoint, then the resumed run's"]
    if not (out / f"{resumed}.jsonl").read_text().startswith("".join(lines.splitlines(True)[:3])):
        problems.append(f"{resumed}'s log does not begin with the earlier run's lines of steps 0-2, as they were")
    problems += [f"{resumed}: loss at step {s} is {v!r}, uninterrupted {theirs[s]!r}" for s, v in mine.items()
                 if v != theirs.get(s)]
    return problems + checkpoint_differences(out / straight / step_name(6), out / resumed / step_name(6))


def reshard_problems(out: Path, source: str, target: str, rtol: float) -> list:
    """The run resumed in another layout: its first loss and gradients (step 3) against the uninterrupted
    run's, bitwise (rtol 0) or within rtol."""
    mine, theirs = losses(out / f"{target}.jsonl"), losses(out / f"{source}.jsonl")
    problems = [] if mine[3] == theirs[3] or abs(mine[3] - theirs[3]) <= rtol * abs(theirs[3]) else \
        [f"{target}: loss at step 3 is {mine[3]!r}, uninterrupted {source} {theirs[3]!r}"]
    return problems + grad_differences(out / f"{target}.grads", out / f"{source}.grads", rtol)


# Per step: the launches (world size, runs), in order. Run names are folders and logs under the step's out.
# A run named in RESUME resumed from a copy of another's step-3 checkpoint in the same layout, and must
# end bitwise where that run ended; a run in RESHARD resumed in another layout.
def launches(step: str, plan):
    """Fill `plan(world)` (a Plan per launch) with this step's runs; returns [(world, Plan, must fail)]."""
    done = []

    def new(world, fail=False):
        done.append((world, plan(world), fail))
        return done[-1][1]

    if step == "step03_afab":
        two = new(2)
        two.run("a", "--pp", "2", grads_at=3)
        two.run("a_resumed", "--pp", "2", resume="a")
        two.run("control", "--pp", "2", resume="a", no_optimizer=True)
        new(2, fail=True).run("crash", "--pp", "2", every=2, die_saving=2)
        new(2, fail=True).run("full", "--pp", "2", every=2, full_saving=2)
        one = new(1)
        one.run("after_crash", "--pp", "1", steps=3, resume_in="crash")
        one.run("one", "--pp", "1", steps=4, resume="a", grads_at=3)
    elif step == "step04_1f1b":
        four = new(4)
        four.run("a", "--pp", "2", "--dp", "2", grads_at=3)
        four.run("a_resumed", "--pp", "2", "--dp", "2", resume="a")
        four.run("pp4", "--pp", "4", steps=4, resume="a", grads_at=3)
    elif step == "step05_interleaved":
        four = new(4)
        four.run("a", "--pp", "4", "--layers", "8", grads_at=3)
        four.run("a_resumed", "--pp", "4", "--layers", "8", resume="a")
        four.run("v2", "--pp", "4", "--layers", "8", "--virtual-stages", "2", steps=4, resume="a", grads_at=3)
        two = new(2)
        two.run("pp2", "--pp", "2", "--layers", "8", steps=4, resume="a", grads_at=3)
        two.run("b", "--pp", "2", "--layers", "8", "--virtual-stages", "2")
        two.run("b_resumed", "--pp", "2", "--layers", "8", "--virtual-stages", "2", resume="b")
    elif step == "step06_tp":
        four = new(4)
        four.run("a", "--tp", "2", "--pp", "2", grads_at=3)
        four.run("a_resumed", "--tp", "2", "--pp", "2", resume="a")
        four.run("pp4", "--tp", "1", "--pp", "4", steps=4, resume="a", grads_at=3)
        four.run("tied", "--tp", "2", "--pp", "2", "--tie-embeddings")
        four.run("tied_resumed", "--tp", "2", "--pp", "2", "--tie-embeddings", resume="tied")
        new(1).run("one", "--tp", "1", "--pp", "1", steps=4, resume="a", grads_at=3)
    elif step == "step07_mixed_precision":
        two = new(2)
        for name, precision in (("a", "fp16"), ("b", "bf16")):
            two.run(name, "--pp", "2", "--precision", precision)
            two.run(f"{name}_resumed", "--pp", "2", "--precision", precision, resume=name)
    elif step == "step08_dualpipe":
        two = new(2)
        for name, schedule in (("a", "zb1p"), ("b", "dualpipev"), ("c", "dualpipe")):
            two.run(name, "--pp", "2", "--schedule", schedule)
            two.run(f"{name}_resumed", "--pp", "2", "--schedule", schedule, resume=name)
    return done


RESUME = {"step03_afab": [("a", "a_resumed")], "step04_1f1b": [("a", "a_resumed")],
          "step05_interleaved": [("a", "a_resumed"), ("b", "b_resumed")],
          "step06_tp": [("a", "a_resumed"), ("tied", "tied_resumed")],
          "step07_mixed_precision": [("a", "a_resumed"), ("b", "b_resumed")],
          "step08_dualpipe": [("a", "a_resumed"), ("b", "b_resumed"), ("c", "c_resumed")]}
DP_ORDER = ("pp 2 x dp 2 sums 4 microbatches of 1 sequence on each replica, then averages the 2 replicas; "
            "pp 4 sums 4 microbatches of 2 sequences: another order of the same sum")
TP_ORDER = ("at tp 2 each row-parallel layer (wo, down) and the vocabulary-parallel loss sum 2 ranks' partial "
            "results in an all-reduce, at tp 1 one matrix product sums them: another order of the same sum")
RESHARD = {  # (source, target, rtol, why not bitwise)
    "step03_afab": [("a", "one", 0, "")],
    "step04_1f1b": [("a", "pp4", RESHARD_RTOL, DP_ORDER)],
    "step05_interleaved": [("a", "v2", 0, ""), ("a", "pp2", 0, "")],
    "step06_tp": [("a", target, RESHARD_RTOL, TP_ORDER) for target in ("pp4", "one")],
}


@pytest.fixture(scope="module")
def checkpoint_runs(step_dirs, tmp_path_factory):
    """run(step) -> the folder of that step's runs, all launched once."""
    cache = {}

    def run(step):
        if step not in cache:
            out = tmp_path_factory.mktemp(step)
            cache[step] = None
            for world, plan, fail in launches(step, lambda world: Plan(out)):
                plan.launch(step_dirs[step], world, expect_failure=fail)
            cache[step] = out
        if cache[step] is None:
            pytest.fail(f"{step}: a launch failed (see the first test that ran it)", pytrace=False)
        return cache[step]

    return run


@pytest.mark.parametrize("step, straight, resumed", [(s, a, b) for s, pairs in RESUME.items() for a, b in pairs])
def test_resume_is_bitwise(step, straight, resumed, checkpoint_runs):
    """3 steps, save, a new run that resumes, 3 steps: the losses of steps 3-5 and the checkpoint after step 6
    (weights, AdamW's moments and step counts, the facts) are bitwise those of 6 uninterrupted steps."""
    problems = bitwise_resume_problems(checkpoint_runs(step), straight, resumed)
    assert not problems, "\n".join(problems[:20])


def test_control_a_checkpoint_without_optimizer_state_fails_the_check(checkpoint_runs):
    """Control: the same resume with the optimizer state left out of the save and the load (AdamW starts
    afresh at step 3) must fail the bitwise check, on the losses and on the moments."""
    problems = bitwise_resume_problems(checkpoint_runs("step03_afab"), "a", "control")
    assert any("loss at step 4" in p for p in problems), problems
    assert any(p.startswith("optimizer.") and "exp_avg" in p for p in problems), problems


def test_control_a_log_that_repeats_steps_fails_the_check(checkpoint_runs, tmp_path):
    """Control: the resumed run's log with the earlier run's records of steps 3 and 4 kept before its own (what
    appending the whole earlier log would leave) must fail the bitwise check, on the steps the log holds."""
    out = checkpoint_runs("step03_afab")
    for name in ("a", "a_resumed"):
        (tmp_path / name).symlink_to(out / name)
    (tmp_path / "a.jsonl").write_text((out / "a.jsonl").read_text())
    earlier, resumed = (out / "a.jsonl").read_text().splitlines(True), (out / "a_resumed.jsonl").read_text()
    (tmp_path / "a_resumed.jsonl").write_text("".join(earlier[:5]) + resumed[len("".join(earlier[:3])):])
    problems = bitwise_resume_problems(tmp_path, "a", "a_resumed")
    assert problems == ["a_resumed's log holds steps [0, 1, 2, 3, 4, 3, 4, 5], not 0 to 5: the earlier run's records "
                        "before the checkpoint, then the resumed run's"], problems


@pytest.mark.parametrize("step, source, target, rtol, why",
                         [pytest.param(s, *pair, id=f"{s}:{pair[0]}->{pair[1]}") for s, pairs in RESHARD.items()
                          for pair in pairs])
def test_a_checkpoint_loads_into_another_layout(step, source, target, rtol, why, checkpoint_runs):
    """A run resumed from another layout's step-3 checkpoint: its step-3 loss and gradients equal those of
    the uninterrupted run (bitwise where the summation order is the same; else within rtol, for `why`)."""
    problems = reshard_problems(checkpoint_runs(step), source, target, rtol)
    assert not problems, "\n".join(problems[:20])


def test_a_crash_during_a_save_leaves_the_previous_checkpoint(checkpoint_runs):
    """Rank 1 killed in the save after step 4, once its own file was written: the folder keeps the
    complete step-2 checkpoint and the unfinished step-4 one under .tmp; --resume takes step 2, and its
    next loss is the uninterrupted run's."""
    out = checkpoint_runs("step03_afab")
    assert (out / "crash" / f"{step_name(4)}.tmp").is_dir() and not (out / "crash" / step_name(4)).exists()
    assert sorted(losses(out / "after_crash.jsonl")) == [2], losses(out / "after_crash.jsonl")
    assert losses(out / "after_crash.jsonl")[2] == losses(out / "a.jsonl")[2]


def test_a_failed_save_stops_the_run_with_one_line(checkpoint_runs):
    """Rank 1's file of the save after step 4 cannot be written (OSError ENOSPC, as on a full disk): every rank
    exits with code 1, and the one `error:` line, rank 0's, names the folder, the OS error and the last
    checkpoint (step 2), which is left complete; no traceback. The control: rank 0's log of the run that saved
    both checkpoints holds no such line."""
    out = checkpoint_runs("step03_afab")
    logs = [(out / "launch2_full" / f"rank{r}.log").read_text() for r in range(2)]
    errors = [line for log in logs for line in log.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0] in logs[0], errors
    for text in (f"step 4 cannot be saved into {out / 'full'}", "No space left on device",
                 f"the last checkpoint is {out / 'full' / step_name(2)}"):
        assert text in errors[0], (text, errors[0])
    assert "Traceback" not in logs[0] + logs[1], logs[0][-2000:] + logs[1][-2000:]
    assert (out / "full" / step_name(2) / "record.json").is_file() and not (out / "full" / step_name(4)).exists()
    assert "error: " not in (out / "launch2_a" / "rank0.log").read_text()


@pytest.mark.parametrize("step", ["step03_afab", "step04_1f1b", "step07_mixed_precision"])
def test_bad_checkpoint_flags_are_refused_with_one_line(step, step_dirs, checkpoint_runs):
    """Each bad --save, --save-every, --keep or --resume ends train.parse_args (rank 0 of 1, before any
    process group) with exit code 2 and one `error:` line naming it (tests/check_bad_flags.py); in step 07,
    also a checkpoint that step 03 saved, which lacks the facts later steps record."""
    out = checkpoint_runs(step)
    cases = bad_inputs(out, step, checkpoint_runs("step03_afab"))
    problems = [f"{' '.join(flags[len(SMALL):])}: exit {found['exit_code']}, {found['last_line']!r}"
                for (flags, texts), found in zip(cases, parse_as_rank_0(step_dirs[step], out, cases))
                if found["exit_code"] != 2 or not found["last_line"].startswith("error: ")
                or not all(t in found["last_line"] for t in texts)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("step", ["step03_afab", "step07_mixed_precision"])
def test_resume_takes_the_newest_checkpoint_that_passes_its_check(step, step_dirs, checkpoint_runs):
    """--resume DIR takes the newest checkpoint whose files match record.json and says in one line which, and
    why it skipped a newer one (cut short, a file missing, a bit flipped: the same length, another CRC-32);
    DIR/stepNNNNNNNN takes that one, DIR/stepNNNNNNNN/ too; a checkpoint without record.json (an older save)
    is taken unchecked. The control: an intact DIR gives its newest."""
    out = checkpoint_runs(step)
    damage(out)
    cases = taken_inputs(out)
    problems = [f"{' '.join(flags[len(SMALL):])}: exit {found['exit_code']}, {found['last_line']!r}, printed "
                f"{found['printed']!r}" for (flags, texts), found in zip(cases, parse_as_rank_0(step_dirs[step], out,
                                                                                                cases))
                if found["exit_code"] is not None or not all(t in found["printed"] for t in texts)]
    assert not problems, "\n".join(problems)


def test_dualpipe_saves_each_stage_once(checkpoint_runs):
    """DualPipe holds every stage on two ranks (the reverse-direction copy marked `shared`): its checkpoint's
    files hold each tensor once, about the bytes of the entries DCP's index lists, not twice that."""
    folder = checkpoint_runs("step08_dualpipe") / "c" / step_name(6)
    meta = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    entries = sum(m.size.numel() * m.properties.dtype.itemsize for m in meta.values()
                  if isinstance(m, TensorStorageMetadata))
    written = sum(f.stat().st_size for f in folder.glob("*.distcp"))
    assert entries <= written < 1.5 * entries, (entries, written)

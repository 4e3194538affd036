"""train.py as a user runs it: default flags on several ranks, and bad flags that must fail fast (torchrun
itself: tests/test_refusals.py; a stalled or dead rank: tests/test_faults.py).

The training runs start their ranks with the environment torchrun gives them (harness.launch)."""
import json
import os
import re
import sys

import pytest
import torch

from conftest import STEPS
import harness
from harness import REPO, RunFailed, launch, memory_report_problems, throughput_problem

SMOKE_STEPS = 4
DEFAULT_M = 4  # --microbatches' default from step 02 on (step02_gpipe/README.md, its flags)
DEFAULT_BATCH, DEFAULT_SEQ_LEN = 8, 128  # --batch-size and --seq-len's defaults (step01_naive/README.md, its flags)


def read_log(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def train_py(step_dir, world: int, *flags: str, out):
    """What rank 0 printed running `train.py --device cpu flags` on `world` ranks (on the CPU, also where GPUs
    are: the CUDA tier is tests/test_cuda.py); fails the test with the failed rank's output."""
    try:
        return launch([sys.executable, str(step_dir / "train.py"), "--device", "cpu", *flags], world, out,
                      timeout=180)[0]
    except RunFailed as failed:
        pytest.fail(str(failed), pytrace=False)


@pytest.fixture(scope="module")
def four_stage_run(step_dirs, tmp_path_factory, replay_passes):
    """run(step) -> (what rank 0 printed, log path, trace path) of a default 4-rank run, made once per step."""
    cache = {}

    def run(step):
        replay_passes(step, "1f1b")  # the default; a schedule the replay rejects would only hang here
        if step not in cache:
            out = tmp_path_factory.mktemp(step)
            log, trace = out / "log.jsonl", out / "trace.json"
            cache[step] = None  # a failed run fails this test, and the next that asks at once
            stdout = train_py(step_dirs[step], 4, "--steps", str(SMOKE_STEPS), "--log-json", str(log),
                              "--trace", str(trace), out=out)
            cache[step] = stdout, log, trace
        if cache[step] is None:
            pytest.fail(f"{step}: the default 4-rank run failed (see the first test that ran it)", pytrace=False)
        return cache[step]

    return run


@pytest.mark.parametrize("step", STEPS)
def test_default_run_learns_and_writes_log_and_trace(step, four_stage_run):
    stdout, log, trace = four_stage_run(step)
    assert "bubble" in stdout and "formula" in stdout

    records = read_log(log)
    assert [r["step"] for r in records] == list(range(SMOKE_STEPS))
    for r in records:
        assert {"loss", "step_time_s", "tokens_per_s"} <= r.keys()
        assert r["step_time_s"] > 0 and r["tokens_per_s"] > 0
    # The peaks are gathered once, after training, into the last step's record.
    assert len(records[-1]["peak_mem_bytes"]) == 4 and all("peak_mem_bytes" not in r for r in records[:-1])
    assert records[-1]["loss"] < records[0]["loss"], [r["loss"] for r in records]

    events = json.loads(trace.read_text())["traceEvents"]
    recorded = {e["args"]["step"] for e in events if e["ph"] == "X"}
    assert recorded == set(range(1, SMOKE_STEPS)), "the timeline records every step but the first"
    for rank in range(4):
        kinds = [e["cat"] for e in events if e.get("tid") == rank + 1 and e["ph"] == "X"]
        assert kinds.count("forward") >= len(recorded) and kinds.count("backward") >= len(recorded), (rank, kinds)
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in events if e["ph"] == "X")


@pytest.mark.parametrize("step", STEPS)
def test_throughput_counts_tokens_per_second(step, four_stage_run):
    """tokens_per_s in the log and in the step line is --batch-size x --seq-len tokens over the step's logged
    time. Control: sequences per second (seq_len times too low), in the log or in the line, fails."""
    stdout, log, _ = four_stage_run(step)
    records = read_log(log)
    tokens = DEFAULT_BATCH * DEFAULT_SEQ_LEN
    assert throughput_problem(records, stdout, tokens) is None, throughput_problem(records, stdout, tokens)
    sequences = [dict(r, tokens_per_s=DEFAULT_BATCH / r["step_time_s"]) for r in records]
    assert throughput_problem(sequences, stdout, tokens) is not None
    per_sequence = re.sub(r"(\d+) tokens/s", lambda m: f"{int(m[1]) / DEFAULT_SEQ_LEN:.0f} tokens/s", stdout)
    assert throughput_problem(records, per_sequence, tokens) is not None


@pytest.mark.parametrize("step", STEPS)
def test_one_process_follows_the_losses_of_four_stages(step, step_dirs, four_stage_run, tmp_path):
    """The default model and data on one process (--pp 1) and on four stages: the same loss trajectory."""
    _, pipelined_log, _ = four_stage_run(step)
    train_py(step_dirs[step], 1, "--steps", str(SMOKE_STEPS), "--log-json", str(tmp_path / "log.jsonl"), out=tmp_path)
    losses = [r["loss"] for r in read_log(tmp_path / "log.jsonl")]
    assert losses == pytest.approx([r["loss"] for r in read_log(pipelined_log)], rel=1e-5, abs=0)


TP_STEPS = [s for s in STEPS if s >= "step06"]


@pytest.mark.parametrize("step", TP_STEPS)
def test_tensor_parallel_grid_follows_the_losses_of_four_stages(step, step_dirs, four_stage_run, tmp_path):
    """train.py --tp 2 --pp 2 on 4 ranks, with no other flags: the same losses as four stages, and a memory
    report whose row for each rank is its own stage's formula."""
    _, pipelined_log, _ = four_stage_run(step)
    stdout = train_py(step_dirs[step], 4, "--tp", "2", "--pp", "2", "--steps", str(SMOKE_STEPS),
                      "--log-json", str(tmp_path / "log.jsonl"), out=tmp_path)
    assert "(stage 1, dp 0, tp 1)" in stdout, "the report names each rank's place in the grid"
    # the memory report, row by row: ranks 0-1 are stage 0, ranks 2-3 stage 1 (control: TP slowest must differ)
    problems = memory_report_problems(stdout, "1f1b", 2, 1, 2, DEFAULT_M)
    assert not problems, problems
    assert memory_report_problems(stdout, "1f1b", 2, 1, 2, DEFAULT_M, grid=lambda r: r % 2)
    losses = [r["loss"] for r in read_log(tmp_path / "log.jsonl")]
    assert losses == pytest.approx([r["loss"] for r in read_log(pipelined_log)], rel=1e-5, abs=0)


def bad(steps, world, flags, *expected):
    return [pytest.param(step, world, flags, expected, id=f"{step}:{' '.join(flags)}") for step in steps]


LATER = [s for s in STEPS if s >= "step02"]  # steps with microbatches
WITH_DP = [s for s in STEPS if s >= "step03"]
CASES = [
    *bad(STEPS, 4, ["--pp", "2"], "--pp 2", "world size 4"),
    *bad(STEPS, 4, ["--layers", "3"], "--pp 4", "--layers 3"),
    *bad(STEPS, 1, ["--device", "tpu"], "--device tpu", "auto, cpu or cuda"),
    *bad(STEPS, 1, ["--hidden", "100", "--heads", "3"], "--hidden 100", "--heads 3"),
    *bad(STEPS, 1, ["--data", "/no/such/file"], "--data /no/such/file", "does not exist"),
    *bad(STEPS, 1, ["--steps", "0"], "--steps 0", "must be positive"),
    *bad(STEPS, 1, ["--lr", "-1"], "--lr -1.0", "must be positive"),
    *bad(STEPS, 1, ["--lr", "nan"], "--lr nan", "must be positive"),
    *bad(STEPS, 1, ["--lr", "inf"], "--lr inf", "finite"),
    *bad(STEPS, 1, ["--timeout", "0"], "--timeout 0.0", "must be positive"),
    *bad(STEPS, 1, ["--trace", "/no/such/folder/trace.json"], "--trace", "/no/such/folder", "does not exist"),
    *bad(STEPS, 1, ["--log-json", "/no/such/folder/log.jsonl"], "--log-json", "/no/such/folder", "does not exist"),
    *bad(STEPS, 1, ["--seq-len", "5000000"], "the default corpus", "--seq-len 5000000"),
    *bad(LATER, 2, ["--batch-size", "6", "--microbatches", "4"], "--batch-size 6", "--microbatches 4"),
    *bad(WITH_DP, 4, ["--pp", "2", "--dp", "2", "--batch-size", "6", "--microbatches", "2"],
         "--batch-size 6", "--dp 2", "--microbatches 2"),
    *bad(WITH_DP, 4, ["--pp", "3", "--dp", "2"], "--pp 3", "--dp 2", "world size 4"),
]
INTERLEAVED = [s for s in STEPS if s >= "step05"]
CASES += [
    *bad(INTERLEAVED, 4, ["--virtual-stages", "2", "--microbatches", "6", "--batch-size", "12"],
         "--microbatches 6", "multiple of --pp 4", "interleaved"),
    *bad(INTERLEAVED, 4, ["--virtual-stages", "3", "--layers", "8"], "--pp 4", "--virtual-stages 3", "--layers 8"),
    *bad(INTERLEAVED, 2, ["--virtual-stages", "2", "--p2p", "even"], "--p2p even", "batched or ordered"),
    *bad(INTERLEAVED, 2, ["--virtual-stages", "2", "--schedule", "afab"], "--virtual-stages 2", "--schedule afab"),
]
CASES += [
    *bad(TP_STEPS, 3, ["--tp", "3"], "--tp 3", "--heads 4"),
    *bad(TP_STEPS, 16, ["--tp", "16", "--heads", "16"], "--tp 16", "the MLP width 344"),
    *bad(TP_STEPS, 6, ["--tp", "6", "--heads", "6", "--hidden", "72"], "--tp 6", "the vocabulary size 256"),
    *bad(TP_STEPS, 4, ["--tp", "2", "--pp", "3"], "--tp 2 x --pp 3 x --dp 1 = 6", "world size 4"),
    *bad(TP_STEPS, 4, ["--tp", "0"], "--tp 0", "must be positive"),
]
MP_STEPS = [s for s in STEPS if s >= "step07"]
CASES += [
    *bad(MP_STEPS, 1, ["--precision", "fp8"], "--precision fp8", "unknown", "fp32, bf16, fp16"),
    *bad(MP_STEPS, 1, ["--precision", "fp16", "--loss-scale", "0"], "--loss-scale 0.0", "must be positive"),
    *bad(MP_STEPS, 1, ["--precision", "fp16", "--loss-scale-window", "0"], "--loss-scale-window 0", "at least 1"),
    *bad(MP_STEPS, 1, ["--initial-loss-scale", "-1"], "--initial-loss-scale -1.0"),
    *bad(MP_STEPS, 1, ["--precision", "fp16", "--min-loss-scale", "1e-39"], "--min-loss-scale 1e-39",
         "1.18e-38 <= min", "fp32's smallest normal", "inf below 2.94e-39"),
    *bad(MP_STEPS, 1, ["--clip-grad", "-1"], "--clip-grad -1.0"),
]
PIPEDREAM_STEPS = [s for s in STEPS if s >= "step04"]
CASES += [
    *bad(PIPEDREAM_STEPS, 2, ["--vertical-sync"], "--vertical-sync", "--schedule pipedream", "not 1f1b"),
    *bad(PIPEDREAM_STEPS, 2, ["--schedule", "pipedream", "--vertical-sync", "--no-weight-stashing"],
         "--vertical-sync", "only weight stashing keeps", "--no-weight-stashing"),
    *bad(PIPEDREAM_STEPS, 2, ["--schedule", "pipedream-2bw", "--no-weight-stashing"], "--no-weight-stashing",
         "not pipedream-2bw"),
    *bad(PIPEDREAM_STEPS, 4, ["--schedule", "pipedream", "--steps", "1", "--microbatches", "4"],
         "--steps 1 x --microbatches 4 = 4", "at least 2 x (--pp 4 - 1) = 6"),
    *bad(PIPEDREAM_STEPS, 4, ["--schedule", "pipedream-2bw", "--microbatches", "2"], "--microbatches 2",
         "at least --pp 4 - 1", "pipedream-2bw"),
    *bad(INTERLEAVED, 2, ["--schedule", "pipedream", "--virtual-stages", "2"], "--virtual-stages 2",
         "--schedule pipedream"),
    *bad(TP_STEPS, 2, ["--schedule", "pipedream", "--tie-embeddings"], "--tie-embeddings", "--pp 2",
         "--schedule pipedream", "update at different times"),
    *bad(MP_STEPS, 2, ["--schedule", "pipedream", "--precision", "bf16"], "--precision bf16", "pipedream",
         "fp32"),
    *bad(MP_STEPS, 2, ["--schedule", "pipedream-2bw", "--clip-grad", "1"], "--clip-grad 1.0", "pipedream-2bw"),
    *bad(MP_STEPS, 2, ["--schedule", "pipedream", "--loss-scale", "8"], "--loss-scale 8.0", "pipedream",
         "no loss scale"),
]
ZB_STEPS = [s for s in STEPS if s >= "step08"]
CASES += [
    *bad(ZB_STEPS, 4, ["--schedule", "zb1p", "--microbatches", "2", "--batch-size", "8"], "--microbatches 2",
         "at least --pp 4", "zb1p"),
    *bad(ZB_STEPS, 2, ["--schedule", "zb1p", "--p2p", "ordered"], "--p2p ordered", "zb1p", "batched"),
    *bad(ZB_STEPS, 3, ["--schedule", "dualpipe", "--microbatches", "6", "--batch-size", "6", "--layers", "3"],
         "--pp 3", "even", "dualpipe"),
    *bad(ZB_STEPS, 2, ["--schedule", "dualpipe", "--microbatches", "5", "--batch-size", "10"],
         "--microbatches 5", "even", "dualpipe"),
    *bad(ZB_STEPS, 4, ["--schedule", "dualpipev", "--microbatches", "6", "--batch-size", "12"],
         "--microbatches 6", "at least 2 x --pp 4 = 8", "dualpipev"),
    *bad(ZB_STEPS, 4, ["--schedule", "dualpipev", "--microbatches", "8", "--layers", "6"],
         "--schedule dualpipev with --pp 4 = 8 model chunks", "--layers 6"),
    *bad(ZB_STEPS, 2, ["--schedule", "dualpipev", "--p2p", "ordered"], "--p2p ordered", "dualpipev", "batched"),
    *bad(ZB_STEPS, 2, ["--schedule", "dualpipe", "--tie-embeddings"], "--tie-embeddings", "dualpipe"),
    *bad(ZB_STEPS, 4, ["--schedule", "dualpipev", "--tp", "2", "--scatter-gather"], "--scatter-gather",
         "dualpipev"),
    *bad(ZB_STEPS, 2, ["--schedule", "dualpipev", "--virtual-stages", "2"], "--virtual-stages 2",
         "--schedule dualpipev"),
    *bad(ZB_STEPS, 2, ["--schedule", "dualpipev", "--pairs", "sideways"], "--pairs sideways", "overlapped or sequential"),
    *bad(ZB_STEPS, 2, ["--schedule", "1f1b", "--pairs", "sequential"], "--pairs sequential", "--schedule 1f1b"),
]
DP2 = ["--pp", "1", "--dp", "2"]  # step 08's experts (experts.py)
EP_V = ["--pp", "2", "--dp", "2", "--experts", "4", "--ep", "2", "--schedule", "dualpipev", "--microbatches", "4"]
CASES += [
    *bad(ZB_STEPS, 2, [*DP2, "--experts", "3", "--ep", "2"], "--ep 2 must divide --experts 3"),
    *bad(ZB_STEPS, 2, [*DP2, "--experts", "4", "--ep", "4"], "--ep 4 must divide --dp 2"),
    *bad(ZB_STEPS, 1, ["--experts", "4", "--top-k", "5"], "--top-k 5", "between 1 and --experts 4"),
    *bad(ZB_STEPS, 1, ["--experts", "4", "--top-k", "0"], "--top-k 0", "between 1 and --experts 4"),
    *bad(ZB_STEPS, 1, ["--experts", "4", "--capacity-factor", "1.25"], "--capacity-factor 1.25", "dropless"),
    *bad(ZB_STEPS, 2, ["--experts", "4", "--tp", "2"], "--tp 2 with --experts", "not supported"),
    *bad(ZB_STEPS, 1, ["--ep", "2"], "--ep 2", "need --experts"),
    *bad(ZB_STEPS, 2, ["--experts", "4", "--schedule", "pipedream"], "--schedule pipedream with --experts"),
    *bad(ZB_STEPS, 1, ["--experts", "4", "--aux-loss-coef", "-1"], "--aux-loss-coef -1.0", "positive"),
    # overlap.py's pair: a simulated link's latency, and no recompute inside an overlapped pair
    *bad(ZB_STEPS, 4, [*EP_V, "--link-latency-ms", "-1"], "--link-latency-ms -1.0", "between 0 and 1000"),
    *bad(ZB_STEPS, 4, [*EP_V, "--link-latency-ms", "1e9"], "--link-latency-ms 1000000000.0", "between 0 and 1000"),
    *bad(ZB_STEPS, 2, [*DP2, "--experts", "4", "--ep", "2", "--link-latency-ms", "5"], "--link-latency-ms 5.0",
         "--schedule dualpipe"),
    *bad(ZB_STEPS, 4, [*EP_V, "--recompute"], "--pairs overlapped with --recompute", "--pairs sequential"),
]
CASES += [
    *bad(STEPS, 1, ["--pp", "x"], "argument --pp: invalid int value: 'x'"),
    *bad(STEPS, 1, ["--trace", "/"], "--trace /", "is a directory"),
    *bad(STEPS, 1, ["--log-json", "/sys/log.jsonl"], "--log-json /sys/log.jsonl", "cannot be written"),
    *bad(STEPS, 1, ["--trace", "/dev/null/trace.json"], "--trace /dev/null/trace.json", "/dev/null is not a folder"),
    *bad(STEPS, 1, ["--seed", "-1"], "--seed -1", "64 bits"),
    *bad(STEPS, 1, ["--seed", str(2**64)], f"--seed {2**64}", "64 bits"),
    *bad(STEPS, 1, ["--timeout", "0.001"], "--timeout 0.001", "at least 1 s", "start-up"),
    *bad(MP_STEPS, 1, ["--loss-scale", "inf"], "--loss-scale inf", "must be finite"),
    *bad(STEPS, 1, ["--trace", "README.md"], "--trace README.md", "not a trace this course wrote", "left as it is"),
    *bad(STEPS, 1, ["--log-json", "LICENSE"], "--log-json LICENSE", "not a log this course wrote"),
    *bad(MP_STEPS, 1, ["--precision", "fp16", "--loss-scale", "1e-40"], "--loss-scale 1e-40", "= 2.5e-41",
         "smallest normal fp16 number", "underflow"),
    *bad(MP_STEPS, 1, ["--precision", "fp16", "--loss-scale", "2e-4"], "--loss-scale 0.0002", "= 5e-05",
         "smallest normal fp16 number"),
    *bad(MP_STEPS, 1, ["--precision", "bf16", "--loss-scale", "1e-40"], "smallest normal bf16 number"),
    *bad(MP_STEPS, 1, ["--loss-scale", "1e39"], "--loss-scale 1e+39", "fp32's largest number"),
]
SIZES = [["--seq-len", "100000", "--batch-size", "64"], ["--batch-size", "100000"], ["--hidden", "65536"],
         ["--layers", "100000"]]  # each needs hundreds of GiB at least (budget.py), more than a test machine has
CASES += [case for flags in SIZES for case in bad(STEPS, 4, flags, " ".join(flags[:2]), "need at least", "GiB available")]
if not torch.cuda.is_available():
    CASES += bad(STEPS, 1, ["--device", "cuda"], "--device cuda", "no CUDA device")


@pytest.fixture(scope="module")
def refusals(step_dirs, tmp_path_factory):
    """refusal(step, world, flags) -> {exit_code, last_line}: every bad case of a step checked in one process
    (tests/check_bad_flags.py), which runs the step's train.parse_args as rank 0 of `world`."""
    cache = {}

    def refusal(step, world, flags):
        if step not in cache:
            cases = [[w, f] for s, w, f, _ in (p.values for p in CASES) if s == step]
            path = tmp_path_factory.mktemp(step) / "cases.json"
            path.write_text(json.dumps(cases))
            done = harness.run([sys.executable, str(REPO / "tests" / "check_bad_flags.py"), str(step_dirs[step]),
                                str(path)], cwd=REPO, capture_output=True, text=True, timeout=120,
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
            assert done.returncode == 0, done.stderr[-3000:]
            cache[step] = {(w, tuple(f)): found for (w, f), found in zip(cases, json.loads(done.stdout))}
        return cache[step][world, tuple(flags)]

    return refusal


@pytest.mark.parametrize("step, world, flags, expected", CASES)
def test_bad_configuration_fails_fast_with_a_clear_line(step, world, flags, expected, refusals):
    """As rank 0 of `world`: train.parse_args, the first thing train.main does, before any process group
    exists, must end the program with exit code 2 and one `error:` line naming the flag, value and rule."""
    found = refusals(step, world, flags)
    assert found["exit_code"] == 2, found
    message = found["last_line"]
    assert message.startswith("error: "), found
    for text in expected:
        assert text in message, f"{text!r} not in {message!r}"


def ratio_problem(stdout: str, events, kinds=("forward", "B", "W")):
    """Where the F:B:W that the report printed differs from the mean boxes of `kinds` in the run's trace
    (the printed ratios have two decimals); None if they agree."""
    printed = re.search(r"F:B:W = 1:([0-9.]+):([0-9.]+)", stdout)
    boxes = [e for e in events if e["ph"] == "X"]
    f, b, w = (sum(e["dur"] for e in boxes if e["cat"] == kind) / max(1, sum(e["cat"] == kind for e in boxes))
               for kind in kinds)
    expected = (b / f, w / f)
    if printed is None or any(abs(float(p) - e) > 0.005 + 1e-9 for p, e in zip(printed.groups(), expected)):
        return f"printed {printed and printed.group(0)}, the trace's {kinds} give 1:{expected[0]:.3f}:{expected[1]:.3f}"
    return None


@pytest.mark.parametrize("step, schedule", [(s, name) for s in ZB_STEPS for name in ("zb1p", "dualpipev")])
def test_printed_pass_times_are_the_traces(step, schedule, step_dirs, tmp_path, replay_passes):
    """The F:B:W that step 08's report prints beside zb1p's and DualPipe's formulas are the mean forward, B and
    W boxes of the same run's trace. Control: the trace's forward, whole-backward and W boxes must not match."""
    replay_passes(step, schedule)
    trace = tmp_path / "trace.json"
    stdout = train_py(step_dirs[step], 2, "--schedule", schedule, "--steps", "3", "--trace", str(trace), out=tmp_path)
    events = json.loads(trace.read_text())["traceEvents"]
    assert ratio_problem(stdout, events) is None, ratio_problem(stdout, events)
    assert ratio_problem(stdout, events, ("forward", "backward", "W")) is not None


def trace_units_problem(events, records, unit_s=1e-6):
    """Where a recorded step's extent in the trace, read in `unit_s` (the Chrome trace format's microseconds),
    is not within a factor of 3 of the step time the log measured by the wall clock; None if every step is."""
    boxes = [e for e in events if e["ph"] == "X"]
    for step in sorted({e["args"]["step"] for e in boxes}):
        mine = [e for e in boxes if e["args"]["step"] == step]
        extent = (max(e["ts"] + e["dur"] for e in mine) - min(e["ts"] for e in mine)) * unit_s
        if not records[step]["step_time_s"] / 3 <= extent <= records[step]["step_time_s"] * 3:
            return f"step {step}: {extent:.4g} s in the trace, {records[step]['step_time_s']:.4g} s by the wall clock"
    return None


def trace_names_problem(events):
    """Where a trace's names break their promise (timeline.box_name): a process_name, no 'chunk' in a run with one
    chunk, and each 'recv activation k' of a rank followed by that rank's 'forward k' (messages go in microbatch
    order in GPipe, afab and 1f1b); None if none does."""
    if not any(e["ph"] == "M" and e["name"] == "process_name" for e in events):
        return "no process_name metadata"
    boxes = sorted((e for e in events if e["ph"] == "X"), key=lambda e: (e["tid"], e["ts"]))
    if any("chunk" in e["name"] for e in boxes):
        return f"a box names a chunk in a run with one: {next(e['name'] for e in boxes if 'chunk' in e['name'])}"
    for i, e in enumerate(boxes):
        for part in re.findall(r"recv activation (\d+)", e["name"]):
            following = next((f["name"] for f in boxes[i + 1:] if f["tid"] == e["tid"] and f["cat"] == "forward"), None)
            if following != f"forward {part}":
                return f"rank {e['tid'] - 1}: {e['name']!r} is followed by {following!r}"
    return None


@pytest.mark.parametrize("step", [s for s in STEPS if "step02" <= s < "step05"])
def test_trace_names_messages_by_microbatch(step, four_stage_run):
    """The default runs of steps 02-04 (GPipe, afab, 1f1b): every received activation is named by the microbatch
    whose forward it feeds, no box says 'chunk 0', and the process is named. Control: the names numbered one on
    (recv activation k+1) fail."""
    _, _, trace = four_stage_run(step)
    events = json.loads(trace.read_text())["traceEvents"]
    assert trace_names_problem(events) is None, trace_names_problem(events)
    shifted = [dict(e, name=re.sub(r"recv activation (\d+)", lambda m: f"recv activation {int(m[1]) + 1}", e["name"]))
               for e in events]
    assert trace_names_problem(shifted) is not None


@pytest.mark.parametrize("step", STEPS)
def test_trace_is_in_microseconds(step, four_stage_run):
    """The trace's ts and dur are microseconds: each recorded step spans in it about the wall-clock step time
    of the log (within 3x; a trace in milliseconds would be 1000x off). Control: read as milliseconds, it fails."""
    _, log, trace = four_stage_run(step)
    events, records = json.loads(trace.read_text())["traceEvents"], read_log(log)
    assert trace_units_problem(events, records) is None, trace_units_problem(events, records)
    assert trace_units_problem(events, records, unit_s=1e-3) is not None


ESTIMATE_FLOOR = 0.85  # budget.py leaves out the embedding, the head, the loss and the outputs a stage keeps


def bound_problem(estimated, measured):
    """Where an estimate is not a close lower bound of what was measured (ESTIMATE_FLOOR to 1); None if none."""
    wrong = [f"rank {r}: {e:.0f} estimated, {m} measured" for r, (e, m) in enumerate(zip(estimated, measured))
             if not ESTIMATE_FLOOR * m <= e <= m]
    return "; ".join(wrong) or None


@pytest.mark.parametrize("step", LATER)
def test_memory_estimate_is_a_close_lower_bound(step, step_dirs, four_stage_run):
    """The activations budget.py estimates per stage from the flags alone, against the activation meter's
    peak in the default 4-rank run: at most the measured bytes, at least 85% of them; in step 08 the same for
    the parameters (a quarter of the 16 bytes each: the fp32 weight) against the logged param_bytes.
    Control: one stored microbatch more, or fewer, on every stage leaves the bound."""
    _, log, _ = four_stage_run(step)
    last = read_log(log)[-1]
    done = harness.run([sys.executable, str(REPO / "tests" / "check_bad_flags.py"), str(step_dirs[step]),
                        "--estimate", "4", "--steps", str(SMOKE_STEPS)], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    estimates = json.loads(done.stdout)
    activations, measured = [e["activations"] for e in estimates], last["peak_activation_bytes"]
    assert bound_problem(activations, measured) is None, bound_problem(activations, measured)
    for shift in (-1, 1):
        shifted = [a * (n + shift) / n for a, n in zip(activations, last["peak_stored_microbatches"])]
        assert bound_problem(shifted, measured) is not None, f"{shift:+d} stored microbatch is not caught"
    if "param_bytes" in last:
        weights = [e["parameters"] / 4 for e in estimates]
        assert bound_problem(weights, last["param_bytes"]) is None, bound_problem(weights, last["param_bytes"])

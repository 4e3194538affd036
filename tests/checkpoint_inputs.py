"""The checkpoints a user may hand --resume and --save, made from the runs of tests/test_checkpoints.py: copies
damaged as a disk or a user might, and the flags each case passes with the line it must print.
Read by tests/test_checkpoints.py."""
import json
import os
import shutil
import sys
from pathlib import Path

from harness import REPO, run

SMALL = ["--device", "cpu", "--hidden", "32", "--layers", "4", "--heads", "2", "--seq-len", "16",
         "--batch-size", "8", "--microbatches", "4", "--timeout", "60"]


def step_name(step: int) -> str:
    return f"step{step:08d}"


def damage(out: Path):
    """Copies of run a's checkpoints (steps 3 and 6), damaged as a disk or a user might: damaged/ with step 6's
    first file cut to 1000 bytes, missing/ with step 6's last file deleted, old/ as saved before record.json
    existed, garbage/ (no record either) with DCP's index overwritten, nothing_intact/ with both damaged,
    flipped/ with one bit of step 6's first file flipped: the same length, other bytes."""
    for name in ("damaged", "missing", "old", "garbage", "nothing_intact", "flipped"):
        shutil.rmtree(out / name, ignore_errors=True)
        shutil.copytree(out / "a", out / name)
    os.truncate(sorted((out / "damaged" / step_name(6)).glob("*.distcp"))[0], 1000)
    flip_a_bit(sorted((out / "flipped" / step_name(6)).glob("*.distcp"))[0])
    sorted((out / "missing" / step_name(6)).glob("*.distcp"))[-1].unlink()
    for folder in (out / "old").glob("step*"):
        (folder / "record.json").unlink()
    shutil.rmtree(out / "garbage" / step_name(6))
    (out / "garbage" / step_name(3) / "record.json").unlink()
    (out / "garbage" / step_name(3) / ".metadata").write_text("garbage")
    sorted((out / "nothing_intact" / step_name(6)).glob("*.distcp"))[-1].unlink()
    os.truncate(sorted((out / "nothing_intact" / step_name(3)).glob("*.distcp"))[0], 1000)


def flip_a_bit(path: Path):
    """Flip the lowest bit of the byte in the middle of a file, in place: its length stays as it was."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 1]))


def taken_inputs(out: Path):
    """(flags, the texts of the one line an accepted --resume prints): the checkpoint it takes, what it skips."""
    cases = [(["--resume", str(out / "damaged")], [f"resuming from {out / 'damaged' / step_name(3)}; skipped "
                                                   f"{step_name(6)}: ", "has 1000 bytes, its record says"]),
             (["--resume", str(out / "missing")], [f"resuming from {out / 'missing' / step_name(3)}; skipped",
                                                   "is missing"]),
             (["--resume", str(out / "flipped")], [f"resuming from {out / 'flipped' / step_name(3)}; skipped "
                                                   f"{step_name(6)}: ", "does not match the CRC-32 in its record"]),
             (["--resume", str(out / "a" / step_name(3))], [f"resuming from {out / 'a' / step_name(3)}"]),
             (["--resume", f"{out / 'a' / step_name(3)}/"], [f"resuming from {out / 'a' / step_name(3)}"]),
             (["--resume", str(out / "a")], [f"resuming from {out / 'a' / step_name(6)}"]),  # the control: intact
             (["--resume", str(out / "old")], [f"resuming from {out / 'old' / step_name(6)} unchecked"])]
    return [([*SMALL, "--pp", "1", *flags, "--steps", "10"], texts) for flags, texts in cases]


def parse_as_rank_0(step_dir: Path, out: Path, cases) -> list:
    """tests/check_bad_flags.py on each case's flags, rank 0 of 1: [{exit_code, last_line, printed}]."""
    (out / "cases.json").write_text(json.dumps([[1, flags] for flags, _ in cases]))
    done = run([sys.executable, str(REPO / "tests" / "check_bad_flags.py"), str(step_dir), str(out / "cases.json")],
               cwd=REPO, capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def bad_inputs(out: Path, step: str, earlier: Path):
    """(flags, the texts the refusal's line must hold) for a step, around the checkpoints of its runs and of
    step 03's runs (earlier)."""
    (out / "empty").mkdir(exist_ok=True)
    (out / "unfinished").mkdir(exist_ok=True)
    shutil.copytree(out / "a" / step_name(3), out / "unfinished" / f"{step_name(3)}.tmp", dirs_exist_ok=True)
    damage(out)
    a = str(out / "a")
    cases = [
        (["--resume", str(out / "empty")], ["--resume", "holds no checkpoint", "no folder stepNNNNNNNN"]),
        (["--resume", str(out / "unfinished")], ["--resume", "holds no checkpoint", "never finished"]),
        (["--resume", str(out / "damaged" / step_name(6)), "--steps", "10"],
         [f"--resume {out / 'damaged' / step_name(6)} fails its check", "has 1000 bytes, its record says"]),
        (["--resume", str(out / "flipped" / step_name(6)), "--steps", "10"],
         [f"--resume {out / 'flipped' / step_name(6)} fails its check", "does not match the CRC-32 in its record"]),
        (["--resume", str(out / "garbage"), "--steps", "10"],
         [f"--resume {out / 'garbage' / step_name(3) / '.metadata'} cannot be read"]),
        (["--resume", str(out / "nothing_intact"), "--steps", "10"],
         ["no checkpoint passes its check", f"{step_name(6)}: ", "is missing", f"{step_name(3)}: ", "1000 bytes"]),
        (["--resume", a, "--hidden", "64", "--steps", "10"], ["--hidden 32", "this run has --hidden 64"]),
        (["--resume", a, "--layers", "8", "--steps", "10"], ["--layers 4", "this run has --layers 8"]),
        (["--resume", a, "--steps", "6"], ["at step 6", "--steps 6", "nothing is left"]),
        (["--save", str(out / "s"), "--save-every", "0"], ["--save-every 0", "at least 1"]),
        (["--save", str(out / "s"), "--keep", "0"], ["--keep 0", "at least 1"]),
        (["--save", "/sys/checkpoints"], ["--save /sys/checkpoints", "cannot be written"]),
        (["--save", str(out / "a.jsonl")], ["a.jsonl is a file"]),
        (["--save", "/no/such/folder/ckpt"], ["/no/such/folder", "does not exist"]),
    ]
    if step >= "step04":
        cases += [(["--schedule", "pipedream", "--save", str(out / "s")], ["--save does not fit --schedule pipedream"]),
                  (["--schedule", "pipedream-2bw", "--resume", a, "--steps", "10"],
                   ["--resume does not fit --schedule pipedream-2bw", "no step boundary"])]
    if step >= "step07":
        cases += [(["--resume", str(out / "b"), "--precision", "fp16", "--steps", "10"],
                   ["saved in bf16 with no dynamic loss scaler", "--precision fp16"]),
                  (["--resume", str(earlier / "a"), "--steps", "10"],
                   ["does not record precision, tie_embeddings", "an earlier step of the course"])]
    return [([*SMALL, "--pp", "1", *flags], texts) for flags, texts in cases]

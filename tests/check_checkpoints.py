"""One rank of a checkpoint test: several train.py runs in one process group. Started by
test_checkpoints.py through harness.launch, never by pytest itself.

    python tests/check_checkpoints.py STEP_DIR OUT_DIR CASES_JSON

Each case is {"flags": [...], and optionally
    "copy": [SRC, DST]    rank 0 copies the checkpoint folder SRC to DST first (a resume's start),
    "log_head": [SRC, DST, K]  rank 0 writes into DST the lines of the log SRC before its record of step K,
                          then half of that record: the --log-json of a run that stopped writing step K's record
                          (a full disk; the resume keeps the records before its checkpoint),
    "grads": [K, DIR]     this rank writes DIR/rankR.pt, its gradients of step K,
    "no_optimizer": true  the save writes, and the load asks for, no optimizer state (the control),
    "die_saving": K       rank 1 is killed (SIGKILL) in the K-th save, after writing its file, before
                          rank 0 has written DCP's index: the crash during a save,
    "full_saving": K      rank 1's write fails in the K-th save (OSError ENOSPC): a full disk}.
A case runs `train.train(train.parse_args(flags))`, train.py's own loop with its own --save and
--resume, exactly as `python train.py FLAGS` would; only the process group is made once for all the
cases (train.init_distributed is replaced by the device), since one launch per case would cost a
second or more of start-up each. The hooks above wrap torch's and train's functions from outside;
the step's code is not changed.
"""
import errno
import json
import os
import shutil
import signal
import sys
from pathlib import Path

import torch


def record_grads(train, step_k: int, path: Path):
    """Wrap train.compute_gradients: after step step_k, save this rank's gradients (step 07's fp32
    main_grad where the stage is half), with each TP shard's split dimension and the rank's place."""
    real = train.compute_gradients

    def compute_gradients(run, step):
        loss = real(run, step)
        if step == step_k:
            pgm = run.pgm
            grads = {n: (getattr(p, "main_grad", p.grad).detach().cpu().clone(), getattr(p, "tp_split_dim", None))
                     for n, p in run.model.named_parameters() if not getattr(p, "shared", False)}
            torch.save(dict(grads=grads, loss=loss, dp_rank=pgm.dp_rank, tp_rank=getattr(pgm, "tp_rank", 0),
                            tp=getattr(pgm, "tp", 1)), path)
        return loss

    train.compute_gradients = compute_gradients
    return real


def without_optimizer(checkpoint):
    """The control: saves and loads that leave out the optimizer state, as if a checkpoint had none."""
    real_save, real_load = checkpoint.dcp.save, checkpoint.dcp.load

    def strip(state):
        return {k: v for k, v in state.items() if k != "optimizer"}

    def load(state, **kw):  # DCP puts what is not a tensor (the facts) into the dict it was given
        part = strip(state)
        real_load(part, **kw)
        state.update(part)

    checkpoint.dcp.save = lambda state, **kw: real_save(strip(state), **kw)
    checkpoint.dcp.load = load
    return real_save, real_load


def die_in_save(k: int):
    """Rank 1 ends with SIGKILL in the k-th save, once its own file is written, before the save is complete."""
    from torch.distributed.checkpoint import filesystem

    real, calls = filesystem.FileSystemWriter.write_data, [0]

    def write_data(self, plan, planner):
        written = real(self, plan, planner)
        calls[0] += 1
        if calls[0] == k and int(os.environ["RANK"]) == 1:
            written.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return written

    filesystem.FileSystemWriter.write_data = write_data


def full_in_save(k: int):
    """Rank 1's write fails in the k-th save as on a full disk (OSError ENOSPC), before its file is written."""
    from torch.distributed.checkpoint import filesystem

    real, calls = filesystem.FileSystemWriter.write_data, [0]

    def write_data(self, plan, planner):
        calls[0] += 1
        if calls[0] == k and int(os.environ["RANK"]) == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        return real(self, plan, planner)

    filesystem.FileSystemWriter.write_data = write_data


def copy_log_head(source: str, target: str, step: int):
    """The lines of the log at source up to its first record of `step` or later, then the first half of that
    record, without its newline (a write cut short), written to target (a line that is no step record, such as a
    mark the course may write, is kept as it is)."""
    head = []
    for line in Path(source).read_text().splitlines(keepends=True):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict) and record.get("step", -1) >= step:
            head.append(line[:len(line) // 2])
            break
        head.append(line)
    Path(target).write_text("".join(head))


def main(step_dir: str, out_dir: str, cases_json: str):
    sys.path.insert(0, os.path.abspath(step_dir))
    torch.set_num_threads(1)
    from support import checkpoint, distributed
    import torch.distributed as dist
    import train

    out, rank = Path(out_dir), int(os.environ["RANK"])
    device = distributed.init_distributed("cpu", 60)
    train.init_distributed = lambda choice, timeout: device
    for i, case in enumerate(json.loads(cases_json)):
        (out / f"rank{rank}.status").write_text(f"case {i}: {' '.join(case['flags'])}")
        if "copy" in case and rank == 0:
            shutil.copytree(*case["copy"])
        if "log_head" in case and rank == 0:
            copy_log_head(*case["log_head"])
        dist.barrier()  # the copy is there before any rank checks --resume
        if "grads" in case:
            os.makedirs(case["grads"][1], exist_ok=True)
        real_grads = record_grads(train, case["grads"][0], Path(case["grads"][1]) / f"rank{rank}.pt") \
            if "grads" in case else None
        real_io = without_optimizer(checkpoint) if case.get("no_optimizer") else None
        if "die_saving" in case:
            die_in_save(case["die_saving"])
        if "full_saving" in case:
            full_in_save(case["full_saving"])
        train.train(train.parse_args(case["flags"]))
        if real_grads:
            train.compute_gradients = real_grads
        if real_io:
            checkpoint.dcp.save, checkpoint.dcp.load = real_io
        dist.barrier()  # rank 0 has renamed the last checkpoint before the next case reads it
    (out / f"rank{rank}.status").write_text("done")
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])

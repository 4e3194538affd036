"""Start-up and end of one rank under torchrun: which device, which backend, a timeout; how a run ends.

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK for every process it starts. A
GPU run uses NCCL with one device per rank (its LOCAL_RANK); a CPU run uses
gloo. The timeout turns a schedule bug (a receive nobody sends) into an error
instead of a silent hang. A run ends together (shutdown), or with one line: a
stalled or dead peer, memory that ran out, Ctrl-C (one_line_errors), a loss that
diverged (stop_if_diverged).
"""
import math
import os
import signal
import sys
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from support import faults
from support.progress import interrupted, progress  # where this rank is; Ctrl-C's line (report.py, checkpoint.py)


def world_from_env():
    """(rank, world_size, local_rank) as torchrun sets them; a plain `python` run is rank 0 of 1."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)))


def pick_device(choice: str, local_rank: int) -> torch.device:
    """The device this rank computes on: the CPU, or on CUDA the GPU of this rank's local index on its node.
    `choice` is cpu or cuda, decided once per node by config.check_device (--device auto included)."""
    if choice == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device_choice: str, timeout_s: float) -> torch.device:
    """Join the process group; return this rank's device."""
    rank, world, local_rank = world_from_env()
    device = pick_device(device_choice, local_rank)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    # device_id makes NCCL start eagerly; then every lone isend or irecv runs on the group's one communicator,
    # in the order posted (PyTorch PR #132900), and PyTorch warns once that they are serialised. Steps 01-02
    # and --p2p ordered post them so: the course's schedules are built for that order (tests/replay.py).
    os.environ.setdefault("TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING", "0")
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s), **kwargs)
    faults.start_heartbeat(timeout_s)  # each rank's sign of life, read by a rank that gives up (faults.py)
    return device


def peak_memory_bytes(device: torch.device):
    """Peak allocated device memory since the last reset, or None where it is not tracked (CPU)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def wait_for_device(device: torch.device):
    """Block the host until the GPU has run everything queued on it, once at a step's end, so that the step's
    clock stops after its last kernel, not when the host queued it. A CPU computes as it goes: no wait."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device):
    """Start a new peak of CUDA memory, so that the report's peak is one step's; a CPU keeps none."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


@contextmanager
def one_line_errors(timeout_s: float):
    """A stalled or dead peer, or memory that ran out, ends this rank with one line on stderr and exit code 1,
    not a page of C++ frames; Ctrl-C ends it with exit code 130 (interrupted)."""
    signal.signal(signal.SIGINT, interrupted)  # again: a process that did not start as train.py
    try:
        yield
    except (RuntimeError, MemoryError) as err:  # gloo and NCCL report an expired timeout or a closed connection so
        line = faults.one_line(err, timeout_s) or out_of_memory(err)  # who stalled or died, what this rank was doing
        if line is None:
            raise
        print(line, file=sys.stderr, flush=True)
        faults.linger()  # rank 0 keeps the store it runs until the others have read it
        os._exit(1)  # no teardown: it would wait on the stalled peer again


def out_of_memory(err: BaseException):
    """The one line of an allocation that failed (CUDA's OutOfMemoryError, the CPU allocator's error, Python's
    MemoryError), naming the step and the rank; None for any other error."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if not isinstance(err, MemoryError) and "out of memory" not in text and "can't allocate memory" not in text:
        return None
    rank = dist.get_rank() if dist.is_initialized() else 0
    return f"error: out of memory in step {progress['step']} on rank {rank}: {text}"


def stop_if_diverged(record):
    """A loss that is not finite (on a step no loss scaler skipped) does not come back: end every rank with
    one line and exit code 3. The check reads the loss every rank already holds (share_loss), so all ranks
    stop at the same step and the hot path pays one comparison. Rank 0 prints before the barrier: no rank
    exits, and so no rank is stopped by torchrun, before the line is written."""
    if math.isfinite(record["loss"]) or record.get("skipped"):
        return
    if dist.get_rank() == 0:
        print(f"error: the loss is {record['loss']} at step {record['step']}: training diverged "
              "(a lower --lr?)", file=sys.stderr, flush=True)
    dist.barrier()
    sys.stdout.flush()
    os._exit(3)  # as shutdown(): no teardown


def shutdown():
    """Leave the process group together and end the process.

    The barrier means no peer still needs this rank. Even after destroy_process_group, gloo may keep
    background threads whose C++ destructors, run in the interpreter's final teardown, now and then
    abort a finished process ("terminate called without an active exception"). All output is
    written by now, so flush it and exit without that teardown.
    """
    faults.stop_heartbeat()  # before rank 0, whose store it writes to, may leave
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

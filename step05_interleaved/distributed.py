"""Start-up of one rank under torchrun: which device, which backend, and a timeout.

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK for every process it starts. A
GPU run uses NCCL with one device per rank (its LOCAL_RANK); a CPU run uses
gloo. The timeout turns a schedule bug (a receive nobody sends) into an error
instead of a silent hang.
"""
import os
import sys
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

import faults


def world_from_env():
    """(rank, world_size, local_rank) as torchrun sets them; a plain `python` run is rank 0 of 1."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)))


def pick_device(choice: str, local_rank: int) -> torch.device:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
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
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s), **kwargs)
    faults.start_heartbeat(timeout_s)  # each rank's sign of life, read by a rank that gives up (faults.py)
    return device


def peak_memory_bytes(device: torch.device):
    """Peak allocated device memory since the last reset, or None where it is not tracked (CPU)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def reset_peak_memory(device: torch.device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


@contextmanager
def one_line_errors(timeout_s: float):
    """A stalled or dead peer ends this rank with one line on stderr and exit code 1, not a page of C++ frames."""
    try:
        yield
    except RuntimeError as err:  # gloo and NCCL report an expired timeout or a closed connection so
        line = faults.one_line(err, timeout_s)  # who stalled or died, and what this rank was doing
        if line is None:
            raise
        print(line, file=sys.stderr, flush=True)
        faults.linger()  # rank 0 keeps the store it runs until the others have read it
        os._exit(1)  # no teardown: it would wait on the stalled peer again


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

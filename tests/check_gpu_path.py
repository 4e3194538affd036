"""The GPU path's decisions, checked in one process on a CPU with CUDA faked. Started by tests/test_gpu_path.py.

    python tests/check_gpu_path.py STEP_DIR

Prints one JSON object:

  devices   {"choice gpus local_world nodes local_rank": [outcome, notes]} for --device auto and cuda on nodes of
            0 to 4 GPUs and 1 to 4 ranks, in a job of one node or two (the second node's ranks: WORLD_SIZE twice
            LOCAL_WORLD_SIZE, RANK from LOCAL_WORLD_SIZE on): outcome is ["device", "cpu" | "cuda"],
            ["refused", line] or
            ["crash", message]; notes are the lines the rank printed besides. torch.cuda.device_count and
            is_available are faked, and mem_get_info raises CUDA's own "invalid device ordinal" for a GPU the
            node does not have, as a real one does.
  timing    {"cuda" | "cpu": [calls]}: what train.train_step (and from step 04 PipeDream's train_steps) calls,
            in order, over two steps with a faked device: "clock" (time.perf_counter), "compute", "optimizer",
            "sync" (torch.cuda.synchronize), "end_step"; PipeDream's "schedule" and "finish_sends".
  faults    {message: kind}: faults.kind_of on gloo's and NCCL's real texts.
  guarded   {message: the exception p2p._guarded raises, and its text} (step 03 on).
  nccl      what init_distributed("cuda") passes to init_process_group (see nccl_start).
"""
import contextlib
import io
import json
import os
import sys
from types import SimpleNamespace

INVALID_ORDINAL = "CUDA error: invalid device ordinal"  # what CUDA says of a GPU index the node lacks

# The messages a failed wait carries, as gloo and PyTorch 2.13's NCCL backend word them (see faults.py).
MESSAGES = {
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:58946": "gone",
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 4000ms for recv operation "
    "to complete": "timeout",
    "[PG ID 0 PG GUID 0(default_pg) Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, "
    "OpType=RECV, NumelIn=4096, NumelOut=4096, Timeout(ms)=4000) ran for 4012 milliseconds before timing out.":
        "timeout",
    "NCCL communicator was aborted on rank 1.  Original reason for failure was: [PG ID 0 PG GUID 0(default_pg) "
    "Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=SEND, NumelIn=4096, "
    "NumelOut=4096, Timeout(ms)=4000) ran for 4005 milliseconds before timing out.": "timeout",
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:77, remote process exited or there was a "
    "network error, NCCL version 2.27.3\nncclRemoteError: A call failed possibly due to a network error or a "
    "remote process exiting prematurely.\nLast error:\nsocketPollConnect: connect returned Connection refused":
        "gone",
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, unhandled system error (run "
    "with NCCL_DEBUG=INFO for details), NCCL version 2.27.3\nncclSystemError: System call (e.g. socket, malloc) "
    "or external library call failed or device error. \nLast error:\nError while creating shared memory segment "
    "/dev/shm/nccl-2hPF5f (size 9637888)": None,
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, unhandled cuda error (run "
    "with NCCL_DEBUG=INFO for details), NCCL version 2.27.3\nncclUnhandledCudaError: Call to CUDA function "
    "failed.\nLast error:\nCuda failure 2 'out of memory'": None,
    "NCCL communicator was aborted on rank 0. ": None,
}


def fake_cuda(torch, gpus: int):
    """torch.cuda as a node with `gpus` GPUs shows it to the config checks."""
    def mem_get_info(device=None):
        index = device.index if hasattr(device, "index") else int(device or 0)
        if index >= gpus:
            raise RuntimeError(INVALID_ORDINAL)
        return 80 * 2**30, 80 * 2**30

    torch.cuda.device_count, torch.cuda.is_available = (lambda: gpus), (lambda: gpus > 0)
    torch.cuda.mem_get_info = mem_get_info


def device_outcome(config, torch, choice: str, gpus: int, local_world: int, nodes: int, local_rank: int):
    """[outcome, notes] of one rank's flag check (config.parse_flags) on the last of `nodes` nodes as given: a job
    of nodes x local_world ranks (WORLD_SIZE), this node's rank local_rank of local_world (LOCAL_WORLD_SIZE)."""
    fake_cuda(torch, gpus)
    world = nodes * local_world
    os.environ.update(RANK=str(world - local_world + local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(local_world))
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = config.parse_flags(["--device", choice, "--pp", str(world), "--layers", str(max(4, world))], "")
        outcome = ["device", args.device]
    except SystemExit:
        lines = err.getvalue().splitlines()
        return [["refused", lines[-1] if lines else ""], lines[:-1]]
    except RuntimeError as crash:
        outcome = ["crash", str(crash)]
    return [outcome, err.getvalue().splitlines()]


def devices(config, torch):
    config.REFUSAL_WAIT_S = 0  # a rank other than 0 says its refusal at once here
    found = {}
    for choice in ("auto", "cuda"):
        for gpus in range(5):
            for local_world in (1, 2, 4):
                for nodes in (1, 2):
                    for local_rank in range(local_world):
                        key = f"{choice} {gpus} {local_world} {nodes} {local_rank}"
                        found[key] = device_outcome(config, torch, choice, gpus, local_world, nodes, local_rank)
    return found


class Calls(list):
    """The calls a faked step makes, in order."""

    def note(self, name, result=None):
        return lambda *args, **kwargs: (self.append(name), result)[1]


def fake_run(torch, calls, device: str):
    """A Run with only what train_step and PipeDream's train_steps touch, each part logging its calls."""
    timeline = SimpleNamespace(enabled=False, start_step=calls.note("start_step"), end_step=calls.note("end_step"))
    comm = SimpleNamespace(begin_step=calls.note("begin_step"), finish_sends=calls.note("finish_sends"))
    args = SimpleNamespace(batch_size=2, seq_len=4, steps=2, microbatches=1, seed=0, dp=1, experts=0)  # dense
    return SimpleNamespace(args=args, device=torch.device(device, 0) if device == "cuda" else torch.device(device),
                           meter=SimpleNamespace(enabled=False),
                           timeline=timeline, comm=comm, optimizer=SimpleNamespace(step=calls.note("optimizer", {})),
                           stages=[], tokens=torch.arange(64) % 256, pgm=SimpleNamespace(dp_rank=0))


def timing(train, torch, step_dir: str):
    """The calls of two steps of train_step (and of PipeDream's train_steps) on a faked CUDA device and on the CPU."""
    found = {}
    for device in ("cuda", "cpu"):
        calls = Calls()
        torch.cuda.synchronize = calls.note("sync")
        torch.cuda.reset_peak_memory_stats = calls.note("reset_peak")
        train.time.perf_counter = lambda: (calls.append("clock"), 0.0)[1] + len(calls)
        train.compute_gradients = calls.note("compute", 1.0)
        run = fake_run(torch, calls, device)
        for step in range(2):
            train.train_step(run, step)
        found[device] = list(calls)
        if os.path.exists(os.path.join(step_dir, "pipedream.py")):
            import pipedream
            calls.clear()
            pipedream.warm_up = calls.note("warm_up")
            pipedream.pipedream_forward_backward = calls.note("schedule")
            pipedream.train_steps(run, None, lambda run, inputs, targets: [], calls.note("share_loss", 0.0),
                                  calls.note("start_recording"))
            found[f"pipedream {device}"] = list(calls)
    return found


def guarded(step_dir: str):
    """What p2p.PipelineComm._guarded raises for each message (a RuntimeError with it raised inside)."""
    if not os.path.exists(os.path.join(step_dir, "p2p.py")):
        return {}
    import p2p
    comm = SimpleNamespace(prev_rank=0, next_rank=2)
    found = {}
    for message in MESSAGES:
        def call():
            raise RuntimeError(message)
        try:
            p2p.PipelineComm._guarded(comm, call, lambda verb="waited in vain for": f"rank 1 {verb} rank 2")
        except RuntimeError as err:
            found[message] = [type(err).__name__, str(err)]
    return found


def nccl_start(distributed, torch):
    """What distributed.init_distributed("cuda") hands init_process_group, and the serialisation warning's switch
    (TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING) at that moment; CUDA and the process group faked."""
    seen = {}

    def init_process_group(backend, **kwargs):
        seen.update(backend=backend, device_id=str(kwargs.get("device_id")),
                    warning=os.environ.get("TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING"))

    os.environ.pop("TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING", None)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    distributed.dist.init_process_group, torch.cuda.set_device = init_process_group, lambda index: None
    distributed.faults.start_heartbeat = lambda timeout_s: None
    distributed.init_distributed("cuda", 10.0)
    return seen


def main(step_dir: str):
    sys.path.insert(0, os.path.abspath(step_dir))
    import torch

    import config
    import train
    from support import distributed, faults

    report = dict(devices=devices(config, torch), faults={m: faults.kind_of(RuntimeError(m)) for m in MESSAGES},
                  guarded=guarded(step_dir), timing=timing(train, torch, step_dir), nccl=nccl_start(distributed, torch))
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])

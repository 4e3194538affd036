"""Checkpoints with torch.distributed.checkpoint (DCP): save in parallel, resume exactly, in any layout.

    --save DIR --save-every N --keep K      DIR/step00000006/ holds the run after 6 optimizer steps
    --resume DIR                            go on from the newest complete checkpoint in DIR

Every parameter of the course already has a global name (`layers.5.attn.wq.weight`), the same on
whichever stage, chunk or rank holds it (model.py). A checkpoint is therefore one dict of tensors
under those names, and nothing in it says how the model was cut:

    {"model":     {"layers.5.attn.wq.weight": tensor, ...},
     "optimizer": {"layers.5.attn.wq.weight": {"exp_avg": ..., "exp_avg_sq": ..., "step": ...}, ...},
     "run":       '{"step": 6, "layers": 8, "hidden": 128, ...}'}

The course builds that dict itself. torch.distributed.checkpoint.state_dict's `get_state_dict`, with
`StateDictOptions(flatten_optimizer_state_dict=True)`, names AdamW's state the same way, by parameter
name, but finds the names by matching the optimizer's tensors to the module's, which step 07's fp32
master weights are not; one hand-made dict serves every step.

Each rank hands `dcp.save` only its own entries. DCP gathers every rank's plan on rank 0, gives each
entry that several ranks hold (the data-parallel replicas) to one of them (`dedup_save_plans`), every
rank writes its own file at the same time, and rank 0 writes the index, `.metadata`, once all have
written (torch/distributed/checkpoint/state_dict_saver.py: `reduce_scatter("plan", ...)`, then
`all_reduce("write", write_data, finish_checkpoint)`; filesystem.py, `FileSystemWriter.finish`). `dcp.load`
reads that index and fetches, for each entry a rank asks for, the bytes whichever rank wrote: a run at
pp 2 loads the checkpoint of a run at pp 4, or of one process.

A checkpoint is complete or absent. DCP writes into DIR/step00000006.tmp; after a barrier (every
rank has written), rank 0 renames it to DIR/step00000006, one atomic rename. A run killed in the
middle of a save leaves a .tmp folder, which --resume never reads: it takes the newest folder that
was renamed. The data is a function of the step (data.get_batch), so the step index is all a
resumed run needs to draw the next batch.

Step 06: a TP rank holds a slice of each split parameter under the whole parameter's name. It is
saved as what it is, a DTensor sharded along its `tp_split_dim` over the TP group's DeviceMesh, so
that DCP records where the slice sits in the whole tensor, writes each slice once, and a load at
another --tp (or in one process) takes the slices it needs and joins them. A copy of a parameter
that another rank also holds (`shared`: the tied embedding's copy on the last stage) is not saved
twice; it loads the same entry as the original.
"""
import json
import os
import re
import shutil
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from model import ModelConfig

NAME = re.compile(r"step(\d{8})")  # a complete checkpoint's folder; DCP's .tmp folders do not match
SHAPE_FLAGS = ("layers", "hidden", "heads", "tie_embeddings")  # fix the model's shape, with the vocabulary


def folder_of(root: str, step: int) -> str:
    """The checkpoint of `step` under root; zero-padded, so that the names sort by step."""
    return os.path.join(root, f"step{step:08d}")


def complete(root: str) -> list:
    """The complete checkpoints in root, oldest first: folders renamed from .tmp, with DCP's index."""
    names = sorted(n for n in os.listdir(root) if NAME.fullmatch(n)) if os.path.isdir(root) else []
    return [os.path.join(root, n) for n in names if os.path.isfile(os.path.join(root, n, ".metadata"))]


def newest(root: str):
    """The newest complete checkpoint in root, or None."""
    found = complete(root)
    return found[-1] if found else None


def facts(args, step: int) -> dict:
    """What a checkpoint records besides tensors: its step, and the flags that fix the model's shape."""
    return dict(step=step, vocab_size=ModelConfig.vocab_size, **{flag: getattr(args, flag) for flag in SHAPE_FLAGS})


def read_facts(path: str) -> dict:
    """A checkpoint's facts, read by one process before any process group exists (config.py)."""
    state = {"run": ""}
    with warnings.catch_warnings():  # DCP warns that it loads in a single process: that is the intent
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=path, no_dist=True)
    return json.loads(state["run"])


def add_flags(p):
    """The flags of this module, a group of their own in train.py's --help."""
    group = p.add_argument_group("checkpoint", "saving the run and resuming it (checkpoint.py)")
    group.add_argument("--save", default=None, metavar="DIR", help="save checkpoints into this folder")
    group.add_argument("--save-every", type=int, default=None, metavar="N",
                       help="save every N optimizer steps (default: only after the last)")
    group.add_argument("--keep", type=int, default=2, help="keep the newest K checkpoints in --save")
    group.add_argument("--resume", default=None, metavar="DIR",
                       help="go on from the newest complete checkpoint in DIR, up to --steps")


def check_flags(args):
    """Refuse, before any work, what a run could only fail at later: a ValueError with one line."""
    if args.save_every is not None and args.save_every < 1 or args.keep < 1:
        raise ValueError(f"--save-every {args.save_every} and --keep {args.keep} must be at least 1")
    if args.save:
        check_save_folder(args.save)
    if args.resume:
        check_resume(args, newest(args.resume))


def check_save_folder(path: str):
    """--save's folder must be writable, or, if it does not exist yet, its parent (the run creates it)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--save {path} is a file: give a folder")
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--save {path}: the folder {folder} does not exist")
    try:
        tempfile.TemporaryDirectory(dir=folder).cleanup()
    except OSError as err:
        raise ValueError(f"--save {path} cannot be written: {err.strerror} in {folder}") from None


def check_resume(args, path):
    """The newest complete checkpoint exists, holds this model's shape, and leaves steps to run."""
    if path is None:
        raise ValueError(f"--resume {args.resume} holds no complete checkpoint (a folder stepNNNNNNNN with "
                         "DCP's .metadata)")
    saved, wanted = read_facts(path), facts(args, 0)
    missing = [fact for fact in wanted if fact not in saved]  # the facts later steps of the course add
    if missing:
        raise ValueError(f"--resume {path} does not record {', '.join(missing)}: an earlier step of the course "
                         "saved it; resume it with that step's train.py")
    for flag in ("vocab_size", *SHAPE_FLAGS):
        name = "the vocabulary" if flag == "vocab_size" else "--" + flag.replace("_", "-")
        if saved[flag] != wanted[flag]:
            raise ValueError(f"--resume {path} was saved with {name} {saved[flag]}, this run has {name} "
                             f"{wanted[flag]}: a checkpoint loads only into a model of its shape")
    if saved["step"] >= args.steps:
        raise ValueError(f"--resume {path} is at step {saved['step']}, not before --steps {args.steps}: "
                         "nothing is left to run")


def adamw_state(optimizer, param) -> dict:
    """AdamW's state of one parameter: its moments and step count (zeros before its first step, as
    AdamW would create them)."""
    state = optimizer.state.get(param) or {}
    return {"exp_avg": state.get("exp_avg", torch.zeros_like(param)),
            "exp_avg_sq": state.get("exp_avg_sq", torch.zeros_like(param)),
            "step": state.get("step", torch.zeros(()))}


def entries(run):
    """(global name, parameter, the tensor AdamW steps for it) of each of this rank's parameters."""
    return [(name, p, p) for name, p in run.model.named_parameters()]


def state_of(run, step: int, copies=True) -> dict:
    """This rank's part of the checkpoint, as DCP saves it and loads into it (in place): TP shards as
    DTensors; without `copies`, no entry of a `shared` copy (save writes the original only)."""
    items = [(name, p, stepped) for name, p, stepped in entries(run) if copies or not getattr(p, "shared", False)]
    mesh = DeviceMesh.from_group(run.pgm.tp_group, run.device.type) if run.pgm.tp > 1 else None
    return {"model": {name: sharded(stepped.detach(), p, mesh) for name, p, stepped in items},
            "optimizer": {name: {key: sharded(value, p, mesh)
                                for key, value in adamw_state(run.optimizer, stepped).items()}
                          for name, p, stepped in items},
            "run": json.dumps(facts(run.args, step))}


def sharded(tensor, param, mesh):
    """A TP rank's slice of param (or of its AdamW moment) as a DTensor, Shard(tp_split_dim) of the TP group;
    a tensor that is whole on every TP rank (a norm gain, AdamW's step count) as it is."""
    dim = getattr(param, "tp_split_dim", None)
    if mesh is None or dim is None or tensor.dim() == 0:
        return tensor
    return DTensor.from_local(tensor, mesh, [Shard(dim)], run_check=False)  # shares tensor's storage


def due(args, step: int) -> bool:
    """Whether the run saves after `step` optimizer steps: every --save-every, and after the last."""
    return bool(args.save) and (step == args.steps or bool(args.save_every) and step % args.save_every == 0)


def save(run, step: int):
    """Write the checkpoint of `step` (optimizer steps done) into --save, every rank its own entries,
    then mark it complete and keep the newest --keep (all ranks call it)."""
    root, rank = run.args.save, dist.get_rank()
    final = folder_of(root, step)
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(final + ".tmp", ignore_errors=True)  # a save that a crash cut short
    dist.barrier()  # the .tmp folder is empty before anyone writes into it
    dcp.save(state_of(run, step, copies=False), checkpoint_id=final + ".tmp")
    dist.barrier()  # every rank has written its file, and rank 0 the index
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)  # a resumed run may save a step again
        os.rename(final + ".tmp", final)  # complete: --resume may read it from now on
        for old in complete(root)[:-run.args.keep]:
            shutil.rmtree(old)


def load(run, path: str) -> int:
    """Load the checkpoint at path into this rank's parameters and optimizer; returns its step."""
    state = state_of(run, 0)
    dcp.load(state, checkpoint_id=path)  # reads this rank's entries, whichever ranks wrote them
    for name, _, stepped in entries(run):
        run.optimizer.state[stepped] = {key: value.to_local() if isinstance(value, DTensor) else value
                                        for key, value in state["optimizer"][name].items()}
    return json.loads(state["run"])["step"]

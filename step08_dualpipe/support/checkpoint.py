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

A checkpoint is complete or absent. DCP writes into DIR/step00000006.tmp. Once every rank has
written, rank 0 writes record.json last, each file's bytes and CRC-32, then renames the folder to
DIR/step00000006, one atomic rename, and prints one line: step, folder, bytes, seconds. A run killed
in the middle of a save leaves a .tmp folder, which --resume never reads. --resume DIR takes the
newest folder whose files match their record, and says which newer ones it skipped and why;
--resume DIR/step00000004 takes that one or refuses it. A folder without record.json, saved before
the course wrote one, is taken unchecked (the line says so). A save that fails (a full disk, a folder
made read-only) stops the run with one line: going on, it could no longer keep what it computes. The
data is a function of the step (data.get_batch), so the step index is all a resumed run needs.

Step 06: a TP rank holds a slice of each split parameter under the whole parameter's name. It is
saved as what it is, a DTensor sharded along its `tp_split_dim` over the TP group's DeviceMesh, so
that DCP records where the slice sits in the whole tensor, writes each slice once, and a load at
another --tp (or in one process) takes the slices it needs and joins them. A copy of a parameter
that another rank also holds (`shared`: the tied embedding's copy on the last stage) is not saved
twice; it loads the same entry as the original.

Step 07: what AdamW steps are the fp32 master weights, so they are what a checkpoint holds under
each name (in bf16 or fp16 the stages' parameters are their casts, made again on load), with their
moments, and the loss scaler's state among the facts. A checkpoint thus loads in any --precision,
except into fp16's dynamic loss scaler from a run that had none: its scale would be a guess.

Step 08: DualPipe's reverse-direction copy of a stage, which another rank holds as its forward-direction
stage, is marked `shared` (train.build): it is saved once, by that rank, and loads the same entry.
"""
import json
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
import zlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from support import outputs
from support.distributed import progress
from model import ModelConfig

NAME = re.compile(r"step(\d{8})")  # a complete checkpoint's folder; DCP's .tmp folders do not match
RECORD = "record.json"  # written last into a checkpoint: {"files": {name: {"bytes": n, "crc32": c}}, ...}
SHAPE_FLAGS = ("layers", "hidden", "heads", "tie_embeddings")  # fix the model's shape, with the vocabulary


def folder_of(root: str, step: int) -> str:
    """The checkpoint of `step` under root; zero-padded, so that the names sort by step."""
    return os.path.join(root, f"step{step:08d}")


def complete(root: str) -> list:
    """The complete checkpoints in root, oldest first: folders renamed from .tmp, with DCP's index."""
    names = sorted(n for n in os.listdir(root) if NAME.fullmatch(n)) if os.path.isdir(root) else []
    return [os.path.join(root, n) for n in names if os.path.isfile(os.path.join(root, n, ".metadata"))]


def newest(path: str):
    """The checkpoint --resume path names, before check_flags has checked it: path itself if it is a folder
    stepNNNNNNNN (check_flags puts the one it chose into args.resume), else the newest such folder in path."""
    found = candidates(path)
    return found[0] if found else None


def candidates(path: str) -> list:
    """The checkpoints --resume path may take, newest first: path itself if it is a folder stepNNNNNNNN,
    else the folders stepNNNNNNNN in it."""
    if NAME.fullmatch(os.path.basename(os.path.normpath(path))):
        return [path]
    names = sorted((n for n in os.listdir(path) if NAME.fullmatch(n)), reverse=True) if os.path.isdir(path) else []
    return [os.path.join(path, n) for n in names]


def crc32(path: str) -> int:
    """The CRC-32 of a file's bytes, read a MiB at a time."""
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(2**20):
            value = zlib.crc32(chunk, value)
    return value


def fault(folder: str):
    """Why a checkpoint folder cannot be taken (a file missing, or of other bytes than its record says), or None."""
    if not os.path.isdir(folder):
        return "it is a file, not a folder" if os.path.exists(folder) else "it does not exist"
    try:
        with open(os.path.join(folder, RECORD)) as f:
            files = json.load(f)["files"]
    except FileNotFoundError:  # saved before checkpoints had a record: only DCP's index can be looked for
        return None if os.path.isfile(os.path.join(folder, ".metadata")) else f"it has no {RECORD}"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"its {RECORD} cannot be read ({err})"
    for name, want in files.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        if os.path.getsize(path) != want["bytes"]:
            return f"{name} has {os.path.getsize(path)} bytes, its record says {want['bytes']}"
        if crc32(path) != want["crc32"]:
            return f"{name} does not match the CRC-32 in its record"
    return None


def choose(path: str):
    """(the checkpoint --resume path takes, the line that says so): the newest candidate that passes its
    check, naming each newer one skipped and why. A ValueError when none passes."""
    found, skipped = candidates(path), []
    if not os.path.exists(path) or os.path.isfile(path):
        what = "is a file" if os.path.exists(path) else "does not exist"
        raise ValueError(f"--resume {path} {what}: give the --save folder of a run, or one checkpoint in it")
    if not found:
        raise ValueError(f"--resume {path} holds no checkpoint: no folder stepNNNNNNNN in it (a .tmp folder is a "
                         "save that never finished)")
    for folder in found:
        why = fault(folder)
        if why is None:
            how = "" if os.path.isfile(os.path.join(folder, RECORD)) else f" unchecked (it has no {RECORD})"
            return folder, f"resuming from {folder}{how}" + "".join(f"; skipped {s}" for s in skipped)
        skipped.append(f"{os.path.basename(os.path.normpath(folder))}: {why}")
    if found == [path]:  # named by hand: that one or none
        raise ValueError(f"--resume {path} fails its check: {why}")
    raise ValueError(f"--resume {path}: no checkpoint passes its check ({'; '.join(skipped)})")


def cause(err: BaseException) -> str:
    """The first sentence of the error underneath: of the first rank's failure, for DCP's CheckpointException."""
    if isinstance(err, CheckpointException):
        err = next(iter(err.failures.values()))[0]
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0].split('. ')[0] if text else ''}"


def facts(args, step: int) -> dict:
    """What a checkpoint records besides tensors: its step, and the flags that fix the model's shape."""
    return dict(step=step, vocab_size=ModelConfig.vocab_size, precision=args.precision,
                **{flag: getattr(args, flag) for flag in SHAPE_FLAGS})


def read_facts(path: str) -> dict:
    """A checkpoint's facts, read by one process before any process group exists (config.py); a ValueError
    naming the file and DCP's message when they cannot be read."""
    state = {"run": ""}
    try:
        meta = dcp.FileSystemReader(path).read_metadata()
    except Exception as err:  # whatever unpickling garbage raises
        raise ValueError(f"--resume {os.path.join(path, '.metadata')} cannot be read: {cause(err)}") from None
    try:
        with warnings.catch_warnings():  # DCP warns that it loads in a single process: that is the intent
            warnings.simplefilter("ignore")
            dcp.load(state, checkpoint_id=path, no_dist=True)
        return json.loads(state["run"])
    except (Exception, CheckpointException) as err:
        where = [info.relative_path for index, info in meta.storage_data.items() if index.fqn == "run"]
        raise ValueError(f"--resume {os.path.join(path, *where[:1])} cannot be read: {cause(err)}") from None


def add_flags(p):
    """The flags of this module, a group of their own in train.py's --help."""
    group = p.add_argument_group("checkpoint", "saving the run and resuming it (checkpoint.py)")
    group.add_argument("--save", default=None, metavar="DIR", help="save checkpoints into this folder")
    group.add_argument("--save-every", type=int, default=None, metavar="N",
                       help="save every N optimizer steps (default: only after the last)")
    group.add_argument("--keep", type=int, default=2,
                       help="keep the newest K checkpoints in --save up to each one saved (a newer one, of "
                       "another run, stays)")
    group.add_argument("--resume", default=None, metavar="DIR",
                       help="go on from the newest checkpoint in DIR whose files match their record, or from "
                       "DIR itself if it is one (DIR/stepNNNNNNNN), up to --steps")


def check_flags(args):
    """Refuse, before any work, what a run could only fail at later: a ValueError with one line."""
    if args.save_every is not None and args.save_every < 1 or args.keep < 1:
        raise ValueError(f"--save-every {args.save_every} and --keep {args.keep} must be at least 1")
    if args.save:
        check_save_folder(args.save)
    start = 0  # the step this run starts from
    if args.resume:
        args.resume, line = choose(args.resume)  # from here on, the checkpoint itself
        start = check_resume(args, args.resume)
        if os.environ.get("RANK", "0") == "0":
            print(line, flush=True)
    if args.save and os.environ.get("RANK", "0") == "0":
        note_newer(args.save, start)


def note_newer(root: str, start: int):
    """One line, when --save already holds checkpoints newer than this run's start: another run's, which this run
    leaves as they are (finish prunes only older ones), and which a later --resume of the folder would take."""
    newer = [folder for folder in complete(root) if os.path.basename(folder) > f"step{start:08d}"]
    if newer:
        name = os.path.basename(newer[-1])
        print(f"note: --save {root} holds {len(newer)} checkpoint(s) of another run, newer than this run's start "
              f"(the newest {name}): they stay untouched, --keep prunes only checkpoints older than each one this "
              f"run saves, and --resume {root} takes {name} while it is the newest", file=sys.stderr, flush=True)


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
    """The chosen checkpoint holds this model's shape, and leaves steps to run; returns its step."""
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
    if args.precision == "fp16" and not args.loss_scale and not saved["scaler"]:
        raise ValueError(f"--resume {path} was saved in {saved['precision']} with no dynamic loss scaler, which "
                         "--precision fp16 needs the state of: resume it in bf16 or fp32, or give --loss-scale")
    if saved["step"] >= args.steps:
        raise ValueError(f"--resume {path} is at step {saved['step']}, not before --steps {args.steps}: "
                         "nothing is left to run")
    return saved["step"]


def adamw_state(optimizer, param) -> dict:
    """AdamW's state of one parameter: its moments and step count (zeros before its first step, as
    AdamW would create them)."""
    state = optimizer.state.get(param) or {}
    return {"exp_avg": state.get("exp_avg", torch.zeros_like(param)),
            "exp_avg_sq": state.get("exp_avg_sq", torch.zeros_like(param)),
            "step": state.get("step", torch.zeros(()))}


def entries(run):
    """(global name, parameter, the tensor AdamW steps for it: its fp32 master) of each of this rank's parameters."""
    return [(name, p, master) for (name, p), master in zip(run.model.named_parameters(), run.optimizer.masters)]


def state_of(run, step: int, copies=True) -> dict:
    """This rank's part of the checkpoint, as DCP saves it and loads into it (in place): TP shards as
    DTensors; without `copies`, no entry of a `shared` copy (save writes the original only)."""
    items = [(name, p, stepped) for name, p, stepped in entries(run) if copies or not getattr(p, "shared", False)]
    mesh = DeviceMesh.from_group(run.pgm.tp_group, run.device.type) if run.pgm.tp > 1 else None
    return {"model": {name: sharded(stepped.detach(), p, mesh) for name, p, stepped in items},
            "optimizer": {name: {key: sharded(value, p, mesh)
                                for key, value in adamw_state(run.optimizer.adamw, stepped).items()}
                          for name, p, stepped in items},
            "run": json.dumps(dict(facts(run.args, step), scaler=scaler_state(run)))}


def scaler_state(run):
    """The loss scaler's state (a dynamic scaler's scale and trackers), or None without a scaler."""
    return run.optimizer.scaler.state_dict() if run.optimizer.scaler else None


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
    """Write the checkpoint of `step` (optimizer steps done) into --save, every rank its own entries, then mark
    it complete and keep the newest --keep (all ranks call it). A save that fails stops every rank, one line."""
    root, start = run.args.save, time.perf_counter()
    final = folder_of(root, step)
    try:
        on_rank_0(lambda: clear(root, final))  # the .tmp folder is empty before anyone writes into it
        dcp.save(state_of(run, step, copies=False), checkpoint_id=final + ".tmp")  # back when all have written
        size = on_rank_0(lambda: finish(final, run.args.keep))
    except (OSError, CheckpointException) as err:
        stop(f"error: the checkpoint of step {step} cannot be saved into {root}: {cause(err)}. The run stops: "
             "going on, it could keep nothing it computes; the last checkpoint is "
             f"{progress['checkpoint'] or 'none'}", code=1)
    progress["checkpoint"] = final
    if dist.get_rank() == 0:
        seconds = time.perf_counter() - start
        print(f"checkpoint of step {step} saved: {final}, {size / 2**20:.2f} MiB in {seconds:.2f} s", flush=True)


def clear(root: str, final: str):
    """Rank 0, before a save: the folder exists, and no .tmp folder is left of a save that a crash cut short."""
    os.makedirs(root, exist_ok=True)
    shutil.rmtree(final + ".tmp", ignore_errors=True)


def finish(final: str, keep: int) -> int:
    """Rank 0, once every rank has written: the record last, then the rename that makes the checkpoint complete,
    then only the newest `keep` left. Returns the checkpoint's bytes."""
    files = {name: dict(bytes=os.path.getsize(os.path.join(final + ".tmp", name)),
                        crc32=crc32(os.path.join(final + ".tmp", name))) for name in sorted(os.listdir(final + ".tmp"))}
    outputs.write(os.path.join(final + ".tmp", RECORD), json.dumps(dict(files=files), indent=1))
    if os.path.lexists(final) and not is_checkpoint(final):
        raise FileExistsError(f"{final} exists and is not a checkpoint this course wrote")
    shutil.rmtree(final, ignore_errors=True)  # a resumed run may save a step again
    os.rename(final + ".tmp", final)  # complete: --resume may read it from now on
    for old in pruned(final, keep):
        shutil.rmtree(old)
    return sum(f["bytes"] for f in files.values())


def pruned(final: str, keep: int) -> list:
    """The checkpoints that saving `final` lets go: those older than it, beyond the newest `keep` up to it. A newer
    one (another, longer run's, in the same --save) is never touched, nor is anything not a checkpoint."""
    name = os.path.basename(final)
    return [old for old in complete(os.path.dirname(final)) if os.path.basename(old) <= name][:-keep]


def is_checkpoint(folder: str) -> bool:
    """A folder (not a link) holding DCP's index: a checkpoint this course wrote, which a save may replace."""
    return os.path.isdir(folder) and not os.path.islink(folder) and os.path.isfile(os.path.join(folder, ".metadata"))


def on_rank_0(work):
    """work() on rank 0 alone; every rank gets its result, or raises its OSError: the ranks agree, and none
    waits in a barrier for a rank 0 that failed."""
    box = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = (work(), None)
        except OSError as err:
            box[0] = (None, err)
    dist.broadcast_object_list(box, src=0)  # the others wait here until rank 0 is done
    result, err = box[0]
    if err is not None:
        raise err
    return result


def stop(line: str, code: int):
    """End every rank with rank 0's one line (all ranks call it, as they do after a failed save or load):
    rank 0 prints before the barrier, so no rank exits, and none is stopped by torchrun, before the line is out."""
    if dist.get_rank() == 0:
        print(line, file=sys.stderr, flush=True)
    dist.barrier()
    sys.stdout.flush()
    os._exit(code)  # as distributed.shutdown: no teardown


def load(run, path: str) -> int:
    """Load the checkpoint at path into this rank's parameters and optimizer; returns its step."""
    state = state_of(run, 0)
    try:
        dcp.load(state, checkpoint_id=path)  # reads this rank's entries, whichever ranks wrote them
    except (OSError, ValueError, AssertionError, CheckpointException) as err:  # every rank gets DCP's verdict
        stop(f"error: --resume {path} cannot be loaded: {cause(err)}", code=2)
    progress.update(step=json.loads(state["run"])["step"], checkpoint=path)
    for name, p, stepped in entries(run):
        run.optimizer.adamw.state[stepped] = {key: value.to_local() if isinstance(value, DTensor) else value
                                              for key, value in state["optimizer"][name].items()}
        if stepped is not p:
            with torch.no_grad():
                p.copy_(stepped)  # cast to the half type, as MixedPrecisionOptimizer.step does
    saved = json.loads(state["run"])
    if run.optimizer.scaler and saved["scaler"]:
        run.optimizer.scaler.load_state_dict(saved["scaler"])
    return saved["step"]

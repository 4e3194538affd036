"""Command-line flags and the rules they must obey.

Every rule is checked before any process group, model or data is built, so a
bad configuration fails in a second with one line that names the flag, the
value and the rule, instead of hanging half-way through a pipeline.
"""
import argparse
import os

from data import DEFAULT_CORPUS_BYTES
from p2p import ORDERINGS
from schedule import SCHEDULES


class ConfigError(ValueError):
    """A flag value that breaks a rule of the run."""


def build_parser():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--pp", type=int, default=None, help="pipeline stages (default: world size / dp)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the pipeline")
    p.add_argument("--batch-size", type=int, default=8, help="global sequences per optimizer step")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per batch (m)")
    p.add_argument("--recompute", action="store_true",
                   help="keep only each stage's input and recompute its forward during backward")
    p.add_argument("--virtual-stages", type=int, default=1, help="model chunks per rank (v)")
    p.add_argument("--schedule", default=None,
                   help="afab | 1f1b | interleaved (default: interleaved if --virtual-stages > 1, else 1f1b)")
    p.add_argument("--p2p", default="batched", help="batched | ordered: how a send and a receive are paired")
    p.add_argument("--deallocate", action="store_true",
                   help="free each output's storage once it is sent, keeping its autograd graph")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--data", default=None, help="a text file (default: the Python stdlib source)")
    p.add_argument("--log-json", default=None, help="write one JSON object per optimizer step here")
    p.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace of the timeline here")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a rank waits for a peer")
    return p


def positive(args, *flags):
    for flag in flags:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value < 1:
            raise ConfigError(f"{flag} {value} must be at least 1")


def check_device(device: str, cuda_available: bool):
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device {device} is unknown: use auto, cpu or cuda")
    if device == "cuda" and not cuda_available:
        raise ConfigError("--device cuda was asked for but no CUDA device is available")


def check_model(args):
    if args.hidden % args.heads:
        raise ConfigError(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    if (args.hidden // args.heads) % 2:
        raise ConfigError(f"--hidden {args.hidden} / --heads {args.heads} must be even for rotary embedding")
    chunks = args.pp * args.virtual_stages
    if chunks > args.layers:
        raise ConfigError(f"--pp {args.pp} x --virtual-stages {args.virtual_stages} = {chunks} model chunks "
                          f"cannot share --layers {args.layers}: each chunk needs a layer")


def check_schedule(args):
    """The schedule and the pipeline shape must fit together."""
    if args.schedule not in SCHEDULES:
        raise ConfigError(f"--schedule {args.schedule} is unknown: use {' or '.join(SCHEDULES)}")
    if args.p2p not in ORDERINGS:
        raise ConfigError(f"--p2p {args.p2p} is unknown: use {' or '.join(ORDERINGS)}")
    interleaved = args.schedule == "interleaved"
    if interleaved != (args.virtual_stages > 1):
        raise ConfigError(f"--virtual-stages {args.virtual_stages} does not fit --schedule {args.schedule}: "
                          "interleaved needs at least 2 virtual stages, afab and 1f1b exactly 1")
    if not interleaved:
        return
    if args.pp < 2:
        raise ConfigError(f"--pp {args.pp} is too few for the interleaved schedule: it needs at least 2 stages")
    if args.microbatches % args.pp:
        raise ConfigError(f"--microbatches {args.microbatches} must be a multiple of --pp {args.pp} "
                          "for the interleaved schedule")
    if args.p2p == "ordered":
        # Even/odd ordering pairs one exchange between two neighbours. An interleaved exchange talks to
        # both ring neighbours at once, and tests/replay.py finds cyclic waits (odd pp: ranks pp-1 and 0
        # share a parity; m = pp >= 6 too). Posting everything together is always safe.
        raise ConfigError("--p2p ordered cannot run the interleaved schedule: its exchanges with both ring "
                          "neighbours at once can deadlock under even/odd ordering; use --p2p batched")


def check_data(args):
    if args.data and not os.path.isfile(args.data):
        raise ConfigError(f"--data {args.data} is not a file")
    size = os.path.getsize(args.data) if args.data else DEFAULT_CORPUS_BYTES
    if size < args.seq_len + 2:
        raise ConfigError(f"--data {args.data} has {size} bytes, fewer than --seq-len {args.seq_len} + 2")


def check_config(args, world_size: int, cuda_available: bool):
    """Fill in defaults that depend on the world size, then enforce every rule."""
    if args.pp is None:
        args.pp = max(world_size // max(args.dp, 1), 1)
    if args.schedule is None:
        args.schedule = "interleaved" if args.virtual_stages > 1 else "1f1b"
    positive(args, "--pp", "--dp", "--batch-size", "--microbatches", "--virtual-stages", "--seq-len", "--layers",
             "--hidden", "--heads", "--steps")
    if args.pp * args.dp != world_size:
        raise ConfigError(f"--pp {args.pp} x --dp {args.dp} = {args.pp * args.dp} must equal the world size "
                          f"{world_size} (torchrun --nproc_per_node)")
    if args.batch_size % (args.dp * args.microbatches):
        raise ConfigError(f"--batch-size {args.batch_size} must be a multiple of --dp {args.dp} x --microbatches "
                          f"{args.microbatches} = {args.dp * args.microbatches}: every microbatch of every "
                          "replica holds the same number of sequences")
    check_schedule(args)
    check_device(args.device, cuda_available)
    check_model(args)
    check_data(args)
    return args

"""Command-line flags and the rules they must obey.

Every rule is checked before any process group, model or data is built, so a
bad configuration fails in a second with one line that names the flag, the
value and the rule, instead of hanging half-way through a pipeline. Under
torchrun every rank parses the flags; only rank 0 prints.
"""
import argparse
import math
import os
import sys
import time
from contextlib import redirect_stderr, redirect_stdout

import torch

from support import checkpoint
from support.budget import machine_need, memory_available, stage_bytes
from data import DEFAULT_CORPUS_BYTES
from support.distributed import world_from_env
from mixed_precision import DTYPES as PRECISIONS
from model import ModelConfig
from p2p import ORDERINGS
import dualpipe
import experts
import pipedream
import schedule
from support import outputs
import action_lists
import schedule_lab


class ConfigError(ValueError):
    """A flag value that breaks a rule of the run."""


REFUSAL_WAIT_S = 60.0  # how long a rank other than 0 waits for torchrun to stop it after a refusal (refuse)
MIN_TIMEOUT_S = 1.0  # --timeout's floor: the start-up's rendezvous runs under the same timeout
MAX_TIMEOUT_S = 1e9  # its ceiling: gloo and NCCL hold it in 64-bit nanoseconds (at most 9.2e9 s)
MAX_SEED = (2**64 - 2**32) // 1_000_003  # model.py seeds with seed * 1_000_003 + crc32(name) < 2**64
ADD_ONS = (pipedream, dualpipe, schedule_lab)  # the schedule families beside schedule.py, each with its own flags and rules
SCHEDULE_NAMES = [name for module in (schedule, *ADD_ONS) for name in module.SCHEDULES]


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors (--pp x, an unknown flag) are refusals like any other: one line, exit 2."""

    def error(self, message):
        """argparse's own errors as a ConfigError: one line that ends the run, as the course's rules do."""
        raise ConfigError(f"{message} (see --help)")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help as train.py's docstring lays it out (the launch line on a line of its own), and each flag's
    default after its help, unless the help already says it or there is none to say."""

    def _get_help_string(self, action):
        if action.default is None or "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser(description=None):
    """The step's flags in argparse groups, with their defaults; check_config holds the rules between them."""
    p = Parser(description=description, formatter_class=HelpFormatter)
    group = p.add_argument_group("pipeline", "how the model is cut into stages and scheduled")
    group.add_argument("--pp", type=int, default=None, help="pipeline stages (default: world size / (tp x dp))")
    group.add_argument("--microbatches", type=int, default=4, help="microbatches per batch (m)")
    group.add_argument("--schedule", default=None,
                       help=" | ".join(SCHEDULE_NAMES) + " (default: interleaved if --virtual-stages > 1, else "
                            "1f1b; pipedream and pipedream-2bw never flush: pipedream.py)")
    group.add_argument("--virtual-stages", type=int, default=1, help="model chunks per rank (v)")
    group.add_argument("--recompute", action="store_true",
                       help="keep only each stage's input and recompute its forward during backward")
    group.add_argument("--p2p", default="batched", help="batched | ordered: how paired sends and receives are posted")
    group.add_argument("--deallocate", action="store_true",
                       help="free each output's storage once it is sent, keeping its autograd graph "
                       "(always on with dualpipe and dualpipev, as in DeepSeek's code)")
    for add_on in ADD_ONS:
        add_on.add_flags(group)
    group = p.add_argument_group("parallelism", "data and tensor parallelism beside the pipeline")
    group.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the pipeline")
    group.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks that split each stage's layers")
    group.add_argument("--scatter-gather", action="store_true",
                       help="each TP rank sends 1/tp of every pipeline message; the receivers all-gather it")
    experts.add_flags(p)
    group = p.add_argument_group("precision", "number formats and the loss scale")
    group.add_argument("--precision", default="fp32", help="fp32 | bf16 | fp16: the type of the stages' weights, "
                       "activations and pipeline messages (fp32 master weights and gradient sums either way)")
    group.add_argument("--initial-loss-scale", type=float, default=2.0**16,
                       help="fp16: the dynamic loss scaler's first scale (Megatron-LM starts at 2**32)")
    group.add_argument("--min-loss-scale", type=float, default=1.0, help="fp16: the scale never goes below this")
    group.add_argument("--loss-scale-window", type=int, default=1000,
                       help="fp16: clean steps after which the scale doubles")
    group.add_argument("--hysteresis", type=int, default=2,
                       help="fp16: overflows since the last growth before the scale halves")
    group.add_argument("--loss-scale", type=float, default=None,
                       help="a constant loss scale instead of the dynamic one")
    group.add_argument("--clip-grad", type=float, default=0.0,
                       help="clip the gradients to this global norm (0: no clipping)")
    group = p.add_argument_group("model", "the transformer's size")
    group.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    group.add_argument("--layers", type=int, default=8, help="decoder layers of the whole model")
    group.add_argument("--hidden", type=int, default=128, help="width of the hidden states")
    group.add_argument("--heads", type=int, default=4, help="attention heads")
    group.add_argument("--tie-embeddings", action="store_true",
                       help="the LM head reuses the embedding matrix (summed over the first and last stage)")
    group = p.add_argument_group("run", "what is trained, for how long, where")
    group.add_argument("--batch-size", type=int, default=8, help="global sequences per optimizer step")
    group.add_argument("--steps", type=int, default=20, help="optimizer steps")
    group.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    group.add_argument("--seed", type=int, default=0, help="seed of the weights and of the batches")
    group.add_argument("--device", default="auto", help="auto | cpu | cuda")
    group.add_argument("--data", default=None, help="a text file (default: the Python stdlib source)")
    group.add_argument("--timeout", type=float, default=120.0,
                       help="seconds a rank waits for a peer before failing (at least 1). "
                       "It must exceed the longest wait "
                       "of the schedule: a message's trip through the other stages and back, about (p-1) x (F+B) with "
                       "F and B one stage's forward and backward of one microbatch, and the slowest rank's start-up")
    group = p.add_argument_group("output", "what the run writes besides its report")
    group.add_argument("--log-json", default=None, help="write one JSON object per optimizer step here")
    group.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace of the timeline here")
    checkpoint.add_flags(p)
    return p


def parse_flags(argv, description):
    """Flags -> checked args. --help prints on rank 0 only; a usage error or a broken rule ends every rank
    with one `error:` line (refuse)."""
    rank, world, _ = world_from_env()
    parser = build_parser(description)
    try:
        with open(os.devnull, "w") as sink, redirect_stdout(sink if rank else sys.stdout), \
                redirect_stderr(sink if rank else sys.stderr):
            args = parser.parse_args(argv)  # exits 0 after --help; a malformed flag raises ConfigError
        return check_config(args, world, torch.cuda.device_count())
    except ConfigError as err:
        refuse(err, rank)


def refuse(err, rank: int):
    """Print the one `error:` line and exit 2, in an order that makes the line certain under torchrun.

    When one worker exits with an error, torchrun's agent stops all the others (SIGTERM). A rank that was
    to print after a peer had exited could be stopped first, and nobody printed the line. So rank 0 alone
    exits at once, after its line is written; every other rank waits, and torchrun stops it once rank 0
    has exited. Whatever the order in which the ranks get here, the first to exit has printed the line:
    no race is left to lose. A rank still waiting after REFUSAL_WAIT_S (started without torchrun, or rank 0
    accepted the flags: ranks can disagree, e.g. on free memory) prints the line itself and exits.
    """
    if rank:
        time.sleep(REFUSAL_WAIT_S)
    print(f"error: {err}" + (f" (rank {rank})" if rank else ""), file=sys.stderr, flush=True)
    sys.exit(2)


def positive(args, *flags):
    """Refuse each flag in `flags` whose value is not positive (nan included), naming the flag and the value."""
    for flag in flags:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if not value > 0:  # also refuses nan
            raise ConfigError(f"{flag} {value} must be positive")


def check_device(args, world: int, gpus: int):
    """Decide the device once per node, the same way on every rank, from what every rank of the node sees
    alike: a node of NCCL and gloo ranks could not train. Each rank takes the GPU of its local index, so
    CUDA needs a GPU per rank of the node. Refuse an unknown --device, and --device cuda short of GPUs;
    --device auto then falls back to the CPU, and the node's first rank says why in one line."""
    if args.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device {args.device} is unknown: use auto, cpu or cuda")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # this node's ranks (torchrun --nproc_per_node)
    if args.device == "cuda" and not gpus:
        raise ConfigError("--device cuda was asked for but no CUDA device is available")
    if args.device == "cuda" and gpus < local_world:
        raise ConfigError(f"--device cuda needs a GPU for each of the {local_world} ranks on this node, which has "
                          f"{gpus}: start at most {gpus} (torchrun --nproc_per_node), or use --device cpu")
    if args.device == "auto":
        args.device = "cuda" if gpus and gpus >= local_world else "cpu"
        if gpus and args.device == "cpu" and world_from_env()[2] == 0:
            print(f"note: --device auto runs on the CPU with gloo: this node has {gpus} GPUs for its {local_world} "
                  f"ranks, one each is needed (--device cuda refuses)", file=sys.stderr, flush=True)


def check_model(args):
    """Refuse a model this step cannot build as flagged; each message names the flags and the rule."""
    if args.hidden % args.heads:
        raise ConfigError(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    if (args.hidden // args.heads) % 2:
        raise ConfigError(f"--hidden {args.hidden} / --heads {args.heads} must be even for rotary embedding")
    chunks = args.pp * args.virtual_stages
    if chunks > args.layers:
        raise ConfigError(f"--pp {args.pp} x --virtual-stages {args.virtual_stages} = {chunks} model chunks "
                          f"cannot share --layers {args.layers}: each chunk needs a layer")
    if args.schedule in pipedream.SCHEDULES and args.tie_embeddings and args.pp > 1:
        raise ConfigError(f"--tie-embeddings with --pp {args.pp} does not fit --schedule {args.schedule}: the first "
                          "and last stage would have to sum their copies' gradients at every update, but "
                          "PipeDream's stages update at different times, each on versions of its own")


def check_tensor_parallel(args):
    """Every split of a layer must give each TP rank an equal part."""
    cfg = ModelConfig(hidden=args.hidden)
    for what, size in ((f"--heads {args.heads}", args.heads), (f"the MLP width {cfg.mlp_hidden}", cfg.mlp_hidden),
                       (f"the vocabulary size {cfg.vocab_size}", cfg.vocab_size)):
        if size % args.tp:
            raise ConfigError(f"--tp {args.tp} must divide {what}: each TP rank holds an equal share of it")


def check_zb1p(args):
    """ZB-H1's hand-made order assumes a steady state on every stage, and its two exchanges per
    microbatch (B's gradient out before W, the next input in after it) need batched p2p."""
    if args.microbatches < args.pp:
        raise ConfigError(f"--microbatches {args.microbatches} must be at least --pp {args.pp} for zb1p: with "
                          "fewer, stage 0 has no steady state and the order idles longer than its (p-1)(F+B-W)")
    if args.p2p != "batched" and args.pp > 1:
        raise ConfigError(f"--p2p {args.p2p} does not fit --schedule zb1p: ordered sends deadlock when a stage "
                          "sends a gradient in one exchange and receives an activation in the next; use --p2p batched")


def check_schedule(args):
    """The schedule and the pipeline shape must fit together."""
    if args.schedule not in SCHEDULE_NAMES:
        raise ConfigError(f"--schedule {args.schedule} is unknown: use {', '.join(SCHEDULE_NAMES)}")
    if args.p2p not in ORDERINGS:
        raise ConfigError(f"--p2p {args.p2p} is unknown: use {' or '.join(ORDERINGS)}")
    interleaved = args.schedule == "interleaved"
    if interleaved != (args.virtual_stages > 1):
        raise ConfigError(f"--virtual-stages {args.virtual_stages} does not fit --schedule {args.schedule}: "
                          "interleaved needs at least 2 virtual stages, the other schedules exactly 1")
    if args.schedule == "zb1p":
        check_zb1p(args)
    if not interleaved:
        return
    if args.pp < 2:
        raise ConfigError(f"--pp {args.pp} is too few for the interleaved schedule: it needs at least 2 stages")
    if args.microbatches % args.pp:
        raise ConfigError(f"--microbatches {args.microbatches} must be a multiple of --pp {args.pp} "
                          "for the interleaved schedule")


def check_seed(scale: float, m: int, precision: str):
    """A constant scale S seeds each microbatch's backward with S/m, made in fp32 (the loss's type). Below the
    smallest normal number of the stage precision, the gradients it starts lose their bits or flush to zero (in
    bf16 and fp32, unscaling by 1/S also overflows, and every step is skipped). Above fp32's largest number, S
    is inf in fp32."""
    seed, low, high = scale / m, torch.finfo(PRECISIONS[precision]).tiny, torch.finfo(torch.float32).max
    if seed < low:
        raise ConfigError(f"--loss-scale {scale:g} seeds each backward with --loss-scale / --microbatches = "
                          f"{seed:.3g}, below {low:.3g}, the smallest normal {precision} number: its gradients "
                          "would underflow")
    if scale > high:
        raise ConfigError(f"--loss-scale {scale:g} is above {high:.3g}, fp32's largest number: every scaled "
                          "gradient would overflow and every step be skipped")


def check_precision(args):
    """The number format and its loss scaler."""
    if args.precision not in PRECISIONS:
        raise ConfigError(f"--precision {args.precision} is unknown: use {', '.join(PRECISIONS)}")
    if args.loss_scale is not None and not args.loss_scale > 0:
        raise ConfigError(f"--loss-scale {args.loss_scale} must be positive")
    if args.loss_scale is not None and not math.isfinite(args.loss_scale):
        raise ConfigError(f"--loss-scale {args.loss_scale} must be finite: every scaled gradient would overflow "
                          "and every step be skipped")
    if args.loss_scale is not None:
        check_seed(args.loss_scale, args.microbatches, args.precision)
    low, high = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
    if not low <= args.min_loss_scale <= args.initial_loss_scale <= high:  # S normal in fp32, 1/S finite there
        raise ConfigError(f"--min-loss-scale {args.min_loss_scale} and --initial-loss-scale "
                          f"{args.initial_loss_scale} must satisfy {low:.3g} <= min <= initial <= {high:.3g}, fp32's "
                          "smallest normal and largest numbers: the scale multiplies the loss in fp32, where a scale "
                          "below the smallest normal loses bits and one above the largest is inf, and 1/scale "
                          f"multiplies the gradients (inf below {1 / high:.3g})")
    if args.loss_scale_window < 1 or args.hysteresis < 1:
        raise ConfigError(f"--loss-scale-window {args.loss_scale_window} and --hysteresis {args.hysteresis} "
                          "must be at least 1")
    if not 0 <= args.clip_grad < math.inf:
        raise ConfigError(f"--clip-grad {args.clip_grad} must be 0 (off) or a positive global norm")
    if args.schedule in pipedream.SCHEDULES and (args.precision != "fp32" or args.clip_grad or args.loss_scale):
        flag = (f"--precision {args.precision}" if args.precision != "fp32" else
                f"--clip-grad {args.clip_grad}" if args.clip_grad else f"--loss-scale {args.loss_scale}")
        raise ConfigError(f"{flag} does not fit --schedule {args.schedule}: the loss scale, its overflow skip "
                          "and the clipping norm belong to one optimizer step shared by every stage, but "
                          "PipeDream's stages step alone, at different times, each with a plain AdamW and no "
                          "scaler (fp32, no loss scale, no clipping only)")


def check_files(args):
    """The data must be a file, and every output have somewhere to go that holds nothing of the user's, before
    the run rather than after it (support/outputs.py: one rule for every file the course writes)."""
    if args.data and not os.path.isfile(args.data):
        problem = "is a directory" if os.path.isdir(args.data) else "is not a regular file" \
            if os.path.exists(args.data) else "does not exist"
        raise ConfigError(f"--data {args.data} {problem}: give a text file")
    size, source = ((os.path.getsize(args.data), f"--data {args.data}") if args.data
                    else (DEFAULT_CORPUS_BYTES, "the default corpus"))
    if size < args.seq_len + 2:
        raise ConfigError(f"{source} has {size} bytes, fewer than --seq-len {args.seq_len} + 2")
    inputs = [("--data", args.data), ("--resume", getattr(args, "resume", None)),
              ("--schedule-file", getattr(args, "schedule_file", None))]
    problem = outputs.check_all(outputs_of(args), inputs, getattr(args, "save", None))
    if problem:
        raise ConfigError(problem)


def outputs_of(args) -> list:
    """What a run writes: (flag, path or None, kind, the test of the course's mark for that kind)."""
    return [("--log-json", args.log_json, "log", outputs.is_log), ("--trace", args.trace, "trace", outputs.is_trace),
            ("--dump-schedule", args.dump_schedule, "schedule list", action_lists.is_list)]


def check_numbers(args):
    """Refuse a count that is not positive, a learning rate or timeout that is not finite, a timeout too short for
    the start-up, and a seed too large for the weights' generators."""
    positive(args, "--pp", "--microbatches", "--virtual-stages", "--dp", "--tp",
             "--batch-size", "--seq-len", "--layers", "--hidden", "--heads",
             "--steps", "--lr", "--timeout")
    if not math.isfinite(args.lr) or not math.isfinite(args.timeout):
        raise ConfigError(f"--lr {args.lr} and --timeout {args.timeout} must be finite")
    if args.timeout < MIN_TIMEOUT_S:
        raise ConfigError(f"--timeout {args.timeout} must be at least {MIN_TIMEOUT_S:g} s: it also bounds the "
                          "start-up, where every rank must reach the rendezvous and connect to its peers")
    if args.timeout > MAX_TIMEOUT_S:
        raise ConfigError(f"--timeout {args.timeout:g} must be at most {MAX_TIMEOUT_S:g} s: gloo and NCCL count it "
                          "in nanoseconds in a 64-bit integer")
    if not 0 <= args.seed <= MAX_SEED:
        raise ConfigError(f"--seed {args.seed} must be between 0 and {MAX_SEED}: the weights' generators are "
                          "seeded with seed x 1000003 + a 32-bit hash, which must fit in 64 bits")


def check_memory(args, world: int):
    """Refuse a run whose memory lower bound (budget.py) exceeds what this machine, or each GPU, has."""
    device = args.device  # cpu or cuda, as check_device decided
    _, _, local_rank = world_from_env()
    per_stage = [sum(b.values()) for b in stages_bytes(args)]
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    need = machine_need(per_stage, world // args.pp, world, local_world, device)
    limit, source = memory_available(device, local_rank)
    if need > limit:
        where = "on the largest stage's GPU" if device == "cuda" else f"for the {min(local_world, world)} ranks " \
            "on this machine"
        raise ConfigError(f"--batch-size {args.batch_size} --seq-len {args.seq_len} --hidden {args.hidden} "
                          f"--layers {args.layers} need at least {need / 2**30:.1f} GiB {where} (parameters, "
                          "AdamW state and the activations of the schedule's peak; budget.py), more than the "
                          f"{limit / 2**30:.1f} GiB available ({source})")


def family(args):
    """The module that runs and describes args.schedule: the add-on whose SCHEDULES has it, else schedule.py
    (flushed); train.py and report.py ask it, not the name. Each has SCHEDULES (name -> function(stages, comm,
    microbatches)), bubble_formula(args), peak_stored_microbatches(args, stage), stage_class(args, model,
    before_update), train_steps(run, flushed_steps, *pieces), peaks(run) and report_lines(args, record, ...)."""
    return next((add_on for add_on in ADD_ONS if args.schedule in add_on.SCHEDULES), schedule)


def model_chunks(args, stage: int):
    """(this rank's global model chunks, how many in all), as args.schedule's family places them. PipeDream
    (v = 1) places them as 1F1B does, so schedule.py answers for it."""
    module = family(args)
    return (schedule if module is pipedream else module).model_chunks(args, stage)


def stages_bytes(args):
    """budget.stage_bytes of each stage, holding the peak stored (chunk, microbatch) pairs of its schedule's
    formula, each of a chunk of layers / chunks layers, chunks the model's (model_chunks)."""
    module = family(args)
    mine, chunks = model_chunks(args, 0)
    return [stage_bytes(args, module.peak_stored_microbatches(args, s)[1], chunks, len(mine)) for s in range(args.pp)]


def check_config(args, world_size: int, gpus: int):
    """Fill in defaults that depend on the world size, then enforce every rule."""
    if args.pp is None:
        args.pp = max(world_size // max(args.dp * args.tp, 1), 1)
    if args.schedule is None:
        args.schedule = "file" if args.schedule_file else "interleaved" if args.virtual_stages > 1 else "1f1b"
    check_numbers(args)
    if args.tp * args.pp * args.dp != world_size:
        raise ConfigError(f"--tp {args.tp} x --pp {args.pp} x --dp {args.dp} = {args.tp * args.pp * args.dp} "
                          f"must equal the world size {world_size} (torchrun --nproc_per_node)")
    if args.batch_size % (args.dp * args.microbatches):
        raise ConfigError(f"--batch-size {args.batch_size} must be a multiple of --dp {args.dp} x --microbatches "
                          f"{args.microbatches} = {args.dp * args.microbatches}: every microbatch of every "
                          "replica holds the same number of sequences")
    check_schedule(args)
    check_device(args, world_size, gpus)
    try:  # each add-on's own flags and rules
        for add_on in ADD_ONS:
            add_on.check_flags(args, gpus)
        experts.check_flags(args)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    check_model(args)
    check_tensor_parallel(args)
    check_precision(args)
    check_files(args)
    try:  # --save must be writable, and --resume hold a checkpoint this run can continue
        checkpoint.check_flags(args)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    check_memory(args, world_size)
    return args

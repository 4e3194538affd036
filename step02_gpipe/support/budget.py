"""The memory a run needs, estimated from its flags before start-up, and the memory there is.

A run too large for its machine should fail in a second with one line, not after minutes of
allocator tracebacks or of swapping. The estimate is a lower bound, so that a run it refuses
cannot fit; it counts, for each stage,

- 16 bytes per parameter of its decoder layers: the fp32 weight, its gradient and AdamW's two
  moments (the embedding and the head, and step 07's fp32 masters beside half weights, are extra);
- the activations autograd saves for one microbatch in one decoder layer (layer_activations,
  read off model.py's forward), times the layers of a model chunk, times the (chunk, microbatch)
  pairs the schedule's own formula says the stage holds at its peak; with --recompute a stored
  microbatch keeps only its stage input, of hidden numbers per token.

Not counted: Python and torch themselves (a few hundred MB per process), the temporaries of the
pass that runs, receive buffers, PipeDream's stashed weight versions, the allocator's slack.
"""
import os

import torch

from model import ModelConfig

PARAMETER_BYTES = 16  # fp32 weight, gradient, AdamW's exp_avg and exp_avg_sq


def layer_activations(tokens: int, hidden: int, mlp_hidden: int, heads: int, tp: int = 1) -> int:
    """Numbers one decoder layer saves for the backward of a microbatch of `tokens` tokens (model.py).

    The two RMSNorms each keep their input, its normalised value and the per-token rms: 4 x hidden + 2 per
    token. Attention keeps q and k before and after rotary, v, the attention output and the copy with the
    heads side by side that wo reads (7 x hidden), and SDPA's log-sum-exp (one per head); the SwiGLU keeps
    gate, silu(gate), up and their product (4 x mlp_hidden). TP splits the heads and the MLP width.
    """
    return tokens * (4 * hidden + 2 + (7 * hidden + heads + 4 * mlp_hidden) // tp)


def stage_bytes(args, stored: int, chunks: int, held: int = 1) -> dict:
    """Lower bounds, in bytes, of one stage's parameter memory and of its peak activations.

    stored: the (chunk, microbatch) pairs the stage holds at its peak (the schedule's formula); chunks: the
    model chunks the model is cut into (pp x v); held: the chunks one rank holds (v; 2 in DualPipe)."""
    tp, m = getattr(args, "tp", 1), getattr(args, "microbatches", 1)
    mlp_hidden = ModelConfig(hidden=args.hidden).mlp_hidden
    per_chunk = args.layers // chunks  # an uneven split gives the first chunks one layer more
    layer_params = (4 * args.hidden * args.hidden + 3 * args.hidden * mlp_hidden) // tp + 2 * args.hidden
    tokens = args.batch_size // (getattr(args, "dp", 1) * m) * args.seq_len  # of one microbatch
    if getattr(args, "recompute", False):
        saved = tokens * args.hidden  # the stage input alone
    else:
        saved = per_chunk * layer_activations(tokens, args.hidden, mlp_hidden, args.heads, tp)
    element = 2 if getattr(args, "precision", "fp32") in ("bf16", "fp16") else 4
    return dict(parameters=PARAMETER_BYTES * layer_params * per_chunk * held, activations=element * stored * saved)


def memory_available(device: str, local_rank: int):
    """(bytes, where they were read) this rank may use: its GPU's free memory on CUDA, else the
    machine's (or its cgroup's, if lower) available memory, which every rank of the machine shares."""
    if device == "cuda":
        return torch.cuda.mem_get_info(local_rank)[0], f"free on cuda:{local_rank}"
    limit, source = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "physical memory"
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        limit, source = int(fields["MemAvailable"].split()[0]) * 1024, "MemAvailable"
    except (OSError, KeyError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            cap = f.read().strip()
        if cap.isdigit() and int(cap) < limit:
            limit, source = int(cap), "the cgroup's memory.max"
    except OSError:
        pass
    return limit, source


def machine_need(per_stage, ranks_per_stage: int, world: int, local_world: int, device: str) -> int:
    """What must fit in the memory_available of one rank: on CUDA the largest stage's own (each rank has its
    GPU), on CPU the sum over the ranks that share this machine (all of them on one machine; on several,
    local_world times the smallest stage's, a lower bound)."""
    if device == "cuda":
        return max(per_stage)
    if local_world >= world:
        return ranks_per_stage * sum(per_stage)
    return local_world * min(per_stage)

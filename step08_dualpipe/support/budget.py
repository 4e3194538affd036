"""The memory a run needs, estimated from its flags before start-up, and the memory there is.

A run too large for its machine should fail in a second with one line, not after minutes of
allocator tracebacks or of swapping. The estimate is a lower bound, so that a run it refuses
cannot fit; it counts, for each stage,

- 16 bytes per parameter of its decoder layers: the fp32 weight, its gradient and AdamW's two
  moments (the embedding and the head, and step 07's fp32 masters beside half weights, are extra);
  with experts (experts.py) a layer holds E/ep SwiGLU experts and a router instead of one SwiGLU,
  and a rank's dispatched activations are its expert group's mean (a lower bound of their sum);
- the activations autograd saves for one microbatch in one decoder layer (layer_activations,
  read off model.py's forward), times the layers of a model chunk, times the (chunk, microbatch)
  pairs the schedule's own formula says the stage holds at its peak; with --recompute a stored
  microbatch keeps only its stage input, of hidden numbers per token.

Not counted: Python and torch themselves (a few hundred MB per process), the temporaries of the
pass that runs, receive buffers, PipeDream's stashed weight versions, the allocator's slack.

The time of a step is estimated the same way, before the first one (report.open_log): its matrix
products and its attention, in FLOPs, each divided by the rate a short probe of that kernel measures.
"""
import os
import resource
import time

import torch
import torch.nn.functional as F

from model import ModelConfig

PARAMETER_BYTES = 16  # fp32 weight, gradient, AdamW's exp_avg and exp_avg_sq


def layer_activations(tokens: int, hidden: int, mlp_hidden: int, heads: int, tp: int = 1, k: int = 0) -> int:
    """Numbers one decoder layer saves for the backward of a microbatch of `tokens` tokens (model.py).

    The two RMSNorms each keep their input, its normalised value and the per-token rms: 4 x hidden + 2 per
    token. Attention keeps q and k before and after rotary, v, the attention output and the copy with the
    heads side by side that wo reads (7 x hidden), and SDPA's log-sum-exp (one per head); the SwiGLU keeps
    gate, silu(gate), up and their product (4 x mlp_hidden). TP splits the heads and the MLP width.
    With k > 0 (experts.py, top-k) each token is dispatched to k experts: k rows of hidden numbers reach the
    experts, each kept with its SwiGLU's 4 x mlp_hidden, and k rows come back, kept to be weighted by the router.
    Under expert parallelism the rows a rank receives depend on the routing: this is their mean over the group.
    """
    mlp = k * (2 * hidden + 4 * mlp_hidden) if k else 4 * mlp_hidden
    return tokens * (4 * hidden + 2 + (7 * hidden + heads + mlp) // tp)


def stage_bytes(args, stored: int, chunks: int, held: int = 1) -> dict:
    """Lower bounds, in bytes, of one stage's parameter memory and of its peak activations.

    stored: the (chunk, microbatch) pairs the stage holds at its peak (the schedule's formula); chunks: the
    model chunks the model is cut into (pp x v); held: the chunks one rank holds (v; 2 in DualPipe)."""
    tp, m = getattr(args, "tp", 1), getattr(args, "microbatches", 1)
    mlp_hidden = ModelConfig(hidden=args.hidden).mlp_hidden
    per_chunk = args.layers // chunks  # an uneven split gives the first chunks one layer more
    experts, k = getattr(args, "experts", 0), getattr(args, "top_k", 0)  # experts.py: E/ep experts and a router
    mlp_params = 3 * args.hidden * mlp_hidden * (experts // getattr(args, "ep", 1) if experts else 1)
    layer_params = (4 * args.hidden * args.hidden + mlp_params) // tp + 2 * args.hidden + experts * args.hidden
    tokens = args.batch_size // (getattr(args, "dp", 1) * m) * args.seq_len  # of one microbatch
    if getattr(args, "recompute", False):
        saved = tokens * args.hidden  # the stage input alone
    else:
        saved = per_chunk * layer_activations(tokens, args.hidden, mlp_hidden, args.heads, tp, k if experts else 0)
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
    return address_space_limit(limit, source)


def address_space_limit(limit: int, source: str):
    """(limit, source), lowered to what `ulimit -v` (RLIMIT_AS) leaves the ranks of this machine: each process
    may map its limit less what it maps already (torch alone maps a few GiB). The sum over the ranks bounds
    their sum, as machine_need counts it."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return limit, source
    try:
        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        mapped = 0
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    left = ranks * max(soft - mapped, 0)
    if left < limit:
        return left, f"ulimit -v of {soft / 2**30:.1f} GiB per process, {mapped / 2**30:.1f} GiB of it mapped already"
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


def step_flops(args) -> tuple:
    """(matrix-product FLOPs, attention FLOPs) of one optimizer step on the busiest rank: its decoder layers'
    forward, backward (twice the forward) and, with --recompute, a second forward, for its replica's tokens.
    Causal attention computes half of the seq_len x seq_len scores, 2 x 2 FLOPs per score and hidden unit."""
    tp, dp = getattr(args, "tp", 1), getattr(args, "dp", 1)
    mlp_hidden = ModelConfig(hidden=args.hidden).mlp_hidden
    layers = -(-args.layers // args.pp)  # the first stages hold one layer more
    sequences = args.batch_size // dp
    passes = 4 if getattr(args, "recompute", False) else 3
    k = getattr(args, "top_k", 1) if getattr(args, "experts", 0) else 1  # experts.py: each token runs k experts
    weights = (4 * args.hidden * args.hidden + 3 * args.hidden * mlp_hidden * k) // tp
    products = passes * 2 * weights * sequences * args.seq_len * layers
    attention = passes * 2 * args.seq_len * args.seq_len * args.hidden // tp * sequences * layers
    return products, attention


def probe_rates(args, device, dtype, seconds: float = 0.1) -> tuple:
    """(matrix-product, attention) FLOP/s measured on device in dtype: each kernel run for about `seconds`, at
    a size of the run's own (a microbatch's rows, its heads, up to 1024 of its positions)."""
    head_dim = args.hidden // args.heads
    rows, positions = min(args.seq_len, 1024), min(args.seq_len, 1024)
    x = torch.randn(rows, args.hidden, device=device, dtype=dtype)
    w = torch.randn(args.hidden, args.hidden, device=device, dtype=dtype)
    q = torch.randn(1, args.heads, positions, head_dim, device=device, dtype=dtype)
    return (rate(lambda: x @ w, 2 * rows * args.hidden * args.hidden, device, seconds),
            rate(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True),
                 2 * positions * positions * args.hidden, device, seconds))


def rate(kernel, flops: int, device, seconds: float) -> float:
    """FLOP/s of kernel (flops each call), timed over repeated calls for about `seconds`, after one warm-up."""
    kernel()
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    sync()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        kernel()
        sync()
        calls += 1
    return calls * flops / (time.perf_counter() - start)

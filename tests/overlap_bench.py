"""Is step 08's overlap real? The overlapped pairs beside the sequential ones, as paired rounds in one launch.

    torchrun --nproc_per_node 4 tests/overlap_bench.py step08_dualpipe OUT.json ROUNDS [train.py flags]
    e.g. ... 5 --device cpu --pp 2 --dp 2 --experts 4 --top-k 2 --ep 2 --schedule dualpipev --layers 4 \\
         --microbatches 4 --hidden 64 --seq-len 64 --link-latency-ms 20

Each rank builds the step's own run (train.build). Each round runs one training step with --pairs overlapped
and one with --pairs sequential, in alternating order (round 0 warms up and is not counted). From the
timeline of each step, per rank: the time spent waiting for dispatches and combines (exposed), and, for the
overlapped step, the link time its compute can cover: for each pair, the shorter of its two lanes (compute
boxes inside the pair, and posts x latency). Rank 0 prints and writes the medians per rank, and the check
the issue sets: exposed(sequential) - exposed(overlapped) >= coverable / 2 on every rank.

A benchmark, not a unit test: on a shared 2-core CPU the numbers vary from run to run.
"""
import json
import os
import statistics
import sys


def step_numbers(events, step: int, latency: float, overlap) -> dict:
    """This rank's exposed all-to-all time and coverable link time in one step, in ms."""
    mine = [e for e in events if e["step"] == step]
    exposed = sum(e["end"] - e["start"] for e in mine if e["kind"] == overlap.WAIT)
    coverable = 0.0
    for pair in (e for e in mine if e["kind"] == "F&B"):
        inside = [e for e in mine if pair["start"] <= e["start"] and e["end"] <= pair["end"]]
        compute = sum(e["end"] - e["start"] for e in inside if e["kind"] in overlap.COMPUTE)
        coverable += min(compute, latency * sum(e["kind"] == overlap.POST for e in inside))
    return dict(exposed_ms=exposed * 1e3, coverable_ms=coverable * 1e3)


def main(step_dir, out, rounds, *flags):
    sys.path.insert(0, os.path.abspath(step_dir))
    import torch
    import torch.distributed as dist
    import overlap
    import train

    torch.set_num_threads(1)
    args = train.parse_args(list(flags))
    run = train.build(args, train.init_distributed(args.device, args.timeout))
    run.timeline.enabled = True
    per_mode = {"overlapped": [], "sequential": []}
    step = 0
    for r in range(int(rounds) + 1):
        for mode in (("overlapped", "sequential") if r % 2 else ("sequential", "overlapped")):
            run.args.pairs = mode  # compute_gradients reads the schedule's pairs at each step
            train.train_step(run, step)
            numbers = step_numbers(run.timeline.events, step, overlap.Link.latency_s, overlap)
            if r:
                per_mode[mode].append(numbers)
            step += 1
    mine = {mode: {k: statistics.median(n[k] for n in rows) for k in rows[0]} for mode, rows in per_mode.items()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        lines = [f"median over {rounds} paired rounds, link {overlap.Link.latency_s * 1e3:g} ms, ms per step:"]
        for rank, m in enumerate(every):
            gain = m["sequential"]["exposed_ms"] - m["overlapped"]["exposed_ms"]
            half = m["overlapped"]["coverable_ms"] / 2
            lines.append(f"  rank {rank}: exposed sequential {m['sequential']['exposed_ms']:.1f}, overlapped "
                         f"{m['overlapped']['exposed_ms']:.1f}, gain {gain:.1f} vs half the coverable "
                         f"{half:.1f}: {'ok' if gain >= half else 'BELOW'}")
        print("\n".join(lines))
        json.dump(dict(flags=list(flags), rounds=int(rounds), ranks=every), open(out, "w"), indent=1)
    train.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])

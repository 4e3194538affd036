"""One rank of the schedules-as-data check (step 08's schedule_lab.py). Started by test_schedule_lab.py.

    python tests/check_lab_lists.py STEP_DIR OUT_DIR CASES_JSON

Each case is a list of train.py flags naming a hand-written schedule. The rank runs one step of it
with its timeline on, turns the computes the timeline recorded into a list of actions
(schedule_lab.events_to_plan; rank 0 writes it as OUT_DIR/caseI.csv), then runs that list from the
file (--schedule-file) on a fresh build with the same seed, and compares the two runs' gradients
bitwise. Control: the list run on the next batch must differ. Rank 0 writes OUT_DIR/report.json:
per case, [bitwise equal, control differs] of every rank.
"""
import json
import os
import sys
from pathlib import Path

import torch


def gradients(run):
    return {n: p.grad.detach().clone() for n, p in run.model.named_parameters() if p.grad is not None}


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def check_case(train, schedule_lab, model_chunks, dist, device, flags, path: Path):
    """[the list's gradients bitwise the function's, the control's differ] on this rank."""
    args = train.parse_args([*flags, "--steps", "1"])
    run = train.build(args, device)
    train.instrument(run, 0)  # one step: the timeline records it
    train.compute_gradients(run, 0)
    by_function = gradients(run)
    events = [None] * dist.get_world_size()
    dist.all_gather_object(events, run.timeline.events)
    plan = schedule_lab.events_to_plan([e for rank in events for e in rank], lambda r: model_chunks(args, r)[0])
    if dist.get_rank() == 0:
        schedule_lab.write_schedule(str(path), plan)
    dist.barrier()
    kept = [f for i, f in enumerate(flags) if f not in ("--schedule", "--virtual-stages")
            and flags[i - 1] not in ("--schedule", "--virtual-stages")]
    listed = train.build(train.parse_args([*kept, "--steps", "1", "--schedule-file", str(path)]), device)
    train.compute_gradients(listed, 0)
    by_list = gradients(listed)
    train.compute_gradients(listed, 1)  # control: the next batch
    return [same(by_function, by_list), not same(by_function, gradients(listed))]


def main(step_dir: str, out_dir: str, cases_json: str):
    sys.path.insert(0, os.path.abspath(step_dir))
    torch.set_num_threads(1)
    from support import distributed
    import schedule_lab
    import torch.distributed as dist
    import train
    from config import model_chunks

    device = distributed.init_distributed("cpu", 60)
    out, report = Path(out_dir), {}
    for i, flags in enumerate(json.loads(cases_json)):
        result = check_case(train, schedule_lab, model_chunks, dist, device, flags, out / f"case{i}.csv")
        results = [None] * dist.get_world_size()
        dist.all_gather_object(results, result)
        report[" ".join(flags)] = results
    if dist.get_rank() == 0:
        (out / "report.json").write_text(json.dumps(report))
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])

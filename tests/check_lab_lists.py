"""One rank of the schedules-as-data check (step 08's schedule_lab.py). Started by test_schedule_lab.py.

    python tests/check_lab_lists.py STEP_DIR OUT_DIR CASES_JSON

Each case is a list of train.py flags naming a schedule. The rank runs train.py's own loop for one step with
--dump-schedule OUT_DIR/caseI.csv (train.train, as `python train.py FLAGS --dump-schedule ...` would: the file
the flag writes), then, on fresh builds with the same seed, one step by the schedule's function and one by that
file (--schedule-file), and compares the two runs' gradients bitwise. Control: the list run on the next batch
must differ. Rank 0 writes OUT_DIR/report.json: per case, [bitwise equal, control differs] of every rank.
The process group is made once for all the cases (train.init_distributed is replaced by the device).
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


def check_case(train, device, flags, path: Path):
    """[the dumped list's gradients bitwise the function's, the control's differ] on this rank."""
    train.train(train.parse_args([*flags, "--steps", "1", "--dump-schedule", str(path)]))
    run = train.build(train.parse_args([*flags, "--steps", "1"]), device)
    train.compute_gradients(run, 0)
    by_function = gradients(run)
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
    import torch.distributed as dist
    import train

    device = distributed.init_distributed("cpu", 60)
    train.init_distributed = lambda choice, timeout: device
    out, report = Path(out_dir), {}
    for i, flags in enumerate(json.loads(cases_json)):
        result = check_case(train, device, flags, out / f"case{i}.csv")
        results = [None] * dist.get_world_size()
        dist.all_gather_object(results, result)
        report[" ".join(flags)] = results
    if dist.get_rank() == 0:
        (out / "report.json").write_text(json.dumps(report))
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])

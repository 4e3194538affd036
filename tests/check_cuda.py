"""One process of a step's train.py on CUDA, watched. Started by tests/test_cuda.py (through harness.launch).

    python tests/check_cuda.py STEP_DIR REPORT_JSON [--synchronizing] -- TRAIN_FLAGS...

Runs the step's own train.main(TRAIN_FLAGS) in this process, with torch.cuda.synchronize,
torch.cuda.Event.elapsed_time (the reading of a stamp) and the timeline's start_step and end_step wrapped,
so that every call lands, in order, in one log:

    ["start", step, enabled, wall time of the call]   Timeline.start_step is called
    ["sync", "file.py:function"]                      torch.cuda.synchronize, and who called it
    ["read"]                                          a CUDA event's stamp is read (elapsed_time)
    ["end", step]                                     Timeline.end_step is called
    ["ended", step, wall time of the return]          Timeline.end_step returns

and writes {"log": [...], "events": the timeline's events as end_step made them, "on_cuda": bool} to
REPORT_JSON. --synchronizing is the control: a timeline that synchronizes at every span, which test_cuda's
check must reject.
"""
import json
import os
import sys
import time
from pathlib import Path


def main(step_dir: str, report_path: str, control: list, flags: list):
    sys.path.insert(0, os.path.abspath(step_dir))
    import torch

    from support import timeline
    import train

    log, lines = [], []
    synchronize, elapsed_time = torch.cuda.synchronize, torch.cuda.Event.elapsed_time
    start_step, end_step, span = timeline.Timeline.start_step, timeline.Timeline.end_step, timeline.Timeline.span

    def watched_synchronize(*args, **kwargs):
        caller = sys._getframe(1).f_code
        log.append(["sync", f"{Path(caller.co_filename).name}:{caller.co_name}"])
        return synchronize(*args, **kwargs)

    def watched_elapsed_time(self, end):
        log.append(["read"])
        return elapsed_time(self, end)

    def watched_start_step(self, step):
        if self not in lines:
            lines.append(self)
        log.append(["start", step, self.enabled, time.time()])
        return start_step(self, step)

    def watched_end_step(self):
        log.append(["end", self.step])
        end_step(self)
        log.append(["ended", self.step, time.time()])

    def synchronizing_span(self, kind, microbatch=None, **info):
        if self.enabled:
            torch.cuda.synchronize()
        return span(self, kind, microbatch, **info)

    torch.cuda.synchronize, torch.cuda.Event.elapsed_time = watched_synchronize, watched_elapsed_time
    timeline.Timeline.start_step, timeline.Timeline.end_step = watched_start_step, watched_end_step
    if "--synchronizing" in control:
        timeline.Timeline.span = synchronizing_span
    shutdown = train.shutdown

    def report_then_shutdown():  # train.main ends in distributed.shutdown, which leaves through os._exit
        with open(report_path, "w") as f:
            json.dump(dict(log=log, events=[e for line in lines for e in line.events],
                           on_cuda=bool(lines) and all(line.on_cuda for line in lines)), f)
        shutdown()

    train.shutdown = report_then_shutdown
    train.main(flags)


if __name__ == "__main__":
    cut = sys.argv.index("--")
    main(sys.argv[1], sys.argv[2], sys.argv[3:cut], sys.argv[cut + 1:])

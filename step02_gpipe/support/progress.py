"""Where a rank is, for the one line of a run that ends early, and Ctrl-C's line from the first instant.

Loading torch takes seconds. A Ctrl-C then would end each rank with Python's KeyboardInterrupt traceback
from inside torch's import. So train.py, run as a program, calls stop_on_ctrl_c before it imports anything
else, and this module imports nothing but the standard library. The handler reads the rank from torchrun's
environment, not from torch.distributed: torch may be half-imported when it runs.
"""
import os
import signal

# The step running (report.log_step moves it on) and the last checkpoint saved or loaded (checkpoint.py, step 03
# on); `since` is when the step began.
progress = dict(step=0, checkpoint=None, since=0.0)


def interrupted(signum, frame):
    """Ctrl-C (SIGINT, which torchrun passes on to every rank): rank 0 says where the run was, and every rank
    exits with 130 at once, as a shell reports an interrupted command; no rank waits on the others."""
    if os.environ.get("RANK", "0") == "0":
        where = progress["checkpoint"] or "none (no --save, or nothing saved yet)"
        os.write(2, f"interrupted at step {progress['step']}; the last checkpoint is {where}\n".encode())
    os._exit(130)


def stop_on_ctrl_c():
    """From now on, Ctrl-C ends this process with interrupted's line and exit code 130."""
    signal.signal(signal.SIGINT, interrupted)

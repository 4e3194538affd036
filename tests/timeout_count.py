"""The timeout line's count of messages starts again at every step (replay.py calls check_timeout_count).

A stalled peer's line names "activation k of this step": k is the microbatch the rank waited for, so it
must count from 0 in every step. Over the replay's fake transport, the step's real PipelineComm (stage 1 of 2)
receives the m activations of one step; in the next step its first receive times out, as a process group's
wait does when the peer has stopped. The line must say activation 0. Control: a comm whose begin_step leaves
the count as it was must say activation m, and be caught.
"""
from replay import FakeDist, Work

M = 4  # microbatches of the first step


class TimingOutDist(FakeDist):
    """FakeDist whose waits raise, as torch.distributed's do when the timeout expires, once `expire` is set."""

    def __init__(self):
        super().__init__()
        self.expire = False

    def _post(self, group):
        works = super()._post(group)
        return [TimingOutWork(work.op, work.log, self) for work in works]


class TimingOutWork(Work):
    def __init__(self, op, log, dist):
        super().__init__(op, log)
        self.dist = dist

    def wait(self, timeout=None):
        if self.dist.expire:
            raise RuntimeError("wait timed out")
        return super().wait(timeout)


def timeout_line(step, keep_count=False):
    """The line a stage-1 rank's first receive of its second step times out with."""
    dist = TimingOutDist()
    dist.rank = 1
    real = step.p2p.dist
    step.p2p.dist = step.groups.dist = dist
    try:
        pgm = step.groups.ProcessGroupManager(2, 1, timeout_s=1)
        comm = step.p2p.PipelineComm(pgm, (3,), step.p2p.torch.float32, "cpu")
        if keep_count:  # the control: a new step that does not count from zero again
            comm.begin_step = comm.finish_sends
        comm.begin_step()
        for _ in range(M):
            comm.recv_forward()
        comm.begin_step()
        dist.expire = True
        try:
            comm.recv_forward()
        except step.p2p.PeerTimeout as timeout:
            return str(timeout)
        return "no timeout"
    finally:
        step.p2p.dist = step.groups.dist = real


def check_timeout_count(step):
    """The report's part: the line of the course's comm, and whether the control's line is caught."""
    line, control = timeout_line(step), timeout_line(step, keep_count=True)
    return dict(timeout_count_problem=None if "activation 0 of this step" in line else line,
                timeout_count_control_caught="activation 0 of this step" not in control)

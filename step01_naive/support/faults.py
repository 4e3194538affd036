"""A peer that died or stalled, named in one line.

A peer fails in one of two ways. Its process dies (kill -9, a crash): the
operating system closes its connections, and a rank exchanging with it learns
at once ("Connection closed by peer"), long before any timeout. Or it stalls
(kill -STOP, a hang, one compute longer than --timeout): its connections stay
open, and a rank waiting on it gives up only when --timeout expires. A waiting
rank cannot tell by itself whether the peer it waits for stalled or waits in
turn for another: in a pipeline rank 0 waits for rank 1, which waits for rank 2,
so each would blame its neighbour, whichever rank stopped.

So each rank shows a sign of life in the rendezvous store (the TCPStore that
torchrun, or rank 0, runs for init_process_group): a daemon thread writes the
time every `interval` seconds. A stopped process stops all its threads, so its
beat ages; a rank waiting on a peer keeps beating. A rank that gives up reads
every beat and names the ranks silent for longer than STALE_BEATS intervals.
The training loop itself does nothing for this: the beat costs it one store
write per interval from another thread. A rank that ends on a fault leaves its
verdict in the store, so a rank that next finds this one's connection closed
repeats the first cause instead of blaming the messenger.
"""
import atexit
import os
import re
import threading
import time
from datetime import timedelta
from functools import partial

import torch.distributed as dist

STALE_BEATS = 4  # a rank silent for this many beat intervals has stalled (or died)
GONE_BEATS = 2  # of two peers, one of whose connections closed, the one silent this long is gone (the other beats)
LINGER_S = 20.0  # at most this long rank 0 keeps the store for the others (linger)
READ_TIMEOUT_S = 10.0  # how long a reading rank waits for the store itself (a loaded machine answers slowly)
# What a failed wait says. gloo: "Connection closed by peer" or "reset by peer" once a peer's process ended,
# "Timed out waiting 4000ms for recv operation to complete" once --timeout expired. NCCL, in PyTorch 2.13's
# torch/csrc/distributed/c10d: a peer ended or the network failed, NCCLUtils.cpp getNcclErrorDetailStr
# ("ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.");
# --timeout expired, ProcessGroupNCCL.cpp WorkNCCL::checkTimeout ("Watchdog caught collective operation timeout:
# WorkNCCL(...) ran for 4000 milliseconds before timing out."), which work.wait() raises only under
# TORCH_NCCL_BLOCKING_WAIT=1 (WorkNCCL::wait); else the watchdog logs it and aborts the process. A later call on
# the aborted communicator says "NCCL communicator was aborted on rank 1.  Original reason for failure was: ..."
# (NCCLUtils.cpp NCCLComm::getNcclComm), so the original reason decides.
CLOSED = re.compile(r"connection (closed|reset) by peer|broken pipe|remote process exiting prematurely", re.IGNORECASE)
TIMED_OUT = re.compile(r"timed out|before timing out", re.IGNORECASE)


class PeerTimeout(RuntimeError):
    """A peer did not answer within --timeout; the message says who waited for what."""


class PeerGone(RuntimeError):
    """A peer's connection closed (its process ended); `peers` are the ranks this rank was exchanging with."""

    def __init__(self, message: str, peers):
        super().__init__(message)
        self.peers = list(peers)


def kind_of(err: BaseException):
    """'timeout' for an expired timeout, 'gone' for a closed connection (gloo's or NCCL's words), None for any
    other error, which then goes on with its own message."""
    if isinstance(err, PeerTimeout):
        return "timeout"
    if isinstance(err, PeerGone) or CLOSED.search(str(err)):
        return "gone"
    return "timeout" if TIMED_OUT.search(str(err)) else None


class Heartbeat:
    """This rank's sign of life in the store, and what it reads there when something fails."""

    def __init__(self, store, rank: int, world: int, timeout_s: float):
        self.rank, self.world = rank, world
        self.interval = min(1.0, timeout_s / 8)  # at least STALE_BEATS / 2 beats fit in one --timeout
        self.beat_store, self.read_store = store.clone(), store.clone()  # one connection per thread
        self.beat_store.set_timeout(timedelta(seconds=max(READ_TIMEOUT_S, timeout_s)))
        self.read_store.set_timeout(timedelta(seconds=READ_TIMEOUT_S))
        self.stopped = threading.Event()
        self.beat_store.set(f"beat/{rank}", repr(time.time()))  # a first beat before any work
        self.thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self.thread.start()

    def _beat(self):
        while not self.stopped.wait(self.interval):
            try:
                self.beat_store.set(f"beat/{self.rank}", repr(time.time()))
            except RuntimeError:  # the store is slow or gone; keep trying, a later beat may land
                self.stopped.wait(self.interval)

    def silences(self) -> dict:
        """{rank: seconds since its last beat} for every other rank that has beaten."""
        keys = {r: f"beat/{r}" for r in range(self.world) if r != self.rank}
        present = {r: key for r, key in keys.items() if self.read_store.check([key])}
        values = self.read_store.multi_get(list(present.values())) if present else []
        return {r: time.time() - float(v) for r, v in zip(present, values)}

    def verdicts(self, ranks) -> dict:
        """{rank: (kind, culprit)} for the ranks among `ranks` that ended on a fault and said whom it was."""
        found = {}
        for r in ranks:
            if self.read_store.check([f"verdict/{r}"]):
                kind, culprit = self.read_store.get(f"verdict/{r}").decode().split()
                found[r] = kind, int(culprit)
        return found

    def leave_verdict(self, kind: str, culprits):
        """Before this rank ends: whom it blames, for the ranks that will find its connection closed."""
        if len(culprits) == 1:
            try:
                self.read_store.set(f"verdict/{self.rank}", f"{kind} {culprits[0]}")
            except RuntimeError:
                pass


_heartbeat = None


def start_heartbeat(timeout_s: float):
    """Begin this rank's beat in the default process group's store (after init_process_group)."""
    global _heartbeat
    store = dist.distributed_c10d._get_default_store()
    _heartbeat = Heartbeat(store, dist.get_rank(), dist.get_world_size(), timeout_s)
    atexit.register(stop_heartbeat)


def stop_heartbeat():
    """End the beat before the store's host may exit (shutdown calls it before its last barrier)."""
    if _heartbeat is not None:
        _heartbeat.stopped.set()
        _heartbeat.thread.join(timeout=READ_TIMEOUT_S)


def stalled_verdict(heartbeat, timeout_s: float) -> str:
    """Who stalled, read from the beats: 'rank 2 stalled (silent for 4.1 s)', or why no rank is named.
    A silent rank that left a verdict ended on a fault: its culprit is named instead."""
    silent = {r: s for r, s in heartbeat.silences().items() if s > STALE_BEATS * heartbeat.interval}
    ended = heartbeat.verdicts(silent)
    quiet = sorted(r for r in silent if r not in ended)
    if quiet:
        heartbeat.leave_verdict("stalled", quiet)
        return " and ".join(f"rank {r}" for r in quiet) + " stalled (silent for " + \
            ", ".join(f"{silent[r]:.1f} s" for r in quiet) + ")"
    if ended:
        return ended_verdict(heartbeat, ended, timeout_s, closed=False)
    return "every rank still shows a sign of life: a deadlock, or one compute longer than --timeout"


def ended_verdict(heartbeat, ended, timeout_s: float, closed: bool) -> str:
    """The culprit that a rank which ended on a fault named before it ended, e.g. 'rank 2 stalled (rank 1 gave
    up on it after --timeout 4 s and ended)'; closed: this rank found that rank's connection closed."""
    via = min(ended)
    kind, culprit = ended[via]
    heartbeat.leave_verdict(kind, [culprit])
    if kind == "stalled":
        return f"rank {culprit} stalled (rank {via} gave up on it after --timeout {timeout_s:g} s and ended)"
    return f"rank {culprit} is gone (rank {via} ended on it)" + (", no timeout expired" if closed else "")


def gone_verdict(heartbeat, peers, timeout_s: float) -> str:
    """Which of `peers` (one of whose connections closed) is gone: a peer that ended on a fault left its
    verdict; else a sole peer is the one; among several, the one whose beat ages (waited for a few
    intervals). 'rank 2 is gone (its connection closed)'. A peer silent since well before the connection
    closed stalled instead, and the connection was that of a rank that gave up waiting on it."""
    caught, deadline = time.time(), time.monotonic() + (GONE_BEATS + 2) * heartbeat.interval
    while True:
        ended, silences = heartbeat.verdicts(peers), heartbeat.silences()
        if ended:
            return ended_verdict(heartbeat, ended, timeout_s, closed=True)
        stalled = [r for r, s in silences.items() if s > time.time() - caught + STALE_BEATS * heartbeat.interval]
        if stalled:
            heartbeat.leave_verdict("stalled", stalled)
            return (f"{' and '.join(f'rank {r}' for r in stalled)} stalled (silent for "
                    f"{', '.join(f'{silences[r]:.1f} s' for r in stalled)}; a rank waiting on it gave up after "
                    f"--timeout {timeout_s:g} s)")
        silent = [r for r, s in silences.items() if r in peers and s > GONE_BEATS * heartbeat.interval]
        found = peers if len(peers) == 1 else silent if len(silent) == 1 else None
        if found or time.monotonic() > deadline:
            heartbeat.leave_verdict("gone", found or [])
            named = " or ".join(f"rank {r}" for r in found or peers)
            return f"{named} is gone (its connection closed), no timeout expired"
        time.sleep(heartbeat.interval)


def unanswered_verdict(kind: str, peers) -> str:
    """The verdict when the store does not answer: without torchrun it runs in rank 0, so rank 0 is the one."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return "rank 0 stalled or is gone (the store it runs does not answer)"
    if kind == "gone":
        return f"{' or '.join(f'rank {r}' for r in peers)} is gone (its connection closed), no timeout expired"
    return "the store does not answer, so the rank that stalled is not known"


def ask_store(question, seconds: float):
    """question() in a thread, with this process's stderr silenced meanwhile (a store whose host died makes
    c10d print a page of C++ frames); None if it does not answer in time (a stopped host never does)."""
    answer, saved, null = [], os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        thread = threading.Thread(target=lambda: answer.append(question()), daemon=True)
        thread.start()
        thread.join(seconds)
    finally:
        os.dup2(saved, 2)
        os.close(saved), os.close(null)
    return answer[0] if answer else None


def linger():
    """Without torchrun the store runs in rank 0: before rank 0 ends on a fault, let the other ranks read it.
    Rank 0 waits (at most LINGER_S) until each other rank has left its verdict or fallen silent."""
    if _heartbeat is None or _heartbeat.rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return
    deadline = time.monotonic() + LINGER_S
    while time.monotonic() < deadline:
        try:
            silences = _heartbeat.silences()
        except RuntimeError:
            return
        waiting = [r for r, s in silences.items() if s < STALE_BEATS * _heartbeat.interval]
        if not waiting or set(_heartbeat.verdicts(waiting)) == set(waiting):
            return
        time.sleep(_heartbeat.interval)


def one_line(err: BaseException, timeout_s: float):
    """The one line that says what happened, or None if `err` is not a peer's fault:
    a timeout says what this rank waited for, then who stalled; a closed connection who is gone, then
    what this rank was doing."""
    kind = kind_of(err)
    if kind is None or not dist.is_initialized():
        return None
    me, world = dist.get_rank(), dist.get_world_size()
    peers = err.peers if isinstance(err, PeerGone) else [r for r in range(world) if r != me]
    verdict = None
    if _heartbeat is not None:
        question = (partial(gone_verdict, _heartbeat, peers, timeout_s) if kind == "gone" else
                    partial(stalled_verdict, _heartbeat, timeout_s))
        polling = (GONE_BEATS + 3) * _heartbeat.interval if kind == "gone" else 0
        verdict = ask_store(question, polling + READ_TIMEOUT_S)
    verdict = verdict or unanswered_verdict(kind, peers)
    if kind == "gone":
        doing = str(err) if isinstance(err, PeerGone) else f"rank {me} was in a blocking send, receive or collective"
        return f"error: {verdict}: {doing}"
    doing = (str(err) if isinstance(err, PeerTimeout) else
             f"rank {me} waited in vain in a blocking send, receive or collective")
    return f"error: {doing} (--timeout {timeout_s:g} s); {verdict}"

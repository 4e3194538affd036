"""Point-to-point communication between neighbouring pipeline stages.

The four verbs of every pipeline schedule (names as in Megatron-LM):

    recv_forward   receive this microbatch's input activation from the previous stage
    send_forward   send this stage's output activation to the next stage
    recv_backward  receive d(loss)/d(output) from the next stage
    send_backward  send d(loss)/d(input) to the previous stage

Every transfer is posted one way, the way DeepSeek's DualPipe code posts its
own: the schedule queues it (queue_send, queue_recv), and `commit` posts the
queue, in one batch_isend_irecv, and waits for what it receives. The four verbs
are thin wrappers over it: each is one call of `communicate`, Megatron's
`_communicate`, which queues, in Megatron's order, an activation for the next
rank, the receive of an activation from the previous one, a gradient for the
previous rank and the receive of a gradient from the next one (each optional),
then commits. Later steps combine several of these in one call; the mechanism
stays the same. At the ends of the pipeline the verbs do nothing (a receive
returns None): the first stage reads tokens, the last stage starts from its loss.

The combined verbs of 1F1B, each one exchange:

    send_forward_recv_backward   send the newest output, receive the gradient of the oldest microbatch
    send_backward_recv_forward   send an input gradient, receive the next microbatch's input

In the steady state stage s sends an activation to s+1 while s+1 sends a
gradient to s: if each waited for its send to complete before receiving, both
would wait for ever (NCCL sends of large tensors block until matched; we must
assume every send can). `commit` posts its queue one of two ways (--p2p):

    batched  batch_isend_irecv: the sends and receives as one fused operation.
    ordered  Megatron's even/odd rule (its _p2p_ops): isend and irecv one by one,
             activations before gradients, even stages sending first and odd ones
             receiving first, then wait for all. Under tests/replay.py's model,
             which completes each rank's operations in the order posted,
             neighbours of opposite parity meet, first with first. The model is
             exact for this code: distributed.py passes device_id, so NCCL starts
             eagerly, and then a lone isend or irecv runs on the group's one
             communicator (PyTorch PR #132900), serialised with the rank's others.

Non-blocking receives, the two verbs of the interleaved schedule:

    irecv_forward    post the receive of an input activation from the previous rank
    irecv_backward   post the receive of an output gradient from the next rank

Each returns as soon as its receive is posted, with the function that waits for
it (commit's wait=False). The schedule posts each receive about when the
neighbour computes what it brings, and waits only just before the compute that
needs it: the message travels while the rank computes. Its sends are single
operations, so --p2p batched and ordered post the same. What keeps it from
deadlocking is an order of receives that all ranks share (schedule.py's
interleaved_actions; tests/replay.py checks it up to pp 8, m 32, v 4). The
activations go round the ring of ranks v times: rank 0 follows the last rank.

Scatter-gather, with tensor parallelism inside each stage. After a stage's last
row-parallel all-reduce every TP rank holds the same full activation, and each
sends it to its own counterpart (same tp_rank) in the next stage. With
scatter_gather (Megatron's scatter-gather optimisation) each TP rank sends only
its 1/tp slice of the flattened tensor, and the receiving stage's TP ranks
all-gather the slices: the bytes crossing the pipeline, which may cross nodes,
fall tp-fold, and the all-gather stays inside the node. A tensor whose size
does not divide by tp is sent whole.

A receive needs a buffer of known shape and dtype: both neighbours know the
microbatch shape [microbatch, seq_len, hidden] in advance, so no size is ever
sent. No message carries a label either: two ranks agree on what the k-th
message between them is because both run the same schedule. Received tensors
come back through `recycle` once their microbatch's backward is done, and the
next receives reuse them: a fresh buffer for every message costs page faults.
"""
import math
from collections import Counter
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist

from support import faults, timeline
from support.faults import PeerGone, PeerTimeout

ORDERINGS = ("batched", "ordered")
ARTICLES = {"activation": "an activation", "gradient": "a gradient"}


class PipelineComm:
    """This rank's link to its two neighbours in the ring of pipeline stages: the transfers queued and not yet
    posted, the sends still in flight, the receive buffers to reuse and the count of what arrived this step
    (for the timeout line). The schedules call its verbs; train.py makes one per rank and starts each step
    with begin_step. It reaches the network only through dist.P2POp, batch_isend_irecv, isend and irecv, and
    records its boxes on this process's timeline (timeline.span)."""

    def __init__(self, pgm, shape, dtype, device, ordering="batched", scatter_gather=False):
        self.stage, self.num_stages = pgm.stage, pgm.pp
        self.prev_rank, self.next_rank = pgm.prev_rank, pgm.next_rank
        self.shape, self.dtype, self.device = shape, dtype, device
        self.ordering = ordering
        self.received = Counter()  # activations and gradients received so far this step, for errors
        self.free = []  # receive buffers nobody needs any more
        self.sending = []  # (work, why) of sends still in flight; why() says who waits, should it time out
        self.queued = []  # (P2POp, "activation" or "gradient") until the next commit
        self.tp, self.tp_rank, self.tp_group = pgm.tp, pgm.tp_rank, pgm.tp_group
        self.split = scatter_gather and pgm.tp > 1 and math.prod(shape) % pgm.tp == 0
        self.free_slices = []  # scatter-gather: buffers for the 1/tp slices on the wire

    @property
    def is_first(self) -> bool:
        """This rank is the pipeline's first: here the verbs receive no activation and send no input gradient."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """This rank is the pipeline's last: here the verbs send no activation and receive no output gradient."""
        return self.stage == self.num_stages - 1

    def begin_step(self):
        """Count messages from zero again: the k-th activation of a step is the k-th microbatch's."""
        self.finish_sends()
        self.received.clear()

    def queue_recv(self, peer: int, what: str):
        """Queue the receive of an activation or a gradient from `peer`; returns the buffer it lands in
        once the next commit has waited for it."""
        buffer = self._wire_buffer()
        self.queued.append((dist.P2POp(dist.irecv, buffer, peer), what))
        return buffer

    def queue_send(self, tensor, peer: int, what: str):
        """Queue the send of an activation or a gradient to `peer` (posted at the next commit; the detached
        tensor keeps its storage alive until the send is finished)."""
        self.queued.append((dist.P2POp(dist.isend, tensor.detach(), peer), what))

    def commit(self, wait=True):
        """Post every queued transfer (DeepSeek's _commit_and_wait_comm) and wait for what it receives.
        wait=False returns as soon as they are posted, with the function that waits for them: step 05
        computes while they travel."""
        queued, self.queued = self.queued, []
        why = partial(self._timeout_message, queued)
        works, posted = self._guarded(partial(self._post, queued), why) if queued else ([], [])
        arrived = partial(self._arrive, queued, works, posted, why)
        return arrived() if wait else arrived

    def communicate(self, *, send_next=None, send_prev=None, recv_prev=False, recv_next=False, wait=True):
        """Send and receive with both neighbours at once; return (from_prev, from_next).

        send_next: an output activation for the next rank; send_prev: an input gradient for the
        previous rank. recv_prev / recv_next: receive an activation / a gradient (else None).
        wait=False returns as soon as the transfers are posted, with the function that waits for them
        and then returns (from_prev, from_next).
        """
        send_next, send_prev = self._outgoing(send_next), self._outgoing(send_prev)
        # Megatron's _p2p_ops order on an even rank: send next, receive previous, send previous, receive next
        # (its batched path, _batched_p2p_ops, lists send previous, receive previous, send next, receive next).
        if send_next is not None:
            self.queue_send(send_next, self.next_rank, "activation")
        from_prev = self.queue_recv(self.prev_rank, "activation") if recv_prev else None
        if send_prev is not None:
            self.queue_send(send_prev, self.prev_rank, "gradient")
        from_next = self.queue_recv(self.next_rank, "gradient") if recv_next else None
        arrived = partial(self._take, self.commit(wait=False), from_prev, from_next)
        return arrived() if wait else arrived

    def _take(self, arrived, from_prev, from_next):
        """Wait for the committed transfers (arrived()); return what they received."""
        arrived()
        return self._gathered(from_prev), self._gathered(from_next)

    def _buffer(self):
        return self.free.pop() if self.free else torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def _wire_buffer(self):
        """What a receive lands in: the whole tensor, or with scatter-gather one TP rank's slice of it."""
        if not self.split:
            return self._buffer()
        size = math.prod(self.shape) // self.tp
        return self.free_slices.pop() if self.free_slices else torch.empty(size, dtype=self.dtype, device=self.device)

    def _outgoing(self, tensor):
        """What goes on the wire: the tensor, or with scatter-gather this TP rank's slice of it
        (every TP rank of the stage holds the same tensor, so the slices add up to it)."""
        if tensor is None or not self.split:
            return tensor
        return tensor.detach().reshape(-1).chunk(self.tp)[self.tp_rank]

    def _gathered(self, received):
        """Scatter-gather: all-gather the TP ranks' received slices into the whole tensor."""
        if received is None or not self.split:
            return received
        whole = self._buffer()
        piece_bytes = received.numel() * received.element_size()
        with timeline.span("tp allgather", what="pipeline slices", bytes=piece_bytes):
            dist.all_gather(list(whole.view(-1).chunk(self.tp)), received, group=self.tp_group)
        self.free_slices.append(received)
        return whole

    def recycle(self, *received):
        """Take back received tensors whose microbatch is done with them, to receive into again."""
        self.free += [t.detach() for t in received if t is not None]

    def _post(self, queued):
        """Start the queued operations, together or one by one in parity order; returns (works, operations posted)."""
        posted = [op for op, _ in queued]
        if self.ordering == "batched":
            return dist.batch_isend_irecv(posted), posted
        # activations, then gradients; within each, even stages send first and odd stages receive first
        odd = self.stage % 2 == 1
        in_order = sorted(queued, key=lambda q: (q[1] == "gradient", (q[0].op == dist.isend) == odd))
        posted = [op for op, _ in in_order]
        return [op.op(op.tensor, op.peer) for op in posted], posted  # dist.isend / dist.irecv

    def _arrive(self, queued, works, posted, why):
        """Wait for what the posted operations receive (one box on the timeline)."""
        if posted:
            with self._box(queued):
                self._wait(works, posted, why)
            self.received.update(what for op, what in queued if op.op == dist.irecv)

    def _wait(self, works, posted, why):
        """Wait for the receives now. A send only has to be finished when the next exchange is waited
        for, so it overlaps this rank's next compute. (gloo gives a work per operation; NCCL one for
        the whole batch, which then is waited for at once: on a GPU that wait does not block the host.)"""
        self.finish_sends()
        if len(works) == len(posted):
            self.sending = [(work, why) for work, op in zip(works, posted) if op.op == dist.isend]
            works = [work for work, op in zip(works, posted) if op.op != dist.isend]
        self._complete(works, why)

    def finish_sends(self):
        """Wait until the peers have received what this rank sent."""
        sending, self.sending = self.sending, []
        for work, why in sending:
            self._complete([work], why)

    def _complete(self, works, why):
        self._guarded(lambda: [work.wait() for work in works], why)

    def _guarded(self, call, why):
        """call() (post or wait); a failure becomes PeerGone if a peer's connection closed (its process ended,
        no timeout expired), PeerTimeout if --timeout expired (faults.kind_of), and any other error (an NCCL set-up
        failure, say) goes on with its own message. why(verb) says what this rank was doing."""
        try:
            return call()
        except RuntimeError as err:
            kind = faults.kind_of(err)
            if kind == "gone":
                raise PeerGone(why("was waiting for"), sorted({self.prev_rank, self.next_rank} - {None})) from err
            if kind == "timeout":
                raise PeerTimeout(why()) from err
            raise

    def _box(self, queued):
        """The committed transfers' timeline box: send, recv or sendrecv, and what travelled, in the order
        queued. It is named only while the timeline records: switched off, the box costs nothing."""
        if not timeline.recorder().enabled:
            return nullcontext()
        names = [f"{'send' if op.op == dist.isend else 'recv'} {what}" for op, what in queued]
        directions = {name.split()[0] for name in names}
        sent = sum(op.tensor.numel() * op.tensor.element_size() for op, _ in queued if op.op == dist.isend)
        return timeline.span(directions.pop() if len(directions) == 1 else "sendrecv", what=" + ".join(names),
                                  bytes=sent)

    def _timeout_message(self, queued, verb="waited in vain for"):
        """Who waited for what: the k-th activation or gradient of this step, from which rank; then who was
        to take what this rank sent."""
        count, waits = Counter(self.received), []
        for op, what in queued:
            if op.op == dist.irecv:
                waits.append(f"{what} {count[what]} of this step from rank {op.peer}")
                count[what] += 1
        waits += [f"rank {op.peer} to take {ARTICLES[what]}" for op, what in queued if op.op == dist.isend]
        return f"rank {dist.get_rank()} (stage {self.stage}) {verb} {'; '.join(waits)}"

    def recv_forward(self):
        """The activation the previous stage sent, waited for (None on the first stage, whose input is the tokens)."""
        return None if self.is_first else self.communicate(recv_prev=True)[0]

    def send_forward(self, output):
        """This stage's output to the next stage, whose recv_forward waits for it (nothing on the last stage)."""
        if not self.is_last:
            self.communicate(send_next=output)

    def recv_backward(self):
        """The gradient of this stage's output from the next stage, waited for (None on the last stage, whose output
        is the loss)."""
        return None if self.is_last else self.communicate(recv_next=True)[1]

    def send_backward(self, input_grad):
        """The gradient of this stage's input to the previous stage, whose recv_backward waits for it (nothing on the
        first stage)."""
        if not self.is_first:
            self.communicate(send_prev=input_grad)

    def send_forward_recv_backward(self, output):
        """1F1B's steady state: send an output forward, receive an output gradient, in one exchange."""
        return None if self.is_last else self.communicate(send_next=output, recv_next=True)[1]

    def send_backward_recv_forward(self, input_grad):
        """1F1B's steady state: send an input gradient back, receive the next activation, in one exchange."""
        return None if self.is_first else self.communicate(send_prev=input_grad, recv_prev=True)[0]

    def irecv_forward(self):
        """Post the receive of an activation from the previous rank; returns the function that waits for it."""
        arrived = self.communicate(recv_prev=True, wait=False)
        return lambda: arrived()[0]

    def irecv_backward(self):
        """Post the receive of an output gradient from the next rank; returns the function that waits for it."""
        arrived = self.communicate(recv_next=True, wait=False)
        return lambda: arrived()[1]

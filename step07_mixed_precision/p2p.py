"""Point-to-point communication between neighbouring pipeline stages.

The four verbs of every pipeline schedule (names as in Megatron-LM):

    recv_forward   receive this microbatch's input activation from the previous stage
    send_forward   send this stage's output activation to the next stage
    recv_backward  receive d(loss)/d(output) from the next stage
    send_backward  send d(loss)/d(input) to the previous stage

All four are one call of `communicate`, Megatron's `_communicate`: optionally
send an activation to the next rank and a gradient to the previous one,
optionally receive an activation from the previous rank and a gradient from the
next one. Later steps combine several of these in one call; the worker stays
the same. At the ends of the pipeline the verbs do nothing (a receive returns
None): the first stage reads tokens, the last stage starts from its loss.

Step 04 adds the two combined verbs of the 1F1B steady state, each one exchange:

    send_forward_recv_backward   send the newest output, receive the gradient of the oldest microbatch
    send_backward_recv_forward   send an input gradient, receive the next microbatch's input

Why combined verbs, and why an ordering. In the steady state stage s sends an
activation to s+1 while s+1 sends a gradient to s. If each side waited for its
send to complete before it received, both would wait for ever (NCCL sends of
large tensors block until matched; we must assume every send can). Two cures:

    batched  post the sends and receives together with batch_isend_irecv, one
             fused operation: nothing waits for anything else to be posted.
    ordered  Megatron's even/odd rule (its _p2p_ops): post non-blocking isend and
             irecv one by one, even stages send first and odd stages receive
             first, then wait for all. tests/replay.py completes each rank's
             operations in the order posted, a conservative model (PyTorch's NCCL
             backend runs a lone isend or irecv on one stream per peer pair); under
             it neighbours of opposite parity meet, first operation with first.

Step 05 adds the two verbs of the interleaved schedule, non-blocking receives:

    irecv_forward    post the receive of an input activation from the previous rank
    irecv_backward   post the receive of an output gradient from the next rank

Each returns as soon as its receive is posted, with the function that waits for
it (communicate's wait=False). The schedule posts each receive about when the
neighbour computes what it brings, and waits only just before the compute that
needs it: the message travels while the rank computes. Its sends are exchanges
of one operation each, right after the compute that made what they send. So
--p2p batched and ordered post the same thing; what keeps the interleaved
schedule from deadlocking is the order of its receives, one that all ranks
share (schedule.py's interleaved_actions). tests/replay.py checks every
interleaved configuration up to pp 8, m 32, v 4.

With virtual stages activations go round the ring of ranks v times,
so here the last rank's next rank is rank 0: the neighbours were a ring from
step 03 on.

A receive needs a buffer of known shape and dtype: both neighbours know the
microbatch shape [microbatch, seq_len, hidden] in advance, so no size is ever
sent. No message carries a label either: two ranks agree on what the k-th
message between them is because both run the same schedule. Received tensors
come back through `recycle` once their microbatch's backward is done, and the
next receives reuse them: a fresh buffer for every message costs page faults.

Step 06 puts tensor parallelism inside each stage. After a stage's last
row-parallel all-reduce every TP rank holds the same full activation, and each
sends it to its own counterpart (same tp_rank) in the next stage. With
scatter_gather (Megatron's scatter-gather optimisation) each TP rank sends only
its 1/tp slice of the flattened tensor, and the receiving stage's TP ranks
all-gather the slices: the bytes crossing the pipeline, which may cross nodes,
fall tp-fold, and the all-gather stays inside the node. A tensor whose size
does not divide by tp is sent whole.
"""
import math
from collections import Counter
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist

import faults
from faults import PeerGone, PeerTimeout

ORDERINGS = ("batched", "ordered")


class PipelineComm:
    def __init__(self, pgm, shape, dtype, device, timeline, ordering="batched", scatter_gather=False):
        self.stage, self.num_stages = pgm.stage, pgm.pp
        self.prev_rank, self.next_rank = pgm.prev_rank, pgm.next_rank
        self.shape, self.dtype, self.device, self.timeline = shape, dtype, device, timeline
        self.ordering = ordering
        self.received = Counter()  # activations and gradients received so far this step, for errors
        self.free = []  # receive buffers nobody needs any more
        self.sending = []  # (work, why) of sends still in flight; why() says who waits, should it time out
        self.tp, self.tp_rank, self.tp_group = pgm.tp, pgm.tp_rank, pgm.tp_group
        self.split = scatter_gather and pgm.tp > 1 and math.prod(shape) % pgm.tp == 0
        self.free_slices = []  # scatter-gather: buffers for the 1/tp slices on the wire

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def begin_step(self):
        """Count messages from zero again: the k-th activation of a step is the k-th microbatch's."""
        self.finish_sends()
        self.received.clear()

    def communicate(self, *, send_next=None, send_prev=None, recv_prev=False, recv_next=False, wait=True):
        """Send and receive with both neighbours at once; return (from_prev, from_next).

        send_next: an output activation for the next rank; send_prev: an input gradient for the
        previous rank. recv_prev / recv_next: receive an activation / a gradient (else None).
        wait=False returns as soon as the transfers are posted, with the function that waits for them
        and then returns (from_prev, from_next): step 05 computes while they travel.
        """
        send_next, send_prev = self._outgoing(send_next), self._outgoing(send_prev)
        from_prev = self._wire_buffer() if recv_prev else None
        from_next = self._wire_buffer() if recv_next else None
        # Megatron's _p2p_ops order on an even rank: send next, receive previous, send previous, receive next
        # (its batched path, _batched_p2p_ops, lists send previous, receive previous, send next, receive next).
        ops = [dist.P2POp(dist.isend, send_next.detach(), self.next_rank) if send_next is not None else None,
               dist.P2POp(dist.irecv, from_prev, self.prev_rank) if recv_prev else None,
               dist.P2POp(dist.isend, send_prev.detach(), self.prev_rank) if send_prev is not None else None,
               dist.P2POp(dist.irecv, from_next, self.next_rank) if recv_next else None]
        posted = self._guarded(partial(self._post, ops), partial(self._timeout_message, ops))
        arrived = partial(self._arrive, ops, *posted, from_prev, from_next)
        return arrived() if wait else arrived

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
        with self.timeline.span("tp allgather", what="pipeline slices", bytes=piece_bytes):
            dist.all_gather(list(whole.view(-1).chunk(self.tp)), received, group=self.tp_group)
        self.free_slices.append(received)
        return whole

    def recycle(self, *received):
        """Take back received tensors whose microbatch is done with them, to receive into again."""
        self.free += [t.detach() for t in received if t is not None]

    def _post(self, ops):
        """Start the operations (together, or one by one in parity order); returns (works, operations posted)."""
        if self.ordering == "batched":
            posted = [op for op in ops if op is not None]
            return (dist.batch_isend_irecv(posted) if posted else []), posted
        # odd stages swap each pair: receive previous, send next, receive next, send previous
        order = ops if self.stage % 2 == 0 else [ops[1], ops[0], ops[3], ops[2]]
        posted = [op for op in order if op is not None]
        return [op.op(op.tensor, op.peer) for op in posted], posted  # dist.isend / dist.irecv

    def _arrive(self, ops, works, posted, from_prev, from_next):
        """Wait for what the posted operations receive (one box on the timeline); returns it."""
        if posted:
            with self._box(ops):
                self._wait(works, posted, partial(self._timeout_message, ops))
            self.received.update(what for what, op in zip(("activation", "gradient"), ops[1::2]) if op is not None)
        return self._gathered(from_prev), self._gathered(from_next)

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
        no timeout expired), else PeerTimeout: --timeout expired. why(verb) says what this rank was doing."""
        try:
            return call()
        except RuntimeError as err:
            if faults.kind_of(err) == "gone":
                raise PeerGone(why("was waiting for"), sorted({self.prev_rank, self.next_rank} - {None})) from err
            raise PeerTimeout(why()) from err

    def _box(self, ops):
        """The exchange's timeline box: send, recv or sendrecv, and what travelled. It is named only while
        the timeline records: switched off, the box costs nothing."""
        if not self.timeline.enabled:
            return nullcontext()
        names = ["send activation", "recv activation", "send gradient", "recv gradient"]
        present = [name for name, op in zip(names, ops) if op is not None]
        directions = {name.split()[0] for name in present}
        sent = sum(op.tensor.numel() * op.tensor.element_size() for op in ops[0::2] if op is not None)
        return self.timeline.span(directions.pop() if len(directions) == 1 else "sendrecv", what=" + ".join(present),
                                  bytes=sent)

    def _timeout_message(self, ops, verb="waited in vain for"):
        """Who waited for what: the k-th activation or gradient of this step, from which rank."""
        waits = [f"{what} {self.received[what]} of this step from rank {peer}" for what, peer, op in
                 (("activation", self.prev_rank, ops[1]), ("gradient", self.next_rank, ops[3])) if op is not None]
        waits += [f"rank {peer} to take {what}" for what, peer, op in
                  (("an activation", self.next_rank, ops[0]), ("a gradient", self.prev_rank, ops[2])) if op is not None]
        return f"rank {dist.get_rank()} (stage {self.stage}) {verb} {'; '.join(waits)}"

    def recv_forward(self):
        return None if self.is_first else self.communicate(recv_prev=True)[0]

    def send_forward(self, output):
        if not self.is_last:
            self.communicate(send_next=output)

    def recv_backward(self):
        return None if self.is_last else self.communicate(recv_next=True)[1]

    def send_backward(self, input_grad):
        if not self.is_first:
            self.communicate(send_prev=input_grad)

    def send_forward_recv_backward(self, output):
        return None if self.is_last else self.communicate(send_next=output, recv_next=True)[1]

    def send_backward_recv_forward(self, input_grad):
        return None if self.is_first else self.communicate(send_prev=input_grad, recv_prev=True)[0]

    def irecv_forward(self):
        """Post the receive of an activation from the previous rank of the ring (the last rank's chunks
        feed rank 0's); returns the function that waits for it and returns it."""
        arrived = self.communicate(recv_prev=True, wait=False)
        return lambda: arrived()[0]

    def irecv_backward(self):
        """Post the receive of an output gradient from the next rank of the ring; returns the function that
        waits for it and returns it."""
        arrived = self.communicate(recv_next=True, wait=False)
        return lambda: arrived()[1]

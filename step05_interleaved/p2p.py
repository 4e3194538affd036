"""Point-to-point communication between neighbouring pipeline stages.

The verbs of every pipeline schedule (names as in Megatron-LM):

    recv_forward   receive this microbatch's input activation from the previous stage
    send_forward   send this stage's output activation to the next stage
    recv_backward  receive d(loss)/d(output) from the next stage
    send_backward  send d(loss)/d(input) to the previous stage

the two combined verbs of the 1F1B steady state:

    send_forward_recv_backward   send output of microbatch i, receive the gradient of microbatch j
    send_backward_recv_forward   send input gradient of microbatch j, receive input of microbatch i

and the verb of the interleaved schedule, `exchange_ring`: any of the four
transfers at once, with ring neighbours, because with virtual stages the
activations go round the pipeline v times (the last rank feeds the first).

Receives need a buffer of known shape and dtype: both neighbours know the
microbatch shape [microbatch, seq_len, hidden] in advance, so no size is ever
sent. At the ends of the pipeline a verb does nothing (a receive returns None).

Why combined verbs, and why an ordering. In the steady state stage s sends an
activation to s+1 while s+1 sends a gradient to s. If both post a blocking send
first, each waits for the other to receive: deadlock (NCCL sends of large
tensors block until matched; we must assume every send can). Two cures:

    batched  post the send and the receive together with batch_isend_irecv;
             neither waits for the other before posting.
    ordered  Megatron's even/odd rule: even stages send then receive, odd
             stages receive then send. Neighbours have opposite parity, so one
             side's first operation always meets the other side's first.
"""
import torch
import torch.distributed as dist

ORDERINGS = ("batched", "ordered")


class PipelineComm:
    def __init__(self, pgm, shape, dtype, device, timeline, ordering="batched"):
        self.pgm, self.shape, self.dtype, self.device, self.timeline = pgm, shape, dtype, device, timeline
        self.ordering = ordering

    def post(self, ops, labels):
        """Post operations together and wait until all completed, i.e. their peers matched them.

        labels[i] = (direction, what, microbatch) of ops[i]: for the timeline, and for
        the tests, which replace this method to replay a schedule without a model.
        """
        kinds = {direction for direction, _, _ in labels}
        kind = kinds.pop() if len(kinds) == 1 else "sendrecv"
        microbatch = labels[0][2] if len(labels) == 1 else tuple(mb for _, _, mb in labels)
        with self.timeline.span(kind, microbatch, kind_of="/".join(what for _, what, _ in labels)):
            for request in dist.batch_isend_irecv(ops):
                request.wait()

    def _exchange(self, sends, recvs):
        """Run sends and receives, each (tensor, peer, what, microbatch), in this rank's ordering."""
        send_ops = [(dist.P2POp(dist.isend, t.detach().contiguous(), peer), ("send", what, mb))
                    for t, peer, what, mb in sends]
        recv_ops = [(dist.P2POp(dist.irecv, t, peer), ("recv", what, mb)) for t, peer, what, mb in recvs]
        if self.ordering == "batched":
            groups = [send_ops + recv_ops]  # everything posted at once
        else:
            first, second = (send_ops, recv_ops) if self.pgm.stage % 2 == 0 else (recv_ops, send_ops)
            groups = [[op] for op in first + second]  # one blocking operation at a time
        for group in groups:
            self.post([op for op, _ in group], [label for _, label in group])

    def _call(self, send=None, send_to=None, send_mb=None, recv_from=None, recv_mb=None, what=("", "")):
        """The one verb behind all others: optionally send to one peer, optionally receive from one."""
        sends = [] if send_to is None else [(send, send_to, what[0], send_mb)]
        buffer = None if recv_from is None else torch.empty(self.shape, dtype=self.dtype, device=self.device)
        recvs = [] if buffer is None else [(buffer, recv_from, what[1], recv_mb)]
        if sends or recvs:
            self._exchange(sends, recvs)
        return buffer

    def recv_forward(self, mb):
        return self._call(recv_from=self.pgm.prev_rank, recv_mb=mb, what=("", "activation"))

    def send_forward(self, output, mb):
        self._call(output, self.pgm.next_rank, mb, what=("activation", ""))

    def recv_backward(self, mb):
        return self._call(recv_from=self.pgm.next_rank, recv_mb=mb, what=("", "gradient"))

    def send_backward(self, input_grad, mb):
        self._call(input_grad, self.pgm.prev_rank, mb, what=("gradient", ""))

    def send_forward_recv_backward(self, output, send_mb, recv_mb):
        next_rank = self.pgm.next_rank
        return self._call(output, next_rank, send_mb, next_rank, recv_mb, what=("activation", "gradient"))

    def send_backward_recv_forward(self, input_grad, send_mb, recv_mb):
        prev_rank = self.pgm.prev_rank
        return self._call(input_grad, prev_rank, send_mb, prev_rank, recv_mb, what=("gradient", "activation"))

    def exchange_ring(self, output=None, input_grad=None, recv_input=None, recv_grad=None):
        """Send and receive any of: an output to the next rank, an input gradient to the previous
        rank, an input from the previous rank, an output gradient from the next rank.

        output, input_grad: (tensor, label) or None; recv_input, recv_grad: label or None.
        A label names the boundary between model chunks g and g+1 and the microbatch: (g, mb).
        Returns (input, output_grad), None for what was not received.
        """
        pgm, sends, recvs, x, grad = self.pgm, [], [], None, None
        if output is not None:
            sends.append((output[0], pgm.next_rank_ring, "activation", output[1]))
        if input_grad is not None:
            sends.append((input_grad[0], pgm.prev_rank_ring, "gradient", input_grad[1]))
        if recv_input is not None:
            x = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            recvs.append((x, pgm.prev_rank_ring, "activation", recv_input))
        if recv_grad is not None:
            grad = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            recvs.append((grad, pgm.next_rank_ring, "gradient", recv_grad))
        if sends or recvs:
            self._exchange(sends, recvs)
        return x, grad

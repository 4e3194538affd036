"""Point-to-point communication between neighbouring pipeline stages.

The four verbs of every pipeline schedule (names as in Megatron-LM):

    recv_forward   receive this microbatch's input activation from the previous stage
    send_forward   send this stage's output activation to the next stage
    recv_backward  receive d(loss)/d(output) from the next stage
    send_backward  send d(loss)/d(input) to the previous stage

Receives need a buffer of known shape and dtype: both neighbours know the
microbatch shape [microbatch, seq_len, hidden] in advance, so no size is ever
sent. Each verb posts its operation with `batch_isend_irecv` and waits for it;
at the ends of the pipeline a verb does nothing (a receive returns None).
"""
import torch
import torch.distributed as dist


class PipelineComm:
    def __init__(self, pgm, shape, dtype, device, timeline):
        self.pgm, self.shape, self.dtype, self.device, self.timeline = pgm, shape, dtype, device, timeline

    def _run(self, kind: str, microbatch: int, ops, what: str):
        """Post the operations and wait until they completed: the peer has matched them."""
        with self.timeline.span(kind, microbatch, kind_of=what):
            for request in dist.batch_isend_irecv(ops):
                request.wait()

    def _recv(self, peer, microbatch, what):
        buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self._run("recv", microbatch, [dist.P2POp(dist.irecv, buffer, peer)], what)
        return buffer

    def _send(self, tensor, peer, microbatch, what):
        self._run("send", microbatch, [dist.P2POp(dist.isend, tensor.detach().contiguous(), peer)], what)

    def recv_forward(self, microbatch):
        return None if self.pgm.is_first else self._recv(self.pgm.prev_rank, microbatch, "activation")

    def send_forward(self, output, microbatch):
        if not self.pgm.is_last:
            self._send(output, self.pgm.next_rank, microbatch, "activation")

    def recv_backward(self, microbatch):
        return None if self.pgm.is_last else self._recv(self.pgm.next_rank, microbatch, "gradient")

    def send_backward(self, input_grad, microbatch):
        if not self.pgm.is_first:
            self._send(input_grad, self.pgm.prev_rank, microbatch, "gradient")

"""Measure the activation memory a pipeline schedule keeps alive, on any device.

Autograd keeps, for every microbatch whose backward has not run yet, the
tensors its forward saved for the backward. Those saved activations are what
a schedule's memory formula counts. We see them with
`torch.autograd.graph.saved_tensors_hooks`: the pack hook is called for every
tensor autograd saves. Parameters and buffers are saved too (a matmul keeps its
weight) but they exist anyway, so tensors sharing their storage are skipped: the
model's, looked up at each forward (PipeDream's copy-on-write gives them new
storage, step 04), and the weights a forward runs on when not the model's own.
This works on CPU, where there is no allocator to ask.

Bytes are counted per storage, once, however many saved tensors or microbatches
share it: the microbatches of one batch's token ids are views of one storage.
A meter made with enabled=False installs no hooks and counts nothing.
"""
from collections import Counter
from contextlib import contextmanager, nullcontext

import torch


def storage_key(t: torch.Tensor) -> int:
    """The storage a tensor's values live in: two views of one storage are counted once."""
    return t.untyped_storage().data_ptr()


class ActivationMeter:
    """Live and peak activation bytes, and the number of microbatches holding activations."""

    def __init__(self, model: torch.nn.Module = None, enabled: bool = True):
        self.enabled, self.model = enabled, model
        self.live = {}  # microbatch -> {storage: bytes} it keeps alive
        self.holders = Counter()  # storage -> how many live microbatches keep it
        self.live_bytes = 0
        self.peak_bytes = self.peak_stored_microbatches = 0

    def keep(self, microbatch, t: torch.Tensor):
        """Count a tensor that the schedule itself keeps for the backward (e.g. a stage input)."""
        key = storage_key(t)
        saved = self.live.setdefault(microbatch, {}) if self.enabled else {}
        if not self.enabled or key in saved:
            return
        saved[key] = t.untyped_storage().nbytes()
        self.holders[key] += 1
        if self.holders[key] == 1:
            self.live_bytes += saved[key]
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.peak_stored_microbatches = max(self.peak_stored_microbatches, len(self.live))

    def saving(self, microbatch, weights=None):
        """Count everything autograd saves while the body runs as belonging to `microbatch`, but the
        weights: the model's parameters and buffers, and `weights` ({name: tensor}) if the forward runs
        on weights of its own (PipeDream's versions, step 04)."""
        return self._hooks(microbatch, weights) if self.enabled else nullcontext()

    @contextmanager
    def _hooks(self, microbatch, weights):
        tensors = [*self.model.parameters(), *self.model.buffers()] if self.model is not None else []
        skipped = {storage_key(t) for t in [*tensors, *(weights or {}).values()]}

        def pack(t):
            if storage_key(t) not in skipped:
                self.keep(microbatch, t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def _drop(self, key, size):
        self.holders[key] -= 1
        if self.holders[key] == 0:
            del self.holders[key]
            self.live_bytes -= size

    def forget(self, microbatch, t: torch.Tensor):
        """The schedule freed a tensor it had kept (an output whose values are no longer needed)."""
        key = storage_key(t)
        saved = self.live.get(microbatch, {})
        if key in saved:
            self._drop(key, saved.pop(key))

    def release(self, microbatch):
        """The backward of `microbatch` has run: autograd has freed what it saved."""
        for key, size in self.live.pop(microbatch, {}).items():
            self._drop(key, size)

"""Measure the activation memory a pipeline schedule keeps alive, on any device.

Autograd keeps, for every microbatch whose backward has not run yet, the
tensors its forward saved for the backward. Those saved activations are what
a schedule's memory formula counts. We see them with
`torch.autograd.graph.saved_tensors_hooks`: the pack hook is called for every
tensor autograd saves. Parameters and buffers are saved too (a matmul keeps its
weight) but they exist anyway, so tensors sharing their storage are skipped.
This works on CPU, where there is no allocator to ask.
"""
from contextlib import contextmanager

import torch


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class ActivationMeter:
    """Live and peak activation bytes, and the number of microbatches holding activations."""

    def __init__(self, model: torch.nn.Module):
        self.weights = {storage_key(t) for t in (*model.parameters(), *model.buffers())}
        self.live = {}  # microbatch -> {storage: bytes} it keeps alive
        self.peak_bytes = 0
        self.peak_microbatches = 0

    def reset_peaks(self):
        self.peak_bytes = self.peak_microbatches = 0

    @property
    def live_bytes(self) -> int:
        return sum(sum(saved.values()) for saved in self.live.values())

    def _update_peaks(self):
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.peak_microbatches = max(self.peak_microbatches, len(self.live))

    def keep(self, microbatch, t: torch.Tensor):
        """Count a tensor that the schedule itself keeps for the backward (e.g. a stage input)."""
        key = storage_key(t)
        if key not in self.weights:
            self.live.setdefault(microbatch, {})[key] = t.untyped_storage().nbytes()
            self._update_peaks()

    @contextmanager
    def saving(self, microbatch):
        """Count everything autograd saves while the body runs as belonging to `microbatch`."""

        def pack(t):
            self.keep(microbatch, t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def forget(self, microbatch, t: torch.Tensor):
        """The schedule freed a tensor it had kept (an output whose values are no longer needed)."""
        self.live.get(microbatch, {}).pop(storage_key(t), None)

    def release(self, microbatch):
        """The backward of `microbatch` has run: autograd has freed what it saved."""
        self.live.pop(microbatch, None)

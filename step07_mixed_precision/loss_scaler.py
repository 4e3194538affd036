"""Loss scaling for fp16 training, with Megatron-LM's rules (megatron/core/optimizer/grad_scaler.py).

fp16 has 5 exponent bits: its smallest positive value is 2^-24 (about 6e-8), its largest 65504.
Many gradients of a language model fall below its range, where they lose their low bits (fp16's
subnormals, below 2^-14) or flush to zero. Multiplying the loss by a scale S multiplies every
gradient by S (the backward is linear in the gradient it starts from), which lifts them into
fp16's range; the optimizer multiplies the fp32 main gradients by 1/S before using them, so the
update is the unscaled one. S is a power of two, so both multiplications only shift exponents.
Too large an S overflows some gradient to inf or NaN: the optimizer then skips the step (the
weights stay as they were) and tells the scaler, which lowers S. Multiply the loss while it is
fp32: scaled by 2^16, any loss above 1 is beyond fp16's largest value.

bf16 has fp32's 8 exponent bits, hence fp32's range (down to about 1e-38): its gradients do not
underflow, and bf16 training needs no scaler (Megatron builds a dynamic one only with --fp16;
with bf16 it uses none unless --loss-scale asks for a constant one).
"""


class ConstantGradScaler:
    """A fixed scale (Megatron's --loss-scale): overflows still skip their step, the scale never moves.

    The scale is a Python float, where Megatron keeps a one-element CUDA tensor (its fused unscale
    kernel, torch._amp_foreach_non_finite_check_and_unscale_, takes 1/S as a tensor: wrap inv_scale
    in one to use it). Skipping a step is a Python `if`, so found_inf comes to the host in any case
    (Megatron calls .item() too); with the scale on the host, update() launches nothing,
    state_dict() is plain JSON, and the same code runs on CPU and GPU. A tensor times a Python
    float needs no copy to the device.
    """

    def __init__(self, scale: float):
        if not scale > 0:
            raise ValueError(f"the loss scale must be positive, got {scale}")
        self.scale = float(scale)

    @property
    def inv_scale(self) -> float:
        """1/S, exact when S is a power of two (as it is in this course)."""
        return 1.0 / self.scale

    def update(self, found_inf: bool):
        """Nothing to update: a constant scale never moves."""
        pass

    def state_dict(self) -> dict:
        """Nothing to save: the scale is a flag (--loss-scale)."""
        return {}  # nothing changes; the scale comes from the command line

    def load_state_dict(self, state: dict):
        """Nothing to load: the scale is a flag (--loss-scale)."""
        pass


class DynamicGradScaler:
    """A scale that finds, and follows, the largest power of two at which gradients stay finite.

    - A clean step (every gradient finite) counts towards growth: after growth_interval clean
      steps since the last overflow or growth (Megatron's --loss-scale-window, 1000 by default),
      the scale is multiplied by growth_factor and the hysteresis tracker is refilled.
    - An overflow restarts the clean-step count and takes one from the hysteresis tracker; once
      the tracker is at or below zero, the scale is multiplied by backoff_factor, floored at
      min_scale.

    The hysteresis tracker is refilled only by growth, never by a clean step: `hysteresis`
    (Megatron's default: 2) is how many overflows are tolerated since the last growth, not in a
    row (Megatron's docstring says "in a row"; its code, followed here, does not). With
    hysteresis 2, overflow, clean, overflow halves the scale on the second overflow, and from
    then on every overflow halves it until the next growth. Hysteresis keeps an isolated
    overflow (its step is skipped anyway) from costing a halving that takes a whole window of
    clean steps to win back. The tracker goes below zero as overflows continue; it stays in
    the state dict as it is, as in Megatron.

    Megatron starts at 2^32 (--initial-loss-scale). This course starts at 2^16 (PyTorch's
    GradScaler default): each overflow on the way down skips a step, and if gradients stop
    overflowing at 2^16, reaching it from 2^32 skips 17 steps (one absorbed by hysteresis 2,
    then 16 halvings), most of this course's default 20-step run.
    """

    def __init__(self, initial_scale: float, min_scale: float, growth_interval: int, hysteresis: int,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5):
        if not (0 < min_scale <= initial_scale and growth_interval >= 1 and hysteresis >= 1
                and growth_factor > 1 and 0 < backoff_factor < 1):
            raise ValueError("need 0 < min_scale <= initial_scale, growth_interval >= 1, hysteresis >= 1, "
                             "growth_factor > 1 and 0 < backoff_factor < 1")
        self.scale = float(initial_scale)
        self.min_scale, self.growth_interval, self.hysteresis = float(min_scale), growth_interval, hysteresis
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_tracker = 0  # clean steps since the last overflow or growth
        self.hysteresis_tracker = hysteresis  # overflows left before backing off; refilled by growth only

    @property
    def inv_scale(self) -> float:
        """1/S, exact when S is a power of two (as it is in this course)."""
        return 1.0 / self.scale

    def update(self, found_inf: bool):
        """Once per optimizer step. found_inf must be the same on every rank (a MAX all-reduce
        over the ranks that hold gradients), so that all of them skip the same steps and keep
        the same scale."""
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict):
        self.scale = float(state["scale"])
        self.growth_tracker = state["growth_tracker"]
        self.hysteresis_tracker = state["hysteresis_tracker"]

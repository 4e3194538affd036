"""Mixed precision across the pipeline, as Megatron-LM does it: half-precision stages, fp32 master
weights and main gradients, and one decision to skip a step that every rank obeys.

    stage parameters (bf16/fp16) --forward/backward--> .grad (half), per microbatch
        --hook: add into--> main_grad (fp32), summed over the microbatches
        --data-parallel all-reduce, x 1/S (unscale), inf/nan check, clip--> master weights (fp32)
        --AdamW on the masters, then cast--> stage parameters

A half-precision gradient is added into its fp32 main_grad right after each
microbatch's backward (register_post_accumulate_grad_hook), and freed: summing
m microbatches in bf16 would round every partial sum to 8 bits of mantissa.

Skip together. With fp16 a gradient can overflow on one stage only (the scaled
gradient that travels back is fp16, so an inf reaches the earlier stages too,
but not the later ones, nor the other TP ranks' shards). found_inf is therefore
all-reduced with MAX over the model-parallel group (tp x pp of one replica):
every rank of the replica skips, or none does. Data-parallel replicas need not
join: the gradient all-reduce has already spread any inf to every replica of
the same shard, so they all find it themselves.

The global gradient norm for clipping sums each parameter once: a parameter
replicated over TP (a norm gain) counts on TP rank 0 only, and the last stage's
copy of a tied embedding (marked `shared`) not at all. The squares are summed
over the model-parallel group; replicas hold the same gradients after the
data-parallel all-reduce, so data parallelism adds nothing.
"""
import torch
import torch.distributed as dist

from loss_scaler import ConstantGradScaler, DynamicGradScaler

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_scaler(args):
    """--loss-scale S: a constant scaler; fp16: a dynamic one; otherwise none (the scale is 1)."""
    if args.loss_scale:
        return ConstantGradScaler(args.loss_scale)
    if args.precision == "fp16":
        return DynamicGradScaler(args.initial_loss_scale, args.min_loss_scale, args.loss_scale_window,
                                 args.hysteresis)
    return None


def accumulate_main_grad(param):
    """After a microbatch's backward: add its half gradient into the fp32 sum, free the half one."""
    if param.grad is None:  # step 08: a Linear weight, whose W adds into main_grad itself
        return
    param.main_grad += param.grad.float()
    param.grad = None


class MixedPrecisionOptimizer:
    """AdamW on fp32 masters of a (half-precision) model, with loss scaling, a shared skip, clipping.

    In fp32 the masters are the parameters themselves and main_grad is .grad: the same arithmetic
    as plain AdamW, so earlier steps' results are unchanged.
    """

    def __init__(self, model, args, pgm, scaler=None):
        self.params = list(model.parameters())
        self.half = args.precision != "fp32"
        self.pgm, self.clip, self.scaler = pgm, args.clip_grad, scaler
        if self.half:
            self.masters = [p.detach().float() for p in self.params]  # fp32 copies, outside any graph
            for p in self.params:
                p.main_grad = torch.zeros_like(p, dtype=torch.float32)
                p.register_post_accumulate_grad_hook(accumulate_main_grad)
        else:
            self.masters = self.params
        self.adamw = torch.optim.AdamW(self.masters, lr=args.lr)

    @property
    def loss_scale(self) -> float:
        """The scale S the backward multiplies the loss by (1 without a scaler)."""
        return self.scaler.scale if self.scaler else 1.0

    def scale_loss(self, loss):
        """The loss times the current loss scale (Megatron's scale_loss): each stage's grad_scale_func."""
        return self.loss_scale * loss

    def main_grads(self):
        """The fp32 gradient sums, one per parameter (None where a parameter got no gradient)."""
        return [p.main_grad if self.half else p.grad for p in self.params]

    def zero_grad(self):
        """Forget the last step's gradients: each parameter's .grad and, in bf16 and fp16, the fp32 main_grad they
        accumulate into."""
        for p in self.params:
            p.grad = None
            if self.half:
                p.main_grad.zero_()

    def found_inf(self, grads) -> bool:
        """Any inf or nan in any gradient of this replica (an all-reduce over the model-parallel group)."""
        found = torch.zeros((), device=self.params[0].device)
        for g in grads:
            found = torch.maximum(found, (~torch.isfinite(g)).any().float())
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.pgm.model_parallel_group)
        if getattr(self.pgm, "ep", 1) > 1:  # experts.py: the other experts sit in the expert group's replicas
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.pgm.ep_group)
        return bool(found.item())

    def counted_once(self, param) -> bool:
        """Whether this rank's copy of param enters the global norm (each number counted once)."""
        if getattr(param, "shared", False):
            return False  # the last stage's copy of the tied embedding
        return getattr(param, "tp_split_dim", None) is not None or self.pgm.tp_rank == 0

    def global_norm(self) -> float:
        """The L2 norm of the whole model's main gradients: local squares, summed over the replica."""
        squares = experts = torch.zeros((), device=self.params[0].device)
        for p, g in zip(self.params, self.main_grads()):
            if g is not None and self.counted_once(p) and getattr(p, "expert", False):
                experts = experts + g.float().pow(2).sum()
            elif g is not None and self.counted_once(p):
                squares = squares + g.float().pow(2).sum()
        if getattr(self.pgm, "ep", 1) > 1:  # experts.py: each rank of an expert group holds 1/ep of the experts
            dist.all_reduce(experts, group=self.pgm.ep_group)
        squares = squares + experts
        dist.all_reduce(squares, group=self.pgm.model_parallel_group)
        return squares.sqrt().item()

    def step(self) -> dict:
        """Unscale, check, clip, step the masters, copy them back; returns what the log shows."""
        grads, scale = [g for g in self.main_grads() if g is not None], self.loss_scale
        if self.scaler:
            for g in grads:
                g.mul_(self.scaler.inv_scale)
        skipped = self.found_inf(grads) if self.scaler else False
        if self.scaler:
            self.scaler.update(skipped)  # the same on every rank: found_inf was all-reduced
        if skipped:  # every rank of the replica skips the clip, the step and the copy back
            return dict(skipped=True, grad_norm=None, loss_scale=scale)
        norm = self.global_norm()
        if self.clip and self.clip / (norm + 1e-6) < 1:  # Megatron's clip_grad_norm_fp32
            for g in grads:
                g.mul_(self.clip / (norm + 1e-6))
        if self.half:
            for master, g in zip(self.masters, self.main_grads()):
                master.grad = g
        self.adamw.step()
        if self.half:
            with torch.no_grad():
                for p, master in zip(self.params, self.masters):
                    p.copy_(master)  # cast to the half type
        return dict(skipped=False, grad_norm=norm, loss_scale=scale)

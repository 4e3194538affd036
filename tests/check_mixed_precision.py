"""Step 07's shared skip and global norm, checked inside a run of 4 ranks (tp 2 x pp 2); step 08's norm under
DualPipe on 2 ranks.

    (4 ranks)  python tests/check_mixed_precision.py STEP_DIR inf OUT.json
    (4 ranks)  python tests/check_mixed_precision.py STEP_DIR norm OUT.json
    (4 ranks)  python tests/check_mixed_precision.py STEP_DIR scaled OUT.json

inf:  after one step's backward, one gradient entry on rank 3 only is set to inf;
      every rank must skip the step, leave its half weights and fp32 masters bitwise
      as they were and create no optimizer state. Also reports the dtypes of the
      weights (half), the main gradients (fp32) and the pipeline's receive buffers
      (half). found_inf is asked first, and the step runs only if every rank found the inf
      (a rank that did not would wait in global_norm's all-reduce). Control: a found_inf
      written here that reads this rank's gradients alone, where only rank 3 notices.
norm: the global norm the optimizer computes (fp32, --clip-grad 0.5) against
      torch.nn.utils.clip_grad_norm_ over the single-device model's gradients,
      and the names each rank counts, so the test can check each number counts once.
      Also whether the step scaled every gradient by exactly CLIP / (norm + 1e-6),
      Megatron's factor, computed here from the norm the step returned.
scaled: the same under a loss scale (--loss-scale 1024 in fp32; fp16's dynamic scale): the norm
      is that of the unscaled gradients, and the clip scales the unscaled gradients. Control:
      the unscale made a no-op, so the norm is S times too large.

    (2 ranks)  python tests/check_mixed_precision.py STEP_DIR twins OUT.json

twins: step 08, dualpipe (each stage on two ranks) and dualpipev, --clip-grad 0.5: each step's grad_norm
      in the record train_step returns (what the log shows) and the weights after three steps, beside
      the single-device run's norms and clipped weights. Control: chunk 1's parameters counted the
      other way (dualpipe's reverse-direction copies counted too; dualpipev's second chunk left out).
"""
import os
import sys
from contextlib import nullcontext
from unittest import mock

import torch

from harness import rel_err, write_per_rank

# --timeout 10: ranks that disagree on the skip wait in a collective; they are named after 10 s, not 60
FLAGS = ["--device", "cpu", "--hidden", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "8",
         "--layers", "4", "--microbatches", "2", "--tp", "2", "--pp", "2", "--timeout", "10"]
CLIP = 0.5  # below the tiny model's first gradient norm (about 1.3), so the step clips
TWIN_FLAGS = ["--device", "cpu", "--hidden", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "8",
              "--layers", "4", "--microbatches", "4", "--pp", "2", "--clip-grad", str(CLIP), "--timeout", "30"]
TWIN_STEPS = 3  # each clipped by its own factor


def injected_inf(train, device):
    """found: what found_inf answered on this rank. skip: what step() then decided (None when the ranks' answers
    differ: those that step would wait for the others in global_norm's all-reduce until the timeout). control:
    a found_inf that looks at this rank's gradients alone, written here, must find the inf on rank 3 only."""
    import torch.distributed as dist

    run = train.build(train.parse_args([*FLAGS, "--precision", "fp16"]), device)
    before = [t.detach().clone() for t in (*run.model.parameters(), *run.optimizer.masters)]
    train.compute_gradients(run, 0)
    dtypes = dict(params=sorted({str(p.dtype) for p in run.model.parameters()}),
                  main_grads=sorted({str(g.dtype) for g in run.optimizer.main_grads()}),
                  received=sorted({str(t.dtype) for t in run.comm.free}))  # the step's receive buffers
    if dist.get_rank() == 3:
        run.optimizer.main_grads()[0].view(-1)[0] = float("inf")
    control = any(not torch.isfinite(g).all() for g in run.optimizer.main_grads())
    found = bool(run.optimizer.found_inf(run.optimizer.main_grads()))
    answers = [None] * dist.get_world_size()
    dist.all_gather_object(answers, found)
    skip = run.optimizer.step()["skipped"] if all(answers) else None
    after = [t.detach() for t in (*run.model.parameters(), *run.optimizer.masters)]
    return dict(found=found, skip=skip, control=control, dtypes=dtypes, optimizer_state=len(run.optimizer.adamw.state),
                unchanged=all(torch.equal(a, b) for a, b in zip(before, after)))


def global_norm(train, mixed_precision, device, model, data):
    args = train.parse_args([*FLAGS, "--tie-embeddings", "--clip-grad", str(CLIP)])
    run = train.build(args, device)
    train.compute_gradients(run, 0)
    counted = [n for n, p in run.model.named_parameters() if run.optimizer.counted_once(p)]
    unclipped = [g.clone() for g in run.optimizer.main_grads()]
    norm = run.optimizer.step()["grad_norm"]
    factor = CLIP / (norm + 1e-6)
    clipped = all(torch.equal(g, u * factor) for g, u in zip(run.optimizer.main_grads(), unclipped))
    return dict(norm=norm, reference=reference_norm(train, model, data, args), counted=counted,
                tp_rank=run.pgm.tp_rank, clipped=clipped,
                splits={n: getattr(p, "tp_split_dim", None) for n, p in run.model.named_parameters()})


def reference_norm(train, model, data, args):
    """On rank 0: the global norm of the single-device model's fp32 gradients for the first batch; else None."""
    import torch.distributed as dist

    return reference_run(train, model, data, args, 1, float("inf"))[0][0] if dist.get_rank() == 0 else None


def reference_run(train, model, data, args, steps, clip):
    """The whole model on one device, `steps` AdamW steps on the global batches, each step's gradients clipped to
    the global norm `clip` by torch.nn.utils.clip_grad_norm_: ([each step's norm before the clip], {name: weight})."""
    import torch.nn.functional as F

    net = model.Transformer(train.model_config(args), seed=args.seed)
    optimizer, tokens, norms = torch.optim.AdamW(net.parameters(), lr=args.lr), data.load_tokens(args.data), []
    for step in range(steps):
        inputs, targets = data.get_batch(tokens, step, args.batch_size, args.seq_len, args.seed)
        optimizer.zero_grad()
        logits = net(inputs)
        F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), clip).item())
        optimizer.step()
    return norms, dict(net.named_parameters())


def count_chunk_1_the_other_way(run):
    """The control: chunk 1's parameters enter the norm where they did not, and not where they did. DualPipe's
    reverse-direction copies (marked `shared`) are then counted beside the originals; DualPipeV's second chunk
    is left out."""
    for p in run.model[1].parameters():
        p.shared = not getattr(p, "shared", False)


def twin_norms(train, model, data, device):
    """Step 08 (2 ranks): for dualpipe and dualpipev with --clip-grad, each step's logged grad_norm and the relative
    error of each of this rank's weights after TWIN_STEPS steps, against the single-device run (computed on every
    rank). Control: the same runs with chunk 1's parameters counted the other way."""
    args = train.parse_args([*TWIN_FLAGS, "--schedule", "dualpipe"])
    norms, weights = reference_run(train, model, data, args, TWIN_STEPS, CLIP)
    found = dict(reference=norms, names=sorted(weights))
    for schedule in ("dualpipe", "dualpipev"):
        for label, flip in ((schedule, False), (f"{schedule}_control", True)):
            run = train.build(train.parse_args([*TWIN_FLAGS, "--schedule", schedule]), device)
            if flip:
                count_chunk_1_the_other_way(run)
            logged = [train.train_step(run, step)["grad_norm"] for step in range(TWIN_STEPS)]
            errors = {n: rel_err(p.detach(), weights[n].detach()) for n, p in run.model.named_parameters()}
            found[label] = dict(norms=logged, weight_errors=errors)
    return found


SCALED = {"constant": ["--loss-scale", "1024"], "fp16": ["--precision", "fp16"]}


def scaled_norms(train, model, data, device):
    """Under a loss scale S (a constant one in fp32, fp16's dynamic one): the grad_norm the step returns, and
    whether it scaled every gradient by exactly CLIP / (norm + 1e-6) after the unscale, as a norm of the
    unscaled gradients must. Control: the constant scale's step with its unscale made a no-op (the scaler's
    inv_scale patched to 1), whose norm is S times too large."""
    found = {}
    for label, flags, unscale in (*((k, v, True) for k, v in SCALED.items()), ("control", SCALED["constant"], False)):
        args = train.parse_args([*FLAGS, "--clip-grad", str(CLIP), *flags])
        run = train.build(args, device)
        train.compute_gradients(run, 0)
        scale, inv_scale = run.optimizer.loss_scale, run.optimizer.scaler.inv_scale
        unscaled = [g.clone().mul_(inv_scale) for g in run.optimizer.main_grads()]
        patch = nullcontext() if unscale else mock.patch.object(type(run.optimizer.scaler), "inv_scale", 1.0)
        with patch:
            norm = run.optimizer.step()["grad_norm"]
        factor = CLIP / (norm + 1e-6)
        clipped = all(torch.equal(g, u.mul_(factor)) for g, u in zip(run.optimizer.main_grads(), unscaled))
        found[label] = dict(norm=norm, scale=scale, clipped=clipped)
    found["reference"] = reference_norm(train, model, data, train.parse_args([*FLAGS]))
    return found


def main(step_dir, mode, out):
    sys.path.insert(0, os.path.abspath(step_dir))
    torch.set_num_threads(1)
    import data
    from support import distributed
    import mixed_precision
    import model
    import train

    device = distributed.init_distributed("cpu", 60)
    found = {"inf": lambda: injected_inf(train, device),
             "norm": lambda: global_norm(train, mixed_precision, device, model, data),
             "scaled": lambda: scaled_norms(train, model, data, device),
             "twins": lambda: twin_norms(train, model, data, device)}[mode]()
    write_per_rank(found, out)
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])

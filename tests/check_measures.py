"""Check a step's measuring code on inputs whose answers are known by hand.

    python tests/check_measures.py STEP_DIR   ->  prints a JSON report {check: problem or null}

  * the bubble (timeline.busy_fractions) on hand-built event lists: forwards,
    backwards, recomputes, waits, several ranks and steps; in step 08 a B and a W,
    with a control that leaves W out of the busy time (run because the step splits its
    backward, weight_grad_store.py, whatever its timeline lists as compute);
  * step 08: a real stage's W computes every weight gradient inside its "W" span, so its work is
    counted where it runs (control: a W whose work runs before an empty span);
  * the timeline records nothing while disabled;
  * on CUDA (faked here: events stamped from a GPU clock set by hand) a span waits for
    nothing: one synchronize as a step starts and one as it ends, none while disabled,
    and each event lands where the GPU stamped it; two broken timelines must fail this;
  * the activation meter on a known set of saved tensors, a recompute's stored input, and
    microbatches that are views of one storage (step 02 on);
  * --deallocate really frees an output's storage, checked on the tensor itself, and the
    backward through the freed output still gives the same input gradient (step 04 on); the
    activation meter's live bytes drop by exactly the output's bytes (control: a meter whose
    forget does nothing).
"""
import json
import os
import sys
import time
from contextlib import contextmanager
from functools import partial
from unittest import mock

import torch


def event(rank, step, kind, start, end):
    return dict(kind=kind, microbatch=0, step=step, rank=rank, start=start, end=end)


def check_bubble(timeline):
    """Two ranks, two steps, times in quarters so the answers are exact."""
    events = [
        # step 0 begins with rank 1's wait at t = 1.0; the last compute ends at 5.0: a window of 4
        event(1, 0, "recv", 1.0, 2.0), event(0, 0, "forward", 1.5, 2.0), event(0, 0, "send", 2.0, 2.25),
        event(1, 0, "forward", 2.0, 3.0), event(1, 0, "backward", 3.0, 4.0), event(0, 0, "recv", 2.25, 4.0),
        event(0, 0, "recompute", 4.0, 4.5), event(0, 0, "backward", 4.5, 5.0), event(0, 0, "allreduce", 5.0, 6.0),
        # step 1: a window of 2 (10.0 to 12.0); rank 0 computes 1, rank 1 computes 2
        event(0, 1, "forward", 10.0, 11.0), event(1, 1, "forward", 10.0, 11.0), event(1, 1, "backward", 11.0, 12.0),
    ]
    expected = {0: [1.5 / 4, 2 / 4], 1: [1 / 2, 2 / 2]}
    for step, answer in expected.items():
        got = timeline.busy_fractions(events, 2, [step])
        if got != answer:
            return f"step {step}: busy fractions {got}, expected {answer}"
    both = timeline.busy_fractions(events, 2, [0, 1])
    if both != [(a + b) / 2 for a, b in zip(expected[0], expected[1])]:
        return f"mean over steps 0 and 1: {both}"
    return None


def check_split_bubble(timeline):
    """Step 08: a backward split into B and W is busy time in both parts. One rank, one step: forward 1, B 1, W 1
    and a wait of 1 in a window of 4 is 3/4 busy. Control: with W left out of the compute kinds (the edit of
    timeline.COMPUTE a broken busy time amounts to) the same events must not give 3/4."""
    events = [event(0, 0, "forward", 0.0, 1.0), event(0, 0, "recv", 1.0, 2.0), event(0, 0, "B", 2.0, 3.0),
              event(0, 0, "W", 3.0, 4.0)]
    if timeline.busy_fractions(events, 1, [0]) != [3 / 4]:
        return f"busy fractions {timeline.busy_fractions(events, 1, [0])} with B and W boxes, expected [0.75]"
    with mock.patch.object(timeline, "COMPUTE", tuple(k for k in timeline.COMPUTE if k != "W")):
        if timeline.busy_fractions(events, 1, [0]) == [3 / 4]:
            return "control: a busy time without W gave 3/4 all the same"
    return None


def changed(before: dict, after: dict) -> list:
    """The parameters whose gradient differs between two snapshots {name: gradient or None}."""
    return [n for n in before if (before[n] is None) != (after[n] is None)
            or before[n] is not None and not torch.equal(before[n], after[n])]


def w_outside_its_box(model, stage_module, timeline, store, stage_class=None) -> list:
    """Step 08: one stage's forward and split backward (B) of a microbatch, then its W (backward_weights) with the
    gradients watched at every step of the way: [parameters whose gradient W changed outside its "W" span],
    or a line saying W changed none inside it."""
    net, cfg = tiny_stage_model(model, first=False, last=False)
    stage = (stage_class or stage_module.PipelineStage)(net)
    x = torch.randn(2, cfg.seq_len, cfg.hidden)
    with store.WeightGradStore.splittable():
        out = stage.forward(0, x, None)
    stage.backward(0, x, out, torch.ones_like(out), split=True)
    grads = lambda: {n: None if p.grad is None else p.grad.clone() for n, p in net.named_parameters()}
    snapshots = [grads()]  # before W; at its span's entry and exit; after W

    class Watching(timeline.Timeline):
        @contextmanager
        def _record(self, kind, microbatch, info):
            watched = [grads] if kind == "W" else []  # the snapshots at W's entry and exit
            snapshots.extend(take() for take in watched)
            yield
            snapshots.extend(take() for take in watched)

    previous = timeline.install(Watching(0, torch.device("cpu")))
    try:
        stage.backward_weights(0)
    finally:
        timeline.install(previous)
    snapshots.append(grads())
    if len(snapshots) != 4:
        return [f"W recorded {len(snapshots) // 2 - 1} spans, expected one"]
    before, entry, exit_, after = snapshots
    outside = changed(before, entry) + changed(exit_, after)
    return outside or ([] if changed(entry, exit_) else ["W changed no gradient inside its span"])


def check_w_in_its_box(model, stage_module, timeline, store):
    """Step 08: every weight gradient W computes is computed inside W's timeline span, so that the bubble counts
    W's work as busy time where it runs. Control: a stage whose backward_weights runs the W before an empty span
    (its work outside its box, counted as idle) must fail."""
    outside = w_outside_its_box(model, stage_module, timeline, store)
    if outside:
        return f"W's work outside its span: {outside[:4]}"

    class EmptyBox(stage_module.PipelineStage):
        def backward_weights(self, mb):
            store.WeightGradStore.pop((self.chunk, mb))
            with timeline.span("W", mb, chunk=self.chunk):
                pass

    if not w_outside_its_box(model, stage_module, timeline, store, EmptyBox):
        return "control: a W that works before its span passed all the same"
    return None


def check_timeline_off(timeline):
    line = timeline.Timeline(0, torch.device("cpu"), enabled=False)
    with line.span("forward", 0):
        pass
    line.enabled = True
    with line.span("backward", 1, chunk=0):
        pass
    kinds = [(e["kind"], e["microbatch"], e.get("chunk")) for e in line.events]
    ok = kinds == [("backward", 1, 0)] and line.events[0]["start"] <= line.events[0]["end"]
    return None if ok else f"recorded {kinds}: expected only the span made while enabled"


class FakeCuda:
    """torch.cuda's Event and synchronize on a CPU: an event is stamped with the GPU clock `gpu_ms`,
    which the check sets by hand, and every synchronize (a wait of the host for the GPU) is counted."""

    def __init__(self):
        self.gpu_ms, self.syncs = 0.0, 0

    def Event(self, enable_timing=False):
        clock = self

        class Event:
            def record(self):
                self.stamp = clock.gpu_ms

            def elapsed_time(self, end):
                return end.stamp - self.stamp

        return Event()

    def synchronize(self):
        self.syncs += 1


def check_cuda_timing(make_timeline):
    """make_timeline(enabled) -> a timeline for a CUDA device. Known answer: a step starts at GPU time
    100 ms; a forward runs from 102 to 106 ms and a receive from 106 to 107.5 ms."""
    cuda = FakeCuda()
    with mock.patch.object(torch.cuda, "Event", cuda.Event), mock.patch.object(torch.cuda, "synchronize",
                                                                               cuda.synchronize):
        off = make_timeline(enabled=False)
        off.start_step(0)
        with off.span("forward", 0):
            pass
        off.end_step()
        if cuda.syncs or off.events:
            return f"disabled: {cuda.syncs} synchronizes, {len(off.events)} events"
        line, cuda.gpu_ms = make_timeline(enabled=True), 100.0
        before = time.time()
        line.start_step(1)
        after = time.time()
        for kind, start, end in (("forward", 102.0, 106.0), ("recv", 106.0, 107.5)):
            cuda.gpu_ms = start
            with line.span(kind, 0):
                cuda.gpu_ms = end
        if cuda.syncs != 1:
            return f"{cuda.syncs} synchronizes by the end of the step's last span: only the step's start may wait"
        line.end_step()
        if cuda.syncs != 2:
            return f"{cuda.syncs} synchronizes in the step, expected 2 (its start and its end)"
        got = [(e["kind"], e["start"], e["end"]) for e in line.events]
        # the step's start (GPU 100 ms) happened between `before` and `after` on the wall clock
        ok = [kind for kind, start, end in got] == ["forward", "recv"] and all(
            before - 1e-6 <= start - start_ms / 1e3 <= after + 1e-6
            and abs((end - start) - (end_ms - start_ms) / 1e3) < 1e-6
            for (_, start, end), start_ms, end_ms in zip(got, (2.0, 6.0), (6.0, 7.5)))
        return None if ok else f"events {got}: expected forward at +2..6 ms and recv at +6..7.5 ms of the step's start"


def check_cuda_timing_controls(timeline):
    """Negative controls: a timeline that synchronizes at every span, and one that reads the host's clock
    instead of the GPU's stamps, must both fail check_cuda_timing."""

    class Synchronizing(timeline.Timeline):
        def span(self, kind, microbatch=None, **info):
            if self.enabled:
                torch.cuda.synchronize()
            return super().span(kind, microbatch, **info)

    controls = dict(synchronizing=lambda enabled: Synchronizing(0, torch.device("cuda"), enabled=enabled),
                    host_clock=lambda enabled: timeline.Timeline(0, torch.device("cpu"), enabled=enabled))
    passed = [name for name, make in controls.items() if check_cuda_timing(make) is None]
    return f"broken timelines passed the CUDA timing check: {passed}" if passed else None


def check_meter(memory):
    """Saved tensors counted once per storage; parameters skipped; release and disable."""
    weight = torch.nn.Linear(256, 256, bias=False)
    meter = memory.ActivationMeter(weight)
    x = torch.randn(4, 256, requires_grad=True)
    with meter.saving("a"):
        y = weight(x)  # saves x (and the weight, which is skipped)
        z = y * y  # saves y twice: one storage
    expected = x.untyped_storage().nbytes() + y.untyped_storage().nbytes()
    if (meter.live_bytes, meter.peak_stored_microbatches) != (expected, 1):
        return f"after one microbatch: {meter.live_bytes} bytes, {meter.peak_stored_microbatches} microbatches"
    batch = torch.zeros(4, 1000)
    first, second = batch.chunk(2)
    meter.keep("b", first)
    meter.keep("c", second)  # a view of the same storage: no new bytes
    if meter.live_bytes != expected + batch.untyped_storage().nbytes() or meter.peak_stored_microbatches != 3:
        return f"views of one storage: {meter.live_bytes - expected} bytes, not {batch.untyped_storage().nbytes()}"
    for key in ("a", "b"):
        meter.release(key)
    if meter.live_bytes != batch.untyped_storage().nbytes():
        return f"after releasing a and b, {meter.live_bytes} bytes live"
    meter.release("c")
    off = memory.ActivationMeter(weight, enabled=False)
    with off.saving("a"):
        weight(x).sum()
    off.keep("b", batch)
    if meter.live_bytes or off.live_bytes or off.peak_bytes:
        return "bytes left after release, or counted while disabled"
    del z
    return None


def tiny_stage_model(model, first, last):
    cfg = model.ModelConfig(n_layers=2, hidden=32, n_heads=2, seq_len=8)
    return model.Transformer(cfg, [0] if first else [1], first=first, last=last, seed=0), cfg


def check_recompute_input(model, memory, stage_module):
    """With recompute, a stage's forward stores exactly its input: nothing autograd saves."""
    net, cfg = tiny_stage_model(model, first=False, last=False)
    meter = memory.ActivationMeter(net)
    x = torch.randn(2, cfg.seq_len, cfg.hidden)
    stage = stage_module.PipelineStage(net, recompute=True, meter=meter)
    stage.forward(0, x, None)
    if meter.live_bytes != x.untyped_storage().nbytes() or meter.peak_stored_microbatches != 1:
        return f"recompute forward stored {meter.live_bytes} bytes, expected the input's {x.untyped_storage().nbytes()}"
    return None


def check_gpipe_recompute_input(model, memory, pipeline):
    """Step 02's GPipe: with recompute, forward_step stores exactly the microbatch's token ids."""
    cfg = model.ModelConfig(n_layers=1, hidden=32, n_heads=2, seq_len=8)
    net = model.Transformer(cfg, seed=0)
    meter = memory.ActivationMeter(net)
    tokens, targets = torch.randint(0, cfg.vocab_size, (2, 2, cfg.seq_len))
    stage = pipeline.Stage(net, 0, 1, None, torch.device("cpu"), meter, True)
    pipeline.forward_step(stage, 0, tokens, targets)
    if meter.live_bytes != tokens.untyped_storage().nbytes() or meter.peak_stored_microbatches != 1:
        return f"recompute stored {meter.live_bytes} bytes, expected the tokens' {tokens.untyped_storage().nbytes()}"
    return None


def check_deallocate(model, stage_module):
    """The output's storage shrinks to one element, and the backward through it is unchanged."""
    net, cfg = tiny_stage_model(model, first=False, last=False)
    x = torch.randn(2, cfg.seq_len, cfg.hidden)
    grad = torch.randn(2, cfg.seq_len, cfg.hidden)
    input_grads = []
    for deallocate in (False, True):
        stage = stage_module.PipelineStage(net, deallocate=deallocate)
        x_in = x.clone()
        out = stage.forward(0, x_in, None)
        before = out.untyped_storage().nbytes()
        stage.deallocate_output(0, out)
        after = out.untyped_storage().nbytes()
        if deallocate and not (before == x.numel() * 4 and after == out.element_size()):
            return f"--deallocate left {after} bytes of the output's {before}"
        if not deallocate and after != before:
            return "without --deallocate the output lost its storage"
        net.zero_grad()
        input_grads.append(stage.backward(0, x_in, out, grad))
    if not torch.equal(*input_grads):
        return "the input gradient through a deallocated output differs"
    return None


def check_deallocate_meter(model, memory, stage_module):
    """With --deallocate the meter stops counting a sent output: its live bytes drop by exactly the output's
    bytes (and without it, not at all). Control: with the meter's forget made a no-op, the drop is missed."""
    def freed(deallocate):
        net, cfg = tiny_stage_model(model, first=False, last=False)
        meter = memory.ActivationMeter(net)
        stage = stage_module.PipelineStage(net, deallocate=deallocate, meter=meter)
        out = stage.forward(0, torch.randn(2, cfg.seq_len, cfg.hidden), None)
        size, live = out.untyped_storage().nbytes(), meter.live_bytes
        stage.deallocate_output(0, out)
        return live - meter.live_bytes, size

    (dropped, size), (kept, _) = freed(True), freed(False)
    if dropped != size or kept != 0:
        return f"the meter dropped {dropped} bytes with --deallocate (the output has {size}), {kept} without"
    with mock.patch.object(memory.ActivationMeter, "forget", lambda *args: None):
        if freed(True)[0] == size:
            return "control: a meter that forgets nothing still dropped the output's bytes"
    return None


def main(step_dir):
    sys.path.insert(0, os.path.abspath(step_dir))
    import model
    from support import timeline

    on_cuda = partial(timeline.Timeline, 0, torch.device("cuda"))
    report = dict(bubble=check_bubble(timeline), timeline_off=check_timeline_off(timeline),
                  cuda_timing=check_cuda_timing(on_cuda), cuda_timing_controls=check_cuda_timing_controls(timeline))
    if os.path.exists(os.path.join(step_dir, "weight_grad_store.py")):  # step 08's backward split into B and W
        import stage
        import weight_grad_store
        report["split_bubble"] = check_split_bubble(timeline)
        report["w_in_its_box"] = check_w_in_its_box(model, stage, timeline, weight_grad_store)
    has_meter = os.path.exists(os.path.join(step_dir, "support", "memory.py"))  # step 02 on
    if has_meter:
        from support import memory
        report["meter"] = check_meter(memory)
    if os.path.exists(os.path.join(step_dir, "pipeline.py")) and has_meter:
        import pipeline
        report["recompute_input"] = check_gpipe_recompute_input(model, memory, pipeline)
    if os.path.exists(os.path.join(step_dir, "stage.py")):
        import stage
        report["recompute_input"] = check_recompute_input(model, memory, stage)
        if hasattr(stage.PipelineStage, "deallocate_output"):
            report["deallocate"] = check_deallocate(model, stage)
            report["deallocate_meter"] = check_deallocate_meter(model, memory, stage)
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])

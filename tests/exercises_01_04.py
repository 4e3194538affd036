"""The exercises of steps 01-04, as data (the catalogue's format: tests/exercises.py)."""

EXERCISES = [
    # ---------------------------------------------------------------- step 01: the four verbs
    dict(
        id="01.verbs", step="step01_naive",
        functions=[("pipeline.py", "recv_forward"), ("pipeline.py", "send_forward"),
                   ("pipeline.py", "recv_backward"), ("pipeline.py", "send_backward")],
        summary="write the four verbs: receive/send an activation from/to the previous/next stage, "
                "a gradient the other way",
        task="Every schedule of the course is made of four point-to-point verbs. recv_forward receives the "
             "activation stage-1 computed (blocking dist.recv into a fresh buffer of stage.shape); send_forward "
             "sends this stage's output to stage+1 (detached: the graph stays here); recv_backward and "
             "send_backward move d(loss)/d(activation) the other way. Wrap each message in a span (timeline's, "
             "which pipeline.py imports), as the other functions wrap their compute: the trace draws a box per "
             "span, and a message without one is invisible in it.",
        checks=[("verbs",),
                ("equivalence", 2, ["--pp", "2", "--layers", "4"]),
                ("equivalence", 4, ["--pp", "4", "--layers", "6"])],
        hints=["Stage s talks to its two neighbours only, and a message exists in the trace only inside a span.",
               "stage.index is the rank in the pipeline; a received tensor needs a buffer of stage.shape; "
               "forward_step shows how a span wraps work.",
               'with span("recv", what="recv activation"): dist.recv(x, src=stage.index - 1), into '
               "x = torch.empty(stage.shape, device=stage.device); sends go to stage.index + 1 (activations) "
               "or stage.index - 1 (gradients)."],
        wrong=[("the gradient sent forward, not back", "pipeline.py",
                "dist.send(input_grad, dst=stage.index - 1)", "dist.send(input_grad, dst=stage.index + 1)",
                ["send_backward on stage 1 of 4", "rank 2", "expected rank 0"]),
               ("incomplete: no span around the messages", "pipeline.py",
                ('    with span("recv", what="recv activation"):\n        dist.recv(x, src=stage.index - 1)',
                 '    with span("send", what="send activation"):\n        dist.send(out.detach(), dst=stage.index + 1)',
                 '    with span("recv", what="recv gradient"):\n        dist.recv(grad, src=stage.index + 1)',
                 '    with span("send", what="send gradient"):\n        dist.send(input_grad, dst=stage.index - 1)'),
                ("    dist.recv(x, src=stage.index - 1)", "    dist.send(out.detach(), dst=stage.index + 1)",
                 "    dist.recv(grad, src=stage.index + 1)", "    dist.send(input_grad, dst=stage.index - 1)"),
                ["recorded no message span", "recv_forward on stage 1"])],
        right=[("non-blocking operations, waited for at once", "pipeline.py",
                ("dist.recv(grad, src=stage.index + 1)", "dist.send(out.detach(), dst=stage.index + 1)"),
                ("dist.irecv(grad, src=stage.index + 1).wait()", "dist.isend(out.detach(), dst=stage.index + 1).wait()")),
               ("zeroed buffers, the span around the allocation too", "pipeline.py",
                ('    x = torch.empty(stage.shape, device=stage.device)\n    with span("recv", what="recv activation"):\n'
                 '        dist.recv(x, src=stage.index - 1)'),
                ('    with span("recv", what="recv activation"):\n        x = torch.zeros(stage.shape, device=stage.device)\n'
                 '        dist.recv(x, src=stage.index - 1)'))],
    ),
    dict(
        id="01.naive", step="step01_naive",
        functions=[("pipeline.py", "naive_forward_backward")],
        summary="run the whole batch forward through this stage, then backward; return the loss on the last stage",
        task="The naive pipeline: one batch, forward stage by stage, then backward stage by stage, one rank at "
             "a time. Use forward_step and backward_step; the last stage returns its (detached) loss, the "
             "others None.",
        checks=[("equivalence", 2, ["--pp", "2", "--layers", "4"])],
        hints=["One batch goes forward through every stage, then backward: each rank does both, in turn.",
               "forward_step returns (stage input, stage output); backward_step needs both.",
               "x, out = forward_step(...); backward_step(stage, x, out); the last stage returns out.detach()."],
        wrong=[("the backward left out", "pipeline.py",
                "    backward_step(stage, x, out)\n", "",
                ["no gradient"])],
        right=[("the last stage's return written as an if", "pipeline.py",
                "    return out.detach() if stage.is_last else None",
                "    if not stage.is_last:\n        return None\n    return out.detach()")],
    ),
    # ---------------------------------------------------------------- step 02: GPipe
    dict(
        id="02.gpipe", step="step02_gpipe",
        functions=[("pipeline.py", "gpipe_forward_backward")],
        summary="all forwards in microbatch order, then all backwards; return the batch's mean loss on the last stage",
        task="GPipe's fill-drain loop: run forward_step for every microbatch, keeping (input, output) of each "
             "(only the input with --recompute), then backward_step for every microbatch. The last stage "
             "returns the mean of the microbatch losses.",
        checks=[("equivalence", 2, ["--pp", "2", "--layers", "5", "--microbatches", "4"]),
                ("equivalence", 2, ["--pp", "2", "--layers", "5", "--microbatches", "4", "--recompute"])],
        hints=["Fill, then drain: keep what each backward needs until every forward is done.",
               "The batch loss is the mean of m microbatch losses; a kept tensor you still reference after its "
               "backward keeps its memory.",
               "Sum the last stage's detached losses and divide by m; set each kept (input, output) to None after "
               "its backward_step."],
        wrong=[("the loss summed, not averaged", "pipeline.py",
                "return None if loss_sum is None else loss_sum / len(microbatches)",
                "return None if loss_sum is None else loss_sum", ["loss at step"])],
        right=[("the mean as a product with 1/m", "pipeline.py",
                "return None if loss_sum is None else loss_sum / len(microbatches)",
                "return None if loss_sum is None else loss_sum * (1 / len(microbatches))")],
    ),
    dict(
        id="02.seed", step="step02_gpipe",
        functions=[("pipeline.py", "backward_step")],
        summary="backpropagate microbatch mb: receive its output gradient (the last stage seeds 1/m), "
                "recompute if asked, send the input gradient back",
        task="One microbatch's backward. The last stage has no gradient to receive: it seeds its loss with "
             "1/m, since the batch loss is the mean of m microbatch losses. With --recompute the stage kept "
             "only its input: run the stage again under autograd (inside the meter's saving) before the "
             "backward. Send x.grad to the previous stage unless this is the first.",
        checks=[("equivalence", 2, ["--pp", "2", "--layers", "5", "--microbatches", "4"]),
                ("equivalence", 2, ["--pp", "2", "--layers", "5", "--microbatches", "4", "--recompute"])],
        hints=["The batch loss is the mean of m microbatch losses: each microbatch's loss weighs 1/m.",
               "The last stage seeds its backward itself; with --recompute, the kept input must become a fresh "
               "leaf that requires grad (except on the first stage).",
               "out_grad = torch.full_like(out, 1 / microbatches) on the last stage."],
        wrong=[("the loss seeded with 1, not 1/m", "pipeline.py",
                "out_grad = torch.full_like(out, 1 / microbatches)", "out_grad = torch.full_like(out, 1.0)",
                ["grad of"])],
        right=[("the seed as ones divided by m", "pipeline.py",
                "out_grad = torch.full_like(out, 1 / microbatches)", "out_grad = torch.ones_like(out) / microbatches")],
    ),
    # ---------------------------------------------------------------- step 03: the engine
    dict(
        id="03.afab", step="step03_afab",
        functions=[("schedule.py", "afab_forward_backward")],
        summary="every forward (receive, run, send), then every backward, in microbatch order; return stash.loss",
        task="The engine's first schedule, on its classes: a Stash keeps what each microbatch's backward "
             "needs, comm (a PipelineComm) moves tensors. Forward every microbatch (comm.recv_forward, "
             "stash.forward, comm.send_forward), then backward every microbatch in microbatch order, 0 first "
             "(comm.recv_backward, stash.backward, comm.send_backward): the gradients come back in the order "
             "the activations went out.",
        checks=[("replay", ["afab"]),
                ("equivalence", 2, ["--pp", "2", "--dp", "1", "--layers", "4", "--microbatches", "4"]),
                ("equivalence", 4, ["--pp", "2", "--dp", "2", "--layers", "4", "--microbatches", "4"])],
        hints=["Two loops over the microbatches: every forward, then every backward, both from microbatch 0.",
               "The first stage's recv_forward returns None and its stash reads the tokens; the last "
               "stage's recv_backward returns None and the stash seeds the loss: no special cases needed.",
               "out = stash.forward(mb, comm.recv_forward()); comm.send_forward(out); then "
               "comm.send_backward(stash.backward(mb, comm.recv_backward())); return stash.loss."],
        wrong=[("the received gradient ignored", "schedule.py",
                "comm.send_backward(stash.backward(mb, comm.recv_backward()))",
                "comm.recv_backward()\n        comm.send_backward(stash.backward(mb, None))",
                ["backward of chunk", "microbatch 0"]),
               ("incomplete: the backwards in reverse microbatch order", "schedule.py",
                "    for mb in range(len(microbatches)):\n        comm.send_backward",
                "    for mb in reversed(range(len(microbatches))):\n        comm.send_backward",
                ["backwards ran for microbatches 1, 0", "not in microbatch order"])],
        right=[("the backward loop in three statements", "schedule.py",
                "        comm.send_backward(stash.backward(mb, comm.recv_backward()))",
                "        out_grad = comm.recv_backward()\n        input_grad = stash.backward(mb, out_grad)\n"
                "        comm.send_backward(input_grad)"),
               ("the forward loop over enumerate(microbatches)", "schedule.py",
                "    for mb in range(len(microbatches)):\n        out =",
                "    for mb, _ in enumerate(microbatches):\n        out =")],
    ),
    dict(
        id="03.verbs", step="step03_afab",
        functions=[("p2p.py", "PipelineComm.recv_forward"), ("p2p.py", "PipelineComm.send_forward"),
                   ("p2p.py", "PipelineComm.recv_backward"), ("p2p.py", "PipelineComm.send_backward")],
        summary="the four verbs as calls of communicate: recv_prev, send_next, recv_next, send_prev; "
                "nothing at the pipeline's ends",
        task="On the engine all four verbs are one worker, communicate (Megatron's _communicate), which "
             "posts the P2POps of one exchange together. Write each verb as one call of it, returning the "
             "received tensor: an activation comes from the previous stage, a gradient from the next. The "
             "first stage receives no activation and sends no gradient; the last the reverse.",
        checks=[("replay", ["afab"]),
                ("equivalence", 2, ["--pp", "2", "--dp", "1", "--layers", "4", "--microbatches", "4"]),
                ("equivalence", 4, ["--pp", "4", "--dp", "1", "--layers", "4", "--microbatches", "4"])],
        hints=["Activations flow to the next stage, gradients to the previous; the pipeline's ends skip one side.",
               "communicate returns (from previous, from next); self.is_first and self.is_last say where the "
               "pipeline ends.",
               "recv_backward: None if self.is_last else self.communicate(recv_next=True)[1]; "
               "send_backward: if not self.is_first: self.communicate(send_prev=input_grad)."],
        wrong=[("the gradient received from the previous stage", "p2p.py",
                "return None if self.is_last else self.communicate(recv_next=True)[1]",
                "return None if self.is_first else self.communicate(recv_prev=True)[0]",
                ["deadlock", "recv from"])],
        right=[("the received tensor unpacked by name", "p2p.py",
                "        return None if self.is_first else self.communicate(recv_prev=True)[0]",
                "        if self.is_first:\n            return None\n        from_previous, _ = "
                "self.communicate(recv_prev=True)\n        return from_previous")],
    ),
    # ---------------------------------------------------------------- step 04: 1F1B
    dict(
        id="04.warmup", step="step04_1f1b",
        functions=[("schedule.py", "warmup_microbatches")],
        summary="return how many forwards stage `stage` of `pp` runs before its first backward in 1F1B",
        task="1F1B's warm-up: stage s runs forwards until the first gradient can come back from the last "
             "stage, enough to fill the pipeline below it, and never more than the m microbatches there are.",
        hide=[("schedule.py", "    warm-up:   min(p-s-1, m) forwards, enough to fill the pipeline below it,\n",
               "    warm-up:   forwards, enough to fill the pipeline below it (how many: exercise 04.warmup),\n"),
              ("schedule.py", "At most min(p-s, m) microbatches are in flight on stage s: activation memory is bounded by p, "
               "not m.\n", "Activation memory is bounded by p, not m.\n")],
        checks=[("replay", ["1f1b"]),
                ("pytest", "tests/test_schedules.py::test_schedule_order_is_complete_and_deadlock_free[{step}]")],
        hints=["A stage's first backward waits for its microbatch to reach the last stage and come back.",
               "The last stage runs no warm-up: its forward's output is the loss, its backward can start at once; "
               "count the stages below s.",
               "min(p - s - 1, m)."],
        right=[("the cap written as an if", "schedule.py",
                "return min(pp - stage - 1, microbatches)",
                "return pp - stage - 1 if pp - stage - 1 < microbatches else microbatches")],
        wrong=[("one forward too many", "schedule.py",
                "return min(pp - stage - 1, microbatches)", "return min(pp - stage, microbatches)",
                ["forwards before the first backward", "warm-up"])],
    ),
    dict(
        id="04.1f1b", step="step04_1f1b",
        functions=[("schedule.py", "one_f_one_b_forward_backward")],
        summary="warm-up forwards, then one forward and one backward (oldest microbatch first) until every "
                "forward is done, then the remaining backwards; return stash.loss",
        task="One-forward-one-backward. Warm-up: warmup_microbatches(...) forwards. Steady state: forward "
             "the newest microbatch, then backward the oldest, using the combined verbs "
             "send_forward_recv_backward and send_backward_recv_forward (the neighbour is sending to you at "
             "that moment: posted apart, the two sends can deadlock). Cool-down: the remaining backwards. "
             "Free each sent output with stash.deallocate(mb) (with --deallocate "
             "the stage drops its values). PipeDream (pipedream.py) runs its whole run through this same function.",
        checks=[("replay", ["1f1b"]),
                ("equivalence", 2, ["--pp", "2", "--layers", "5", "--microbatches", "4", "--p2p", "ordered"]),
                ("pytest", "tests/test_schedules.py::test_schedule_order_is_complete_and_deadlock_free[{step}]")],
        hints=["Three phases: warm-up forwards, one forward and one backward (the oldest) at a time, the rest of "
               "the backwards; each sent output is freed.",
               "In the steady state's i-th round the forward is of microbatch warmup+i, the backward of microbatch "
               "i; the last steady round sends its input gradient alone: there is no next input to receive.",
               "out_grad = comm.send_forward_recv_backward(stash.forward(warmup + i, x)); stash.deallocate("
               "warmup + i); x = comm.send_backward_recv_forward(stash.backward(i, out_grad)).",
               ("deadlock", "Posted apart, a send waits for its receive, and both neighbours send first: post each "
                "send with the receive of the same round in one exchange (send_forward_recv_backward, "
                "send_backward_recv_forward).")],
        wrong=[("the steady state back-propagates the newest microbatch", "schedule.py",
                "fwd_mb, bwd_mb = warmup + i, i", "fwd_mb, bwd_mb = warmup + i, warmup + i",
                ["raised", "one_f_one_b_forward_backward"]),
               ("every rank sends first, then receives", "schedule.py",
                ("        out_grad = comm.send_forward_recv_backward(out)",
                 "            x = comm.send_backward_recv_forward(input_grad)"),
                ("        comm.send_forward(out)\n        out_grad = comm.recv_backward()",
                 "            comm.send_backward(input_grad)\n            x = comm.recv_forward()"),
                ["deadlock", "NCCL"]),
               ("incomplete: no stash.deallocate", "schedule.py",
                ("        comm.send_forward(stash.forward(mb, comm.recv_forward()))\n        stash.deallocate(mb)\n",
                 "        stash.deallocate(fwd_mb)\n"),
                ("        comm.send_forward(stash.forward(mb, comm.recv_forward()))\n", ""),
                ["never deallocated", "--deallocate frees nothing"])],
        right=[("the last steady round tested the other way", "schedule.py",
                "        if i == steady - 1:\n            comm.send_backward(input_grad)\n        else:  # send the "
                "gradient back while the previous stage sends our next input\n            x = "
                "comm.send_backward_recv_forward(input_grad)",
                "        if i < steady - 1:\n            x = comm.send_backward_recv_forward(input_grad)\n"
                "        else:\n            comm.send_backward(input_grad)"),
               ("the output freed after the backward", "schedule.py",
                "        stash.deallocate(fwd_mb)\n        input_grad = stash.backward(bwd_mb, out_grad)\n",
                "        input_grad = stash.backward(bwd_mb, out_grad)\n        stash.deallocate(fwd_mb)\n")],
    ),
    dict(
        id="04.dealloc", step="step04_1f1b",
        functions=[("stage.py", "deallocate_output")],
        summary="free the values of a sent output but keep its autograd node",
        task="Megatron's deallocate_output_tensor: once a stage has sent its output, the next stage holds "
             "those values; this stage needs only the output's place in the graph for the backward. Replace "
             "the tensor's storage by a one-element tensor of its device and dtype (custom_backward then "
             "runs the backward without the shape check). Refuse a view: freeing it frees nothing.",
        checks=[("pytest", "tests/test_measurements.py::test_measuring_code_gives_known_answers[{step}]"),
                ("equivalence", 2, ["--pp", "2", "--layers", "5", "--microbatches", "4", "--deallocate"])],
        hints=["The graph needs the output tensor object, not its values: keep the object, swap its storage.",
               "Assigning to a local name frees nothing: change what the tensor object holds; out._base is not "
               "None for a view.",
               "assert out._base is None; out.data = torch.empty((1,), device=out.device, dtype=out.dtype)."],
        right=[("a zeroed one-element storage, a view refused by an exception", "stage.py",
                ('    assert out._base is None, "freeing a view would not free the memory of the tensor it views"',
                 "out.data = torch.empty((1,), device=out.device, dtype=out.dtype)"),
                ('    if out._base is not None:\n        raise ValueError("freeing a view frees nothing")',
                 "out.data = torch.zeros(1, device=out.device, dtype=out.dtype)"))],
        wrong=[("a new tensor bound to the local name", "stage.py",
                "out.data = torch.empty((1,), device=out.device, dtype=out.dtype)",
                "out = torch.empty((1,), device=out.device, dtype=out.dtype)",
                ["--deallocate left"])],
    ),
    dict(
        id="04.version", step="step04_1f1b",
        functions=[("pipedream.py", "version_rule")],
        summary="return microbatch -> the weight version its forward runs on (None: the live one), for "
                "2BW and vertical sync",
        task="PipeDream's versions: with plain weight stashing each forward reads the live weights (return "
             "None). Vertical sync runs microbatch mb on the version stage 0 used, which has had one update "
             "per backward, and in 1F1B its backward of j follows its forward of j + p-1. PipeDream-2BW makes "
             "a version per batch of m: batch t runs on W(t-1), batches 0 and 1 on W(0).",
        checks=[("replay", ["1f1b"], "pipedream"),
                ("pytest", "tests/test_schedules.py::test_pipedream_weight_versions[{step}]")],
        hints=["A version is the number of updates the weights have had; a forward must run on the version its "
               "backward will see.",
               "Versions count from 0 and never go below it; mb // m is the batch of microbatch mb; stage 0 is "
               "p-1 forwards ahead of its backwards.",
               "2BW: max(0, mb // m - 1); vertical sync: max(0, mb - (p - 1)); else None."],
        right=[("2BW's first batches written as an if", "pipedream.py",
                "return lambda mb: max(0, mb // args.microbatches - 1)",
                "return lambda mb: mb // args.microbatches - 1 if mb >= args.microbatches else 0")],
        wrong=[("vertical sync one version off", "pipedream.py",
                "return lambda mb: max(0, mb - (args.pp - 1))", "return lambda mb: max(0, mb - args.pp)",
                ["version"])],
    ),
]

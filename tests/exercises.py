"""The course's exercises, as data: one function (or a small group) per exercise that carries a step's idea.

tests/exercise.py reads this catalogue (list, start, check); tests/test_exercises.py proves every entry.
Each entry:

  id        "NN.name", NN the step
  step      the step folder the learner's copy is made from
  functions [(file, qualified name)]: each keeps its signature and docstring, its body becomes a stub
  summary   one line: the task, also the stub's message
  task      a paragraph: what to write and why
  checks    the graded checks, fastest first (see CHECKS in tests/exercise.py):
              ("replay", [schedule, ...])      the step's schedules replayed without a model, pp <= 4, m <= 8
              ("replay", [...], "pipedream")   ... then PipeDream's weight versions (tests/weight_versions.py)
              ("replay", [...], "two_way")     ... then DualPipe's eight phases (tests/two_way.py)
              ("equivalence", world, flags)    one small run against the single device (tests/harness.py)
              ("pytest", node id, ...)         the step's own tests of that function
  hints     one or two; a (key word, hint) pair is shown instead of the first plain hint when the check's
            report holds the key word (a deadlock calls for another hint than a wrong microbatch)
  wrong     the typical wrong answers: (what, file, old text, new text, key words the diagnosis must show), old
            and new texts or tuples of them (several places); applied to the course's own code, each must fail
            its checks with those words in the diagnosis (tests/test_exercises.py)

A function that moves to another file or is renamed is updated here, in one place.
"""

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
             "send_backward move d(loss)/d(activation) the other way. Wrap each in a span (timeline's, which "
             "pipeline.py imports), as the other functions do.",
        checks=[("equivalence", 2, ["--pp", "2", "--layers", "4"]),
                ("equivalence", 4, ["--pp", "4", "--layers", "6"])],
        hints=["Stage s talks to ranks s-1 and s+1 only: stage.index is the rank in the pipeline.",
               "A received tensor needs a buffer: torch.empty(stage.shape, device=stage.device)."],
        wrong=[("the gradient sent forward, not back", "pipeline.py",
                "dist.send(input_grad, dst=stage.index - 1)", "dist.send(input_grad, dst=stage.index + 1)",
                ["send_backward"])],
    ),
    dict(
        id="01.naive", step="step01_naive",
        functions=[("pipeline.py", "naive_forward_backward")],
        summary="run the whole batch forward through this stage, then backward; return the loss on the last stage",
        task="The naive pipeline: one batch, forward stage by stage, then backward stage by stage, one rank at "
             "a time. Use forward_step and backward_step; the last stage returns its (detached) loss, the "
             "others None.",
        checks=[("equivalence", 2, ["--pp", "2", "--layers", "4"])],
        hints=["forward_step returns (stage input, stage output); backward_step needs both."],
        wrong=[("the backward left out", "pipeline.py",
                "    backward_step(stage, x, out)\n", "",
                ["no gradient"])],
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
        hints=["The batch loss is the mean of m microbatch losses: sum them, divide by m.",
               "Drop your reference to a microbatch's tensors after its backward, or the memory stays."],
        wrong=[("the loss summed, not averaged", "pipeline.py",
                "return None if loss_sum is None else loss_sum / len(microbatches)",
                "return None if loss_sum is None else loss_sum", ["loss at step"])],
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
        hints=["d(batch mean)/d(microbatch mean) = 1/m: torch.full_like(out, 1 / microbatches).",
               "A recomputed input must be a fresh leaf that requires grad (except on the first stage)."],
        wrong=[("the loss seeded with 1, not 1/m", "pipeline.py",
                "out_grad = torch.full_like(out, 1 / microbatches)", "out_grad = torch.full_like(out, 1.0)",
                ["grad of"])],
    ),
    # ---------------------------------------------------------------- step 03: the engine
    dict(
        id="03.afab", step="step03_afab",
        functions=[("schedule.py", "afab_forward_backward")],
        summary="every forward (receive, run, send), then every backward, in microbatch order; return stash.loss",
        task="The engine's first schedule, on its classes: a Stash keeps what each microbatch's backward "
             "needs, comm (a PipelineComm) moves tensors. Forward every microbatch (comm.recv_forward, "
             "stash.forward, comm.send_forward, stash.deallocate), then backward every microbatch "
             "(comm.recv_backward, stash.backward, comm.send_backward).",
        checks=[("equivalence", 2, ["--pp", "2", "--dp", "1", "--layers", "4", "--microbatches", "4"]),
                ("equivalence", 4, ["--pp", "2", "--dp", "2", "--layers", "4", "--microbatches", "4"])],
        hints=["The first stage's recv_forward returns None and its stash reads the tokens; the last "
               "stage's recv_backward returns None and the stash seeds the loss: no special cases needed."],
        wrong=[("the received gradient ignored", "schedule.py",
                "comm.send_backward(stash.backward(mb, comm.recv_backward()))",
                "comm.recv_backward()\n        comm.send_backward(stash.backward(mb, None))",
                ["grad can be implicitly created only for scalar outputs"])],
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
        checks=[("equivalence", 2, ["--pp", "2", "--dp", "1", "--layers", "4", "--microbatches", "4"]),
                ("equivalence", 4, ["--pp", "4", "--dp", "1", "--layers", "4", "--microbatches", "4"])],
        hints=["communicate returns (from previous, from next): take the one you asked for.",
               "self.is_first and self.is_last say where the pipeline ends."],
        wrong=[("the gradient received from the previous stage", "p2p.py",
                "return None if self.is_last else self.communicate(recv_next=True)[1]",
                "return None if self.is_first else self.communicate(recv_prev=True)[0]",
                ["error"])],
    ),
    # ---------------------------------------------------------------- step 04: 1F1B
    dict(
        id="04.warmup", step="step04_1f1b",
        functions=[("schedule.py", "warmup_microbatches")],
        summary="return how many forwards stage `stage` of `pp` runs before its first backward in 1F1B",
        task="1F1B's warm-up: stage s runs forwards until the first gradient can come back from the last "
             "stage, enough to fill the pipeline below it, and never more than the m microbatches there are.",
        checks=[("replay", ["1f1b"]),
                ("pytest", "tests/test_schedules.py::test_schedule_order_is_complete_and_deadlock_free[{step}]")],
        hints=["The last stage runs no warm-up: its forward's output is the loss, its backward can start at once.",
               "Count the stages below s: p-s-1."],
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
             "PipeDream (pipedream.py) runs its whole run through this same function.",
        checks=[("replay", ["1f1b"]),
                ("equivalence", 2, ["--pp", "2", "--layers", "5", "--microbatches", "4", "--p2p", "ordered"]),
                ("pytest", "tests/test_schedules.py::test_schedule_order_is_complete_and_deadlock_free[{step}]")],
        hints=["In the steady state's i-th round the forward is of microbatch warmup+i, the backward of microbatch i.",
               "The last steady round sends its input gradient alone: there is no next input to receive.",
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
                ["deadlock", "NCCL"])],
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
        hints=["Assigning to a local name frees nothing: change what the tensor object holds (its .data).",
               "out._base is not None for a view."],
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
        hints=["Versions count from 0 and never go below it: max(0, ...).",
               "mb // m is the batch of microbatch mb."],
        wrong=[("vertical sync one version off", "pipedream.py",
                "return lambda mb: max(0, mb - (args.pp - 1))", "return lambda mb: max(0, mb - args.pp)",
                ["version"])],
    ),
    # ---------------------------------------------------------------- step 05: interleaved
    dict(
        id="05.warmup", step="step05_interleaved",
        functions=[("schedule.py", "interleaved_warmup")],
        summary="return the virtual-microbatch forwards rank `stage` runs before its first backward in the "
                "interleaved schedule",
        task="Megatron's interleaved warm-up: 1F1B's count over v chunks per rank. A rank runs (p-s-1) "
             "virtual microbatches twice over (its first backward comes after the activation went down and "
             "the gradient came back up through the ring), plus (v-1)·p to fill its other chunks, and never "
             "more than the v·m there are.",
        checks=[("replay", ["interleaved"]),
                ("pytest", "tests/test_schedules.py::test_schedule_order_is_complete_and_deadlock_free[{step}]")],
        hints=["Megatron-LM: num_warmup_microbatches = (pp - rank - 1) * 2 + (v - 1) * pp, capped at the total."],
        wrong=[("the ring's return trip forgotten", "schedule.py",
                "return min((pp - stage - 1) * 2 + (virtual - 1) * pp, microbatches * virtual)",
                "return min((pp - stage - 1) + (virtual - 1) * pp, microbatches * virtual)",
                ["warm-up"])],
    ),
    dict(
        id="05.map", step="step05_interleaved",
        functions=[("schedule.py", "virtual_microbatch")],
        summary="return (model chunk of this rank, microbatch) of the k-th virtual microbatch, forward or backward",
        task="Virtual microbatches go round in groups of p: the first p are microbatches 0..p-1 on chunk 0, "
             "the next p the same microbatches on chunk 1, and so on; after v groups, the next p "
             "microbatches. Backwards visit the chunks in the reverse order: the last chunk first.",
        checks=[("replay", ["interleaved"]),
                ("pytest", "tests/test_schedules.py::test_schedule_order_is_complete_and_deadlock_free[{step}]")],
        hints=["chunk = (k // p) % v; microbatch = (k // (p·v))·p + k % p.",
               "The backward of chunk c needs chunk c+1's gradient: walk the chunks from v-1 down."],
        wrong=[("backwards on the forward's chunk order", "schedule.py",
                "return (chunk if forward else virtual - 1 - chunk)", "return chunk",
                ["cannot run", "interleaved_actions"])],
    ),
    dict(
        id="05.computes", step="step05_interleaved",
        functions=[("schedule.py", "interleaved_computes")],
        summary='return the rank\'s forwards and backwards in 1F1B order over virtual microbatches, '
                '[("F", k) | ("B", k)]',
        task="The interleaved schedule is 1F1B over v·m virtual microbatches: interleaved_warmup(...) "
             "forwards, then one forward (the newest) and one backward (the oldest) until every forward is "
             "done, then the remaining backwards. interleaved_actions then decides when each message moves.",
        checks=[("replay", ["interleaved"]),
                ("pytest", "tests/test_schedules.py::test_schedule_order_is_complete_and_deadlock_free[{step}]")],
        hints=["As in 1F1B: the steady state's i-th pair is (\"F\", warmup + i), (\"B\", i)."],
        wrong=[("the cool-down left out", "schedule.py",
                ' + [("B", k) for k in range(total - warmup, total)]', "",
                ["not each microbatch once"])],
    ),
    # ---------------------------------------------------------------- step 06: tensor parallelism
    dict(
        id="06.linear", step="step06_tp",
        functions=[("tensor_parallel.py", "ColumnParallelLinear.forward"),
                   ("tensor_parallel.py", "RowParallelLinear.forward")],
        summary="column-parallel: this rank's output columns; row-parallel: this rank's partial product, "
                "summed over the TP group by g",
        task="Megatron-LM's pair: ColumnParallelLinear holds rows of W (output features), so its output is "
             "this rank's slice of the features, no communication (the block applied f to its input). "
             "RowParallelLinear holds columns of W (input features) and reads the matching slice of its "
             "input: each rank's product is a partial sum, and g (reduce_from_tp_region) adds them up.",
        checks=[("pytest", "tests/test_tensor_parallel.py::test_each_split_layer_matches_the_operation_it_splits[{step}]"),
                ("equivalence", 2, ["--tp", "2", "--layers", "2", "--microbatches", "1"])],
        hints=["F.linear(x, self.weight) is x W^T for this rank's shard.",
               "Only one of the two communicates in the forward."],
        wrong=[("the row-parallel sum left out", "tensor_parallel.py",
                "return reduce_from_tp_region(F.linear(x, self.weight), self.tp)", "return F.linear(x, self.weight)",
                ["row"])],
    ),
    dict(
        id="06.fg", step="step06_tp",
        functions=[("tensor_parallel.py", "CopyToTPRegion.backward"),
                   ("tensor_parallel.py", "ReduceFromTPRegion.forward")],
        summary="f's backward sums the input gradients over the TP group; g's forward sums the partial outputs",
        task="The two conjugate operators. f (copy to the TP region) is the identity forward; every rank's "
             "column slice used the whole input, so the input's gradient is the sum of their partial "
             "gradients: all-reduce in the backward. g (reduce from the TP region) sums the row-parallel "
             "partial outputs in the forward, and passes the gradient through unchanged.",
        checks=[("pytest", "tests/test_tensor_parallel.py::test_each_split_layer_matches_the_operation_it_splits[{step}]"),
                ("equivalence", 2, ["--tp", "2", "--layers", "2", "--microbatches", "1"])],
        hints=["all_reduce(x, tp, what) sums in place and returns x: name it as the controls do "
               "(\"f backward\", \"g forward\").",
               "A backward returns one gradient per forward input: (grad, None) for (x, tp)."],
        wrong=[("f's backward without its all-reduce", "tensor_parallel.py",
                'return all_reduce(grad.contiguous(), ctx.tp, "f backward"), None', "return grad, None",
                ["column"])],
    ),
    dict(
        id="06.xent", step="step06_tp",
        functions=[("tensor_parallel.py", "VocabParallelCrossEntropy.forward")],
        summary="cross-entropy per token from this rank's vocabulary slice: MAX of the row maxima, SUM of "
                "the target logit, SUM of the exp-sums",
        task="The logits stay split by vocabulary range. Shift by the global row maximum (a MAX all-reduce), "
             "find the target's logit (only the rank whose range holds it contributes; a SUM all-reduce), sum "
             "the exponentials (a SUM all-reduce); loss = log(sum) - target logit. Save the softmax slice "
             "for the backward.",
        checks=[("pytest", "tests/test_tensor_parallel.py::test_each_split_layer_matches_the_operation_it_splits[{step}]"),
                ("equivalence", 2, ["--tp", "2", "--layers", "2", "--microbatches", "1"])],
        hints=["vocab_range gives this rank's [start, end) of the vocabulary.",
               "A target outside the range must contribute 0, and must not index out of the slice."],
        wrong=[("the row maxima summed", "tensor_parallel.py",
                'all_reduce(row_max, tp, "loss max", dist.ReduceOp.MAX)', 'all_reduce(row_max, tp, "loss max")',
                ["cross"])],
    ),
    # ---------------------------------------------------------------- step 07: mixed precision
    dict(
        id="07.scaler", step="step07_mixed_precision",
        functions=[("loss_scaler.py", "DynamicGradScaler.update")],
        summary="after each step: on an overflow spend hysteresis, then back off; after `window` clean "
                "steps grow the scale",
        task="Megatron-LM's dynamic loss scaler. An overflow resets the growth count and spends one unit of "
             "hysteresis; once it is spent, every overflow multiplies the scale by the backoff factor, never "
             "below the floor. A clean step counts towards growth: after exactly growth_interval of them the "
             "scale grows by the growth factor and the hysteresis is restored.",
        checks=[("pytest", "tests/test_loss_scaler.py::test_dynamic_scaler_follows_megatron_rules[{step}]",
                 "tests/test_loss_scaler.py::test_state_dict_round_trip_mid_sequence[{step}]")],
        hints=["Hysteresis is restored only on growth, not after every clean step.",
               "max(scale * backoff, min_scale) keeps the floor."],
        wrong=[("hysteresis restored on every clean step", "loss_scaler.py",
                "            self.growth_tracker += 1\n",
                "            self.growth_tracker += 1\n            self.hysteresis_tracker = self.hysteresis\n",
                ["scale"])],
    ),
    dict(
        id="07.found_inf", step="step07_mixed_precision",
        functions=[("mixed_precision.py", "MixedPrecisionOptimizer.found_inf")],
        summary="return whether any gradient of the replica, on any rank of the model-parallel group, holds an inf or nan",
        task="An overflow on one stage must make every stage skip the same step, or the stages' weights drift "
             "apart. Check this rank's gradients for inf or nan, then take the MAX over the model-parallel "
             "group (pipeline and TP ranks of one replica), as Megatron-LM does.",
        checks=[("pytest", "tests/test_mixed_precision.py::test_an_inf_on_one_rank_makes_every_rank_skip[{step}]")],
        hints=["A rank that skips while the others step leaves them waiting in global_norm's all-reduce: take "
               "the MAX of one float flag over self.pgm.model_parallel_group (dist.all_reduce).",
               "torch.isfinite(g).all() says whether one gradient is clean."],
        wrong=[("no all-reduce: only the rank with the inf notices", "mixed_precision.py",
                "        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.pgm.model_parallel_group)\n", "",
                ["global_norm", "Timed out"])],
    ),
    dict(
        id="07.norm", step="step07_mixed_precision",
        functions=[("mixed_precision.py", "MixedPrecisionOptimizer.counted_once"),
                   ("mixed_precision.py", "MixedPrecisionOptimizer.global_norm")],
        summary="the L2 norm of the whole model's main gradients, each parameter counted once over TP "
                "replicas and tied copies",
        task="Clipping needs the norm of the whole model's gradient, spread over the stages and TP ranks. Sum "
             "the squares of this rank's main gradients, counting a TP-split parameter on every TP rank (each "
             "holds a different slice), a replicated one (a norm gain) on TP rank 0 only, and the last stage's "
             "copy of a tied embedding not at all; all-reduce the sum over the model-parallel group.",
        checks=[("pytest", "tests/test_mixed_precision.py::test_global_norm_counts_every_number_once_and_clips[{step}]")],
        hints=["param.tp_split_dim is set on a split parameter; param.shared on the tied copy.",
               "Sum squares, not norms: the square root comes after the all-reduce."],
        wrong=[("a replicated parameter counted on every TP rank", "mixed_precision.py",
                "return getattr(param, \"tp_split_dim\", None) is not None or self.pgm.tp_rank == 0",
                "return True", ["norm"])],
    ),
    # ---------------------------------------------------------------- step 08: B/W split, ZB-H1, DualPipe
    dict(
        id="08.store", step="step08_dualpipe",
        functions=[("weight_grad_store.py", "WeightGradStore.split"), ("weight_grad_store.py", "WeightGradStore.pop")],
        summary="split: queue one backward's weight gradients as the W of key; pop: run the oldest W, which must be key's",
        task="DualPipe's WeightGradStore: while a split backward (a B) runs, Linear's backward puts a closure "
             "per weight gradient into the cache instead of computing it. split(key) turns deferring on for "
             "its block, then files the cache as one W under key (only when enabled). pop(key) runs the "
             "oldest W's closures, refusing any other key: W's run in the order of their B's.",
        checks=[("replay", ["zb1p"]),
                ("pytest", "tests/test_weight_grad_store.py::test_store_runs_each_w_under_its_key_oldest_first[{step}]",
                 "tests/test_weight_grad_store.py::test_b_then_w_equals_one_backward_bitwise[{step}]")],
        hints=["Turn deferring off in a finally: a backward that raises must not leave it on.",
               "A deque: append on the right, popleft the oldest."],
        wrong=[("the newest W run first", "weight_grad_store.py",
                "for closure in cls.queue.popleft()[1]:", "for closure in cls.queue.pop()[1]:",
                ["before the W of"])],
    ),
    dict(
        id="08.zb1p", step="step08_dualpipe",
        functions=[("schedule.py", "zb1p_forward_backward")],
        summary="1F1B with every backward split: B at once, stage s's W of microbatch i-s after B of i, "
                "the postponed W's at the end",
        task="ZB-H1: 1F1B's warm-up and steady state, but each backward is a B (stash.backward(..., "
             "split=True)) whose input gradient is sent at once, and stage s delays its W's by s microbatches "
             "into the time it would idle (stash.backward_weights). After the last B, run the W's still "
             "waiting; the store must end the step empty.",
        checks=[("replay", ["zb1p"]),
                ("equivalence", 2, ["--pp", "2", "--layers", "5", "--microbatches", "4", "--batch-size", "4",
                                    "--schedule", "zb1p"]),
                ("pytest", "tests/test_schedules.py::test_zb1p_ideal_timeline_idles_p_minus_1_times_f_plus_b_minus_w[{step}]")],
        hints=["After the B of microbatch i, stage s runs the W of i-s (if i >= s).",
               "The cool-down's B's receive with comm.recv_backward(): no forward is left to send."],
        wrong=[("no W postponed: W right after its B", "schedule.py",
                "        if i >= stage:\n            stash.backward_weights(i - stage)",
                "        stash.backward_weights(i)", ["W before its B"])],
    ),
    dict(
        id="08.phases", step="step08_dualpipe",
        functions=[("dualpipe.py", "phase_counts")],
        summary="return how often each of the eight phases repeats at place i of a V of n ranks crossed by k microbatches",
        task="DualPipe's table (DeepSeek's dualpipe.py, step 1 to 8): a rank at place i of n, below = n-i-1 "
             "ranks under it. It starts with 2·below forwards of direction 0 (nF0), then i+1 forwards of both "
             "(nF0F1), below B1-W1-F1 triples, k-2n+i+1 full pairs (nF0B1F1B0), below nB1F1B0, i+1 nB1B0, "
             "below nWB0 and i+1 trailing W's (nW).",
        checks=[("replay", ["dualpipev"], "two_way"),
                ("pytest", "tests/test_schedules.py::test_dualpipe_and_dualpipev_follow_the_eight_phases[{step}]")],
        hints=["Count the phases of the last rank (place n-1, below 0) first: only nF0F1, nF0B1F1B0, nB1B0 "
               "and nW are left."],
        wrong=[("the first phase's count halved", "dualpipe.py",
                "nF0=2 * below,", "nF0=below,", ["phase_counts(", "F0"])],
    ),
]

BY_ID = {exercise["id"]: exercise for exercise in EXERCISES}

"""The exercises of steps 05-08, as data (the catalogue's format: tests/exercises.py)."""

# What 08.phases' copy must not show: dualpipe.py's counts, and its example (tests/exercise.py hides them).
HIDDEN_TABLE = """\
    1 nF0         forwards of phase 0 fill the V below           2(n-i-1)
    2 nF0F1       the first microbatches come back up            i+1
    3 nB1W1F1     first backwards, each W at once (zero bubble)  n-i-1
    4 nF0B1F1B0   steady state: F0 with B1, then F1 with B0      k-2n+i+1
    5 nB1F1B0     the last forwards                              n-i-1
    6 nB1B0       backwards only; from half-way, B without W     i+1
    7 nWB0        the postponed W's fill the drain               n-i-1
    8 nW          the W's left                                   i+1
"""
SHOWN_TABLE = "".join(line[:65] + "?\n" for line in HIDDEN_TABLE.splitlines())  # the counts: yours to find
HIDDEN_EXAMPLE = """\
    rank 0     6     1       3         1         3       1      3    1
    rank 1     4     2       2         2         2       2      2    2
    rank 2     2     3       1         3         1       3      1    3
    rank 3     0     4       0         4         0       4      0    4
"""
SHOWN_EXAMPLE = "    (rank 0 to 3: what your phase_counts gives; exercise 08.phases)\n"

EXERCISES = [
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
        hints=["The first backward waits for an activation to go down the ring and its gradient to come back, "
               "while every other chunk of the rank fills.",
               "Count the trip below the rank twice, add a full round of p for each other chunk, cap at v·m.",
               "Megatron-LM: num_warmup_microbatches = (pp - rank - 1) * 2 + (v - 1) * pp, capped at the total."],
        right=[("the sum named, the cap written as an if", "schedule.py",
                "    return min((pp - stage - 1) * 2 + (virtual - 1) * pp, microbatches * virtual)",
                "    warmup = 2 * (pp - stage - 1) + pp * (virtual - 1)\n"
                "    return warmup if warmup < microbatches * virtual else microbatches * virtual")],
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
             "microbatches. Backwards visit the chunks in the reverse order: the last chunk first, since a "
             "chunk's gradient comes from the chunk after it.",
        checks=[("replay", ["interleaved"]),
                ("pytest", "tests/test_schedules.py::test_schedule_order_is_complete_and_deadlock_free[{step}]")],
        hints=["Virtual microbatches go in groups of p; a round of v groups visits every chunk once.",
               "The backward of chunk c needs chunk c+1's gradient: backwards walk the chunks from v-1 down; "
               "k // p counts groups, k % p is the place in the group.",
               "chunk = (k // p) % v; microbatch = (k // (p·v))·p + k % p."],
        right=[("divmod, the backward's chunk flipped by an if", "schedule.py",
                "    chunk = (k // pp) % virtual\n    return (chunk if forward else virtual - 1 - chunk), "
                "(k // (pp * virtual)) * pp + k % pp",
                "    group, within = divmod(k, pp * virtual)\n    chunk, offset = divmod(within, pp)\n"
                "    if not forward:\n        chunk = virtual - 1 - chunk\n    return chunk, group * pp + offset")],
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
        hints=["It is 1F1B again, over v·m virtual microbatches: warm-up, steady pairs, cool-down.",
               "interleaved_warmup gives the warm-up; the steady state runs until every forward is done.",
               "As in 1F1B: the steady state's i-th pair is (\"F\", warmup + i), (\"B\", i)."],
        right=[("one loop appending each action", "schedule.py",
                "    steady = [compute for i in range(total - warmup) for compute in ((\"F\", warmup + i), (\"B\", i))]\n"
                "    return [(\"F\", k) for k in range(warmup)] + steady + [(\"B\", k) for k in range(total - warmup, total)]",
                "    actions = [(\"F\", k) for k in range(warmup)]\n    for i in range(total - warmup):\n"
                "        actions += [(\"F\", warmup + i), (\"B\", i)]\n"
                "    return actions + [(\"B\", k) for k in range(total - warmup, total)]")],
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
        hints=["Split the output features and each rank has a slice, no sum; split the input features and "
               "each rank has a partial sum.",
               "Only one of the two communicates in the forward; F.linear(x, self.weight) is x W^T for this "
               "rank's shard.",
               "column: F.linear(x, self.weight); row: reduce_from_tp_region(F.linear(x, self.weight), self.tp)."],
        right=[("the row's partial product named first", "tensor_parallel.py",
                "        return reduce_from_tp_region(F.linear(x, self.weight), self.tp)",
                "        partial = F.linear(x, self.weight)  # this rank's share of the sum\n"
                "        return reduce_from_tp_region(partial, self.tp)")],
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
        hints=["Whatever every rank used whole in the forward, it must sum the gradient of in the backward; "
               "whatever is split, it sums in the forward.",
               "all_reduce(x, tp, what) sums in place and returns x: name it as the controls do "
               "(\"f backward\", \"g forward\"); a backward returns one gradient per forward input.",
               'f backward: return all_reduce(grad.contiguous(), ctx.tp, "f backward"), None; '
               'g forward: return all_reduce(x, tp, "g forward").'],
        right=[("g's sum returned by name, f's gradient cloned", "tensor_parallel.py",
                ('        return all_reduce(x, tp, "g forward")',
                 '        return all_reduce(grad.contiguous(), ctx.tp, "f backward"), None'),
                ('        all_reduce(x, tp, "g forward")\n        return x',
                 '        total = all_reduce(grad.clone(), ctx.tp, "f backward")\n        return total, None'))],
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
             "the exponentials (a SUM all-reduce); loss = log(sum) - target logit. The backward (left in your copy) "
             "unpacks three saved tensors, in this order: the softmax slice (exp / sum), the target's index "
             "in this rank's slice (0 where it is outside), and the mask of tokens whose target is outside the "
             "slice; save them with ctx.save_for_backward.",
        checks=[("pytest", "tests/test_tensor_parallel.py::test_each_split_layer_matches_the_operation_it_splits[{step}]"),
                ("equivalence", 2, ["--tp", "2", "--layers", "2", "--microbatches", "1"])],
        hints=["log-sum-exp over a split vocabulary: a shared maximum, a sum of exponentials, and the target's "
               "logit from the one rank that holds it.",
               "vocab_range gives this rank's [start, end) of the vocabulary; a target outside the range must "
               "contribute 0, and must not index out of the slice.",
               "all_reduce the row max with MAX, the masked target logit and the exp-sum with SUM; loss = "
               "log(sum) - target logit; save the softmax slice."],
        right=[("the exponentials out of place", "tensor_parallel.py",
                "        exp = shifted.exp_()", "        exp = shifted.exp()")],
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
        hints=["Hysteresis forgives a few overflows since the last growth, not in a row; growth needs a full "
               "window of clean steps.",
               "Hysteresis is restored only on growth, not after every clean step; the floor holds on backoff.",
               "overflow: growth_tracker = 0, hysteresis_tracker -= 1, if <= 0: scale = max(scale * backoff, "
               "min_scale); clean: growth_tracker += 1, at growth_interval: reset it, restore hysteresis, grow."],
        right=[("the floor written as an if", "loss_scaler.py",
                "                self.scale = max(self.scale * self.backoff_factor, self.min_scale)",
                "                self.scale = self.scale * self.backoff_factor\n"
                "                if self.scale < self.min_scale:\n                    self.scale = self.min_scale")],
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
             "apart (and a rank that skips leaves the others waiting in global_norm's all-reduce). Check this "
             "rank's gradients for inf or nan, then combine the ranks' answers over the model-parallel group "
             "(pipeline and TP ranks of one replica): any rank's inf is every rank's. Megatron-LM takes a MAX.",
        checks=[("pytest", "tests/test_mixed_precision.py::test_an_inf_on_one_rank_makes_every_rank_skip[{step}]")],
        hints=["Every rank of the replica must reach the same answer: one rank's inf is everyone's.",
               "torch.isfinite(g).all() says whether one gradient is clean; the ranks of one replica are "
               "self.pgm.model_parallel_group (not the data-parallel group: each replica has its own model).",
               "A float flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.pgm.model_parallel_group), "
               "then bool(flag.item())."],
        wrong=[("no all-reduce: only the rank with the inf notices", "mixed_precision.py",
                "        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.pgm.model_parallel_group)\n", "",
                ["found_inf returned [False, False, False, True]", "ranks [0, 1, 2]"]),
               ("the MAX over the data-parallel group", "mixed_precision.py",
                "op=dist.ReduceOp.MAX, group=self.pgm.model_parallel_group)",
                "op=dist.ReduceOp.MAX, group=self.pgm.dp_group)",
                ["found_inf returned [False, False, False, True]", "ranks [0, 1, 2]"])],
        right=[("a SUM all-reduce, then > 0", "mixed_precision.py",
                "        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.pgm.model_parallel_group)\n"
                "        return bool(found.item())",
                "        dist.all_reduce(found, group=self.pgm.model_parallel_group)  # a SUM\n"
                "        return found.item() > 0"),
               ("a count of bad gradients in a one-element float tensor", "mixed_precision.py",
                ("        found = torch.zeros((), device=self.params[0].device)",
                 "            found = torch.maximum(found, (~torch.isfinite(g)).any().float())"),
                ("        found = torch.zeros(1, device=self.params[0].device)",
                 "            found += float(not torch.isfinite(g).all())"))],
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
        hints=["Each number of the model counts once in the norm, whichever ranks hold a copy of it.",
               "param.tp_split_dim is set on a split parameter; param.shared on the tied copy; sum squares, not "
               "norms: the square root comes after the all-reduce.",
               "counted: not shared, and (split or tp_rank == 0); the sum of g.float()^2 over counted "
               "parameters, all-reduced over self.pgm.model_parallel_group, then sqrt."],
        right=[("the squares as a product", "mixed_precision.py",
                "squares = squares + g.float().pow(2).sum()", "squares = squares + (g.float() * g.float()).sum()")],
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
        hints=["A W is the weight half of a backward, run later; W's run in the order their B's ran.",
               "Turn deferring off in a finally: a backward that raises must not leave it on; the queue is a "
               "deque of (key, closures).",
               "split: deferring on, yield, off in finally, then queue.append((key, cache)) and a new cache; "
               "pop: check oldest() == key, run queue.popleft()'s closures."],
        right=[("the oldest W unpacked before it runs", "weight_grad_store.py",
                "        for closure in cls.queue.popleft()[1]:\n            closure()",
                "        _, closures = cls.queue.popleft()\n        for closure in closures:\n            closure()")],
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
             "into the time it would idle (stash.backward_weights). The key is when the next activation is "
             "received: after the postponed W, in a receive of its own. A receive posted with the B's send "
             "(1F1B's send_backward_recv_forward) waits for the activation first, so the W runs after the "
             "wait instead of filling it. After the last B, run the W's still waiting; the store must end "
             "the step empty.",
        checks=[("replay", ["zb1p"], "zb1p_bubble"),
                ("equivalence", 2, ["--pp", "2", "--layers", "5", "--microbatches", "4", "--batch-size", "4",
                                    "--schedule", "zb1p"]),
                ("pytest", "tests/test_schedules.py::test_zb1p_ideal_timeline_idles_p_minus_1_times_f_plus_b_minus_w[{step}]")],
        hints=["A W needs no message: it can run while the rank waits for one, if it runs before that wait.",
               "After the B of microbatch i, stage s runs the W of i-s (if i >= s); send B's input gradient "
               "alone, run the W, then receive the next input; the cool-down's B's use comm.recv_backward().",
               "comm.send_backward(stash.backward(i, out_grad, split=True)); if i >= stage: "
               "stash.backward_weights(i - stage); if another forward is left: x = comm.recv_forward()."],
        wrong=[("no W postponed: W right after its B", "schedule.py",
                "        if i >= stage:\n            stash.backward_weights(i - stage)",
                "        stash.backward_weights(i)", ["W before its B"]),
               ("1F1B's exchange: the next activation received with B's send, before the W", "schedule.py",
                "        comm.send_backward(stash.backward(i, out_grad, split=True))\n        if i >= stage:\n"
                "            stash.backward_weights(i - stage)\n        if fwd_mb + 1 < m:\n"
                "            x = comm.recv_forward()",
                "        input_grad = stash.backward(i, out_grad, split=True)\n        if fwd_mb + 1 < m:\n"
                "            x = comm.send_backward_recv_forward(input_grad)\n        else:\n"
                "            comm.send_backward(input_grad)\n        if i >= stage:\n"
                "            stash.backward_weights(i - stage)",
                ["rank 0 idles", "next activation"])],
        right=[("the postponed W's run until the store is empty", "schedule.py",
                "    for mb in range(m - stage, m):  # the W's this stage postponed\n        stash.backward_weights(mb)",
                "    while WeightGradStore.queue:  # the W's this stage postponed\n"
                "        stash.backward_weights(WeightGradStore.oldest()[1])")],
    ),
    dict(
        id="08.phases", step="step08_dualpipe",
        functions=[("dualpipe.py", "phase_counts")],
        summary="return how often each of the eight phases repeats at place i of a V of n ranks crossed by k microbatches",
        task="DualPipe's table (DeepSeek's dualpipe.py, steps 1 to 8): how often each of the eight phases "
             "repeats at place i of a V of n ranks crossed by k microbatches, below = n-i-1 ranks under it. In "
             "order: forwards of direction 0 that fill the V below (nF0); forwards of both directions as the "
             "first microbatches come back up (nF0F1); first backwards, each W at once (nB1W1F1); the steady "
             "state's full pairs (nF0B1F1B0); the last forwards (nB1F1B0); backwards only (nB1B0); the postponed "
             "W's beside backwards (nWB0); the W's left (nW). Over the eight, every rank runs k F0's, k F1's, "
             "k B0's and k B1's; the last rank of the V (below = 0) has nothing below it to fill.",
        hide=[("dualpipe.py", HIDDEN_TABLE, SHOWN_TABLE), ("dualpipe.py", HIDDEN_EXAMPLE, SHOWN_EXAMPLE)],
        checks=[("replay", ["dualpipev"], "two_way"),
                ("pytest", "tests/test_schedules.py::test_dualpipe_and_dualpipev_follow_the_eight_phases[{step}]")],
        hints=["Each phase runs some of F0, F1, B0, B1, W: over all eight, each pass runs k times.",
               "Count the phases of the last rank (place n-1, below 0) first: only nF0F1, nF0B1F1B0, nB1B0 "
               "and nW are left.",
               "below = n-i-1: nF0 = 2·below, nF0F1 = i+1, nB1W1F1 = below, nF0B1F1B0 = k-2n+i+1, nB1F1B0 = "
               "below, nB1B0 = i+1, nWB0 = below, nW = i+1."],
        right=[("the first phase as a sum", "dualpipe.py", "nF0=2 * below,", "nF0=below + below,")],
        wrong=[("the first phase's count halved", "dualpipe.py",
                "nF0=2 * below,", "nF0=below,", ["phase_counts(", "F0"])],
    ),
    dict(
        id="08.dispatch", step="step08_dualpipe",
        functions=[("experts.py", "split_counts"), ("experts.py", "permutation")],
        summary="split_counts: how many rows go to and come from each rank of the expert group; permutation: "
                "the rows sorted by expert before dispatch, and the arrivals grouped by local expert after it",
        task="Expert parallelism's dispatch (experts.py): rank r holds experts r·E/ep to (r+1)·E/ep - 1. Count "
             "this rank's rows per expert (bincount of chosen), exchange the counts with all_to_all_single on "
             "ep.group (equal splits: E/ep counts to each rank), and return the rows to each rank, the rows from "
             "each rank, the received counts as [ep, E/ep] and the counts. Then sort the token-expert "
             "assignments by expert, stably (so by destination rank), and the rows that arrive (by source rank, "
             "then expert) by local expert.",
        checks=[("pytest", "tests/test_experts.py::test_expert_piece_matches_its_reference[dispatch]",
                 "tests/test_experts.py::test_expert_piece_matches_its_reference[layer_top2]",
                 "tests/test_experts.py::test_expert_piece_matches_its_reference[layer_skewed]")],
        hints=["Both sides of an all-to-all must know its sizes: the counts travel first, in an all-to-all of "
               "their own.",
               "A rank's rows for rank r are the counts of r's experts summed: counts.view(ep, E/ep).sum(1). "
               "The arrivals come by source rank, then expert: label each row with its local expert "
               "(repeat_interleave by the received counts) and sort stably.",
               "order = torch.sort(chosen.flatten(), stable=True).indices; regroup = torch.sort(torch.arange("
               "E/ep).repeat(ep).repeat_interleave(received.flatten()), stable=True).indices."],
        right=[("argsort, stable", "experts.py",
                "    order = torch.sort(chosen.flatten(), stable=True).indices",
                "    order = torch.argsort(chosen.flatten(), stable=True)")],
        wrong=[("the arrivals left in rank order", "experts.py",
                "    regroup = torch.sort(local_expert.repeat_interleave(received.flatten()), stable=True).indices",
                "    regroup = torch.arange(int(received.sum()), device=chosen.device)", ["layer_top2"]),
               ("the rows left in token order", "experts.py",
                "    order = torch.sort(chosen.flatten(), stable=True).indices",
                "    order = torch.arange(chosen.numel(), device=chosen.device)", ["layer_top2"])],
    ),
    dict(
        id="08.alltoall", step="step08_dualpipe",
        functions=[("experts.py", "AllToAll.backward")],
        summary="the all-to-all's backward: each row's gradient back to the rank the row came from",
        task="AllToAll (experts.py) sends send[r] rows to each rank r and receives recv[r] (dispatch; combine swaps "
             "the splits). Its backward gets the gradient of the rows that arrived and returns that of the rows that "
             "left, on the ranks they left from: exchange, counted as a \"backward\" all-to-all; one per input.",
        checks=[("pytest", *(f"tests/test_experts.py::test_expert_piece_matches_its_reference[{c}]"
                             for c in ("dispatch", "layer_top2", "layer_skewed", "volume"))),
                ("equivalence", 4, ["--pp", "2", "--dp", "2", "--ep", "2", "--layers", "4", "--microbatches", "4",
                                    "--experts", "4", "--top-k", "2", "--schedule", "1f1b"])],
        hints=["An all-to-all only moves rows; its adjoint moves each row back: the same exchange, the other way.",
               "The forward kept ctx.send and ctx.recv. The gradient has sum(recv) rows, the forward input had "
               "sum(send): who sent what now receives it.",
               'return exchange(grad, ctx.recv, ctx.send, ctx.ep, "backward"), None, None, None.',
               ("Split sizes", "The gradient has the rows that arrived, sum(recv) of them: each goes back where it "
                               "came from, so this exchange sends recv[r] rows to rank r and receives send[r]."),
               ("invalid gradient", "The backward returns the gradient of the rows that left, sum(send) of them, on "
                                    "the ranks they left from: the arrived rows' gradient must travel back first."),
               ("'backward': 0", "The volume report counts each all-to-all by direction: this one is a backward.")],
        right=[("the splits named before the call", "experts.py",
                '        return exchange(grad, ctx.recv, ctx.send, ctx.ep, "backward"), None, None, None',
                '        send, recv = ctx.recv, ctx.send  # the rows go back the way they came\n'
                '        return exchange(grad, send, recv, ctx.ep, "backward"), None, None, None')],
        wrong=[("the forward's splits again", "experts.py",
                'return exchange(grad, ctx.recv, ctx.send, ctx.ep, "backward")',
                'return exchange(grad, ctx.send, ctx.recv, ctx.ep, "backward")', ["Split sizes"]),
               ("the gradient left where it is", "experts.py",
                'return exchange(grad, ctx.recv, ctx.send, ctx.ep, "backward"), None, None, None',
                "return grad, None, None, None", ["invalid gradient"]),
               ("counted as a forward all-to-all", "experts.py",
                'return exchange(grad, ctx.recv, ctx.send, ctx.ep, "backward")',
                'return exchange(grad, ctx.recv, ctx.send, ctx.ep, "forward")', ["volume", "'backward': 0"])],
    ),
]

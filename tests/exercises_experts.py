"""The exercises of step 08's side road of the experts (experts.py, overlap.py), as data (the catalogue's
format: tests/exercises.py)."""

# What 08.overlap's copy must not show: overlap.py's drawing of the pair, and its order node by node.
HIDDEN_ORDER = """\
    compute:  B.combine | F.attention | B.experts   | B.experts W |          | F.experts   | B.attention
    comm:               B.combine ====|   F.dispatch ===========  B.dispatch=|= F.combine ===========

    B combine        the backward's combine goes first: its all-to-all then travels under F's attention,
    F attention      a compute that needs nothing from the backward;
    B experts        waits for B's combine (just posted, hidden behind F's attention);
    F dispatch       posted as soon as F's router has sorted the rows;
    B experts W      the experts' weight gradients: compute that covers F's dispatch;
    B dispatch       posted;
    F experts        waits for F's dispatch, covers B's dispatch;
    F combine        posted;
    B attention      waits for B's dispatch, covers F's combine, whose wait sits in F's next attention.
"""
SHOWN_ORDER = "    (the order, node by node, and why: yours to find, exercise 08.overlap)\n"

EXERCISES = [
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
    dict(
        id="08.overlap", step="step08_dualpipe",
        functions=[("overlap.py", "pair_order")],
        summary="return the order of a pair's nodes, [(pass, node)] for one layer of each pass, so that each "
                "all-to-all travels under the other pass's compute",
        task="DualPipe's pair runs the forward (F) of one microbatch and the backward (B) of another from one "
             "thread. With experts a layer is nodes: F runs attention, dispatch, experts, combine; B runs combine, "
             "experts, experts W, dispatch, attention. A dispatch or combine node only posts its all-to-all; the "
             "node that reads the rows waits for them. interleave runs your order once per layer. Keep each "
             "pass's nodes in their own order, and put compute of the other pass between each post and its wait. "
             "The checks: the order runs and is the same on both ranks of an expert group; on the ideal lanes "
             "(tests/overlap_lanes.py) it leaves at most half an all-to-all exposed; the run equals --pairs "
             "sequential bit for bit.",
        hide=[("overlap.py", HIDDEN_ORDER, SHOWN_ORDER)],
        checks=[("pytest", "tests/test_overlap.py::test_the_pairs_order_is_legal_and_the_same_on_every_rank",
                 "tests/test_overlap.py::test_the_pairs_order_hides_the_link_on_the_ideal_lanes"),
                ("pytest", "tests/test_overlap.py::test_the_overlapped_pair_is_bitwise_the_sequential_pair")],
        hints=["An all-to-all travels while the other microbatch computes: post it, run the other pass's "
               "compute, then wait for it.",
               ("expected", "Each pass yields its nodes in its own order: B's experts W comes after B's experts, "
                            "F's experts after F's dispatch. Interleave the passes, do not reorder one."),
               ("waited", "Each wait the check lists is an all-to-all read right after it was posted: move "
                          "compute of the other pass between the post and the node that reads it."),
               "Start with B's combine: F's attention needs nothing from B, so it covers that all-to-all. Then "
               "every post should have one compute node of the other pass after it.",
               "B combine, F attention, B experts, F dispatch, B experts W, B dispatch, F experts, F combine, "
               "B attention (Megatron-LM's TransformerLayerSchedulePlan)."],
        right=[("F's dispatch posted before B's experts", "overlap.py",
                '("B", "combine"), ("F", "attention"), ("B", "experts"), ("F", "dispatch"), ("B", "experts W"),',
                '("B", "combine"), ("F", "attention"), ("F", "dispatch"), ("B", "experts"), ("B", "experts W"),')],
        wrong=[("the forward's attention first: B's combine is read as soon as it is posted", "overlap.py",
                'return [("B", "combine"), ("F", "attention"),', 'return [("F", "attention"), ("B", "combine"),',
                ["B.combine 1 waited 2", "at most 1", "waited"]),
               ("the forward's layer, then the backward's: every all-to-all read at once", "overlap.py",
                '    return [("B", "combine"), ("F", "attention"), ("B", "experts"), ("F", "dispatch"), '
                '("B", "experts W"),\n            ("B", "dispatch"), ("F", "experts"), ("F", "combine"), '
                '("B", "attention")]',
                '    return [("F", "attention"), ("F", "dispatch"), ("F", "experts"), ("F", "combine"),\n'
                '            ("B", "combine"), ("B", "experts"), ("B", "experts W"), ("B", "dispatch"), '
                '("B", "attention")]',
                ["F.dispatch 0 waited 2", "at most 1", "waited"]),
               ("the experts' weight gradients before their input gradients", "overlap.py",
                '("B", "experts"), ("F", "dispatch"), ("B", "experts W"),',
                '("B", "experts W"), ("F", "dispatch"), ("B", "experts"),',
                ["expected B's experts W, its pass ran experts", "expected"])],
    ),
]

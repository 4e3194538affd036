"""The design challenges of step 08's schedule lab, as exercises (tests/lab_challenges.py grades them).

Here the learner writes no function: a schedule, as a list of actions in PyTorch's notation (one row per rank,
`0F3` the forward of microbatch 3 on stage 0, `0B3` its whole backward, `0I3` and `0W3` its two halves), into
a file of their copy. Each entry has the catalogue's id, step, summary, task and three levels of hints, no
functions, and:

  challenge lab_challenges.CHALLENGES's name        pp, m    the list's shape
  file      the learner's list, in the copy         times    F:B:W of the lab's ideal timeline
  starter   the list `start` writes: a valid schedule that misses the target
  checks    ("lab", "--no-run"): validation, replay, ideal timeline, peaks, a drawing into the copy, the target;
            ("lab",): then a gloo run against one device
  wrong     (what, rows, key words the lab's report must show): lists that miss the target
  right     (what, rows): lists that meet it; tests/test_exercises.py proves both
"""


def one_f_one_b(pp, m, warmup, split=False):
    """1F1B's rows with warmup(stage) forwards before the first backward; split: each B as I then W at once."""
    backward = ("I", "W") if split else ("B",)
    rows = []
    for s in range(pp):
        w = min(warmup(s), m)
        order = [(s, "F", i) for i in range(w)]
        for i in range(m - w):
            order += [(s, "F", w + i)] + [(s, kind, i) for kind in backward]
        rows.append(order + [(s, kind, i) for i in range(m - w, m) for kind in backward])
    return rows


def one_at_a_time(pp, m):
    """The interleaved placement (rank r holds stages r and r+p), each microbatch down and back before the next."""
    return [[(s, kind, mb) for mb in range(m) for s, kind in ((r, "F"), (r + pp, "F"), (r + pp, "B"), (r, "B"))]
            for r in range(pp)]


def csv_text(rows):
    """Rows of (stage, kind, microbatch) as the lab reads them."""
    return "".join(",".join(f"{s}{kind}{mb}" for s, kind, mb in row) + "\n" for row in rows)


# PyTorch's ScheduleInterleaved1F1B at p 4, m 6, as torch.distributed.pipelining orders it (tests/test_schedule_lab.py
# builds it from torch and checks the lab passes it).
TORCH_INTERLEAVED_4_6 = """\
0F0,0F1,0F2,0F3,0F4,0F5,4F0,4F1,4F2,4F3,4F4,4F5,4B0,4B1,4B2,4B3,4B4,4B5,0B0,0B1,0B2,0B3,0B4,0B5
1F0,1F1,1F2,1F3,1F4,1F5,5F0,5F1,5F2,5F3,5F4,5B0,5F5,5B1,5B2,5B3,5B4,5B5,1B0,1B1,1B2,1B3,1B4,1B5
2F0,2F1,2F2,2F3,2F4,2F5,6F0,6F1,6F2,6B0,6F3,6B1,6F4,6B2,6F5,6B3,6B4,6B5,2B0,2B1,2B2,2B3,2B4,2B5
3F0,3F1,3F2,3F3,3F4,3F5,7F0,7B0,7F1,7B1,7F2,7B2,7F3,7B3,7F4,7B4,7F5,7B5,3B0,3B1,3B2,3B3,3B4,3B5
"""

CHECKS = [("lab", "--no-run"), ("lab",)]


def plain_1f1b():
    """1F1B's list at p 4, m 8: two challenges' starter, and their first wrong answer."""
    return csv_text(one_f_one_b(4, 8, lambda s: 4 - s - 1))


CHALLENGES = [
    dict(
        id="08.stage0-two", step="step08_dualpipe", functions=[], challenge="stage0-two", file="stage0-two.csv",
        pp=4, m=8, times="1:1:1",
        summary="write a schedule for p 4, m 8 whose stage 0 stores at most 2 microbatches (1F1B stores 4)",
        task="Your copy holds stage0-two.csv, 1F1B's list for p = 4, m = 8: stage 0 runs 3 forwards before its "
             "first backward and stores 4 microbatches at its peak. Edit the list so that stage 0 stores at most "
             "2, every rank's order still deadlock-free and every pass run once. The check draws your list's "
             "ideal timeline into stage0-two.png beside it: look at how much longer it idles.",
        starter=plain_1f1b,
        checks=CHECKS,
        hints=["A stage stores a microbatch from its forward until its backward: fewer forwards before the first "
               "backward, fewer stored.",
               "If stage 0 waits sooner for a gradient, the stages after it must start their backwards sooner "
               "too, or the gradient never comes: change every rank's warm-up, not stage 0's alone.",
               "1F1B with a warm-up of min(p-s-1, 1) forwards on stage s: F0 F1 B0 F2 B1 ... on stages 0-2, F0 "
               "B0 F1 B1 ... on the last.",
               ("deadlock", "Stage 0 waits for a gradient that stage 1 sends only after a forward stage 0 has not "
                "sent yet: cut every rank's warm-up, not stage 0's alone.")],
        wrong=[("1F1B's list, unchanged", plain_1f1b,
                ["stores 4 microbatches, more than 2"]),
               ("stage 0's warm-up cut alone: the others wait for a forward it sends only after a backward",
                lambda: csv_text(one_f_one_b(4, 8, lambda s: 1 if s == 0 else 4 - s - 1)), ["deadlock", "replay"])],
        right=[("1F1B with a warm-up of at most one forward",
                lambda: csv_text(one_f_one_b(4, 8, lambda s: min(4 - s - 1, 1))))],
    ),
    dict(
        id="08.beat-1f1b", step="step08_dualpipe", functions=[], challenge="beat-1f1b", file="beat-1f1b.csv",
        pp=4, m=8, times="1:1:1",
        summary="write a schedule, one stage per rank, that idles less than 1F1B on every rank and stores no more",
        task="Your copy holds beat-1f1b.csv, 1F1B's list for p = 4, m = 8: every rank idles (p-1)(F+B+W), a full "
             "backward taking B + W. Edit the list so that every rank idles less, one stage per rank, and stage s "
             "stores at most 1F1B's min(p-s, m) microbatches. You may split a backward into I (the input "
             "gradient, which the previous stage waits for) and W (the weight gradient). The check draws your "
             "list's ideal timeline into beat-1f1b.png.",
        starter=plain_1f1b,
        checks=CHECKS,
        hints=["The previous stage waits for the input gradient only: send it before computing the weights'.",
               "Write each backward 0B3 as 0I3 then 0W3: the I's output leaves at once, and a W needs no message.",
               "1F1B with every B split into I then W at once already beats it; ZB-H1 (train.py --schedule zb1p "
               "--dump-schedule) postpones W's into the bubble and beats it by more."],
        wrong=[("1F1B's list, unchanged", plain_1f1b,
                ["idle at least 1F1B's (p-1)(F+B+W)"]),
               ("GPipe's order, every forward first: it stores all 8",
                lambda: csv_text(one_f_one_b(4, 8, lambda s: 8, split=True)), ["store more than 1F1B's"])],
        right=[("1F1B with each backward split, I then W at once",
                lambda: csv_text(one_f_one_b(4, 8, lambda s: 4 - s - 1, split=True)))],
    ),
    dict(
        id="08.interleaved-m6", step="step08_dualpipe", functions=[], challenge="interleaved-m6",
        file="interleaved-m6.csv", pp=4, m=6, times="1:1:1",
        summary="write an interleaved schedule for p 4, m 6 (not a multiple of p) that idles at most (p-1)(F+B+W)",
        task="Megatron-LM's interleaved schedule needs m to be a multiple of p. Your copy holds "
             "interleaved-m6.csv, a valid list for p = 4, m = 6 on the interleaved placement (rank r holds "
             "stages r and r+4) that runs each microbatch all the way down and back before the next, and idles "
             "far too long. Edit it so that every rank idles at most (p-1)(F+B+W), F, B and W the passes of one "
             "stage. The check draws your list's ideal timeline into interleaved-m6.png.",
        starter=lambda: csv_text(one_at_a_time(4, 6)),
        checks=CHECKS,
        hints=["Keep every rank busy: a rank can run a forward of its second stage while the first waits.",
               "Run all six forwards of the first stage, then the second stage's forwards as their inputs arrive, "
               "and a backward whenever one is ready.",
               "PyTorch's ScheduleInterleaved1F1B runs m = 6 on p = 4 (tests/test_schedule_lab.py builds its "
               "order): 0F0..0F5, then 4F0.., 4B0.., then 0B0..0B5 on rank 0; the later ranks start their "
               "second stage's backwards sooner."],
        wrong=[("each microbatch down and back before the next", lambda: csv_text(one_at_a_time(4, 6)),
                ["idle more than (p-1)(F+B+W)"]),
               ("one stage per rank", lambda: csv_text(one_f_one_b(4, 6, lambda s: 4 - s - 1)),
                ["interleaved placement"])],
        right=[("PyTorch's ScheduleInterleaved1F1B order", lambda: TORCH_INTERLEAVED_4_6)],
    ),
]

"""DualPipe and DualPipeV (DeepSeek-V3, 2024; github.com/deepseek-ai/DualPipe): microbatches cross
the pipeline in two directions at once, and a forward of one is paired with a backward of the other.

DualPipe. p ranks (p even) hold the model twice: rank r holds stage r of the forward direction and
stage p-1-r of the reverse direction. The first m/2 microbatches enter at rank 0 and flow down,
the other m/2 enter at rank p-1 and flow up; rank p-1 computes the forward direction's loss, rank 0
the reverse direction's. After the step the two copies of each stage, on ranks r and p-1-r, sum
their gradients (finalize_grads.sum_twin_gradients), so both take the same optimizer step and stay equal.

DualPipeV ("cut in half"). p ranks hold 2p stages in a V: rank r holds stage r, going down, and
stage 2p-1-r, coming back up. On the last rank the down stage's output is the up stage's input,
with no message. Every microbatch enters and leaves at rank 0, which reads the tokens and computes
the loss, and the model is held once.

One table runs both. A rank calls phase 0 the model chunk a microbatch reaches on its way away
from the rank's end of the pipeline, phase 1 the chunk it reaches on its way back. In DualPipeV
that is chunk 0 and chunk 1 on every rank. In DualPipe, ranks 0..p/2-1 form a V of p/2 ranks (down
the forward direction, back up the reverse one) and ranks p/2..p-1 its mirror image, where phase 0
is the reverse direction; the V turns between the two middle ranks, across one message. Each phase
repeats its pattern a number of times that depends on the rank's place i in its V of n ranks:

    phase         what it does                                   DualPipeV      DualPipe
                                                                 n=p, i=r, k=m  n=p/2, i=min(r,p-1-r), k=m/2
    1 nF0         forwards of phase 0 fill the V below           2(n-i-1)
    2 nF0F1       the first microbatches come back up            i+1
    3 nB1W1F1     first backwards, each W at once (zero bubble)  n-i-1
    4 nF0B1F1B0   steady state: F0 with B1, then F1 with B0      k-2n+i+1
    5 nB1F1B0     the last forwards                              n-i-1
    6 nB1B0       backwards only; from half-way, B without W     i+1
    7 nWB0        the postponed W's fill the drain               n-i-1
    8 nW          the W's left                                   i+1

DualPipeV with p = 4 and m = 8 (and DualPipe with p = 8, m = 16, ranks r and 7-r):

              nF0  nF0F1  nB1W1F1  nF0B1F1B0  nB1F1B0  nB1B0  nWB0  nW
    rank 0     6     1       3         1         3       1      3    1
    rank 1     4     2       2         2         2       2      2    2
    rank 2     2     3       1         3         1       3      1    3
    rank 3     0     4       0         4         0       4      0    4

Communication, as DeepSeek's code does it: a transfer is queued when the schedule decides it, and
all queued transfers are committed in one batch right before the next compute (p2p.py), so a
forward's send and a backward's receive of the other direction travel together. Once a batch is
posted, the outputs it sends are freed, keeping their autograd graph (stage.deallocate_output).

A pair is one unit: it waits for its forward's input and its backward's gradient together, and its
outputs leave after both passes, as in DeepSeek's code, whose modules overlap the two. Here they run
one after the other on one stream, on any device: that costs one F per link (idle_chains). --pairs sequential runs a
pair as a forward and then a backward, each with its own commit; gloo runs it, while on in-order
streams (the replay's model of NCCL, tests/replay.py) its batches deadlock, so it is CPU-only.

A schedule family (config.family, an add-on) with its own SCHEDULES, schedule_of, formulas, model
chunks (model_chunks, twin_copies), flag and rules (add_flags, check_flags). It runs on schedule.py's
Stash and flushes as schedule.py's schedules do, so their stages, training loop and report serve it.
"""
from collections import deque
from functools import partial

from schedule import Stash, peaks, report_lines, stage_class, train_steps  # noqa: F401 (the family's names)
from stage import drive
from weight_grad_store import WeightGradStore

PHASES = ("nF0", "nF0F1", "nB1W1F1", "nF0B1F1B0", "nB1F1B0", "nB1B0", "nWB0", "nW")


def phase_counts(v_ranks: int, place: int, crossing: int) -> dict:
    """How often each phase repeats at a rank's place (i) in a V of v_ranks ranks (n) that crossing
    microbatches (k) cross."""
    below = v_ranks - place - 1  # ranks of the V below this one
    return dict(nF0=2 * below, nF0F1=place + 1, nB1W1F1=below, nF0B1F1B0=crossing - 2 * v_ranks + place + 1,
                nB1F1B0=below, nB1B0=place + 1, nWB0=below, nW=place + 1)


def place_in_v(v_shape: bool, pp: int, rank: int, m: int):
    """(v_ranks, place, crossing), the table's (n, i, k): how many ranks the rank's V has, the rank's place
    in it, and how many microbatches cross it."""
    return (pp, rank, m) if v_shape else (pp // 2, min(rank, pp - 1 - rank), m // 2)


class TwoWayRank:
    """One rank of DualPipe or DualPipeV: the verbs its phase table is written in.

    Each chunk runs its forwards, and its backwards, in microbatch order, so a counter per chunk says
    which microbatch is next. recv_forward, send_forward, recv_backward and send_backward queue a
    transfer of phase 0 or 1; forward, backward, forward_backward and weight commit the queue first.
    sequential_pairs runs each pair as a forward and then a backward, each with its own commit.
    """

    def __init__(self, stash, comm, v_shape: bool, sequential_pairs=False):
        pp, rank, m = comm.num_stages, comm.stage, len(stash.microbatches)
        self.sequential_pairs = sequential_pairs
        self.stash, self.comm, self.stages = stash, comm, stash.stages
        self.mirrored = not v_shape and rank >= pp // 2  # DualPipe's lower half: phase 0 goes up
        self.v_turn = v_shape and rank == pp - 1  # chunk 0's output is chunk 1's input, with no message
        self.first_mb = (0, 0) if v_shape else (0, m // 2)  # DualPipe: chunk 1 runs the reverse direction's
        self.passes = {"F": [0, 0], "B": [0, 0]}  # forwards and backwards run so far, per chunk
        self.inputs, self.output_grads = (deque(), deque()), (deque(), deque())  # per chunk, oldest first
        self.outputs, self.input_grads = (deque(), deque()), (deque(), deque())  # computed, not yet queued
        self.sent = []  # (chunk, mb) whose output travels in the next commit, then is freed

    def chunk(self, phase: int) -> int:
        """The chunk that runs phase's direction: chunk `phase`, swapped on DualPipe's lower half."""
        return phase ^ self.mirrored

    def peers(self, chunk: int):
        """(rank this chunk's activations come from, rank they go to); gradients go the other way.
        Chunk 0 flows down the ranks (DualPipe's forward direction, DualPipeV's left arm), chunk 1 up."""
        down = (self.comm.prev_rank, self.comm.next_rank)
        return down if chunk == 0 else down[::-1]

    def receives_activation(self, chunk: int) -> bool:
        """The chunk's input is a message: not the model's first stage (tokens), nor the V's turn."""
        return not self.stages[chunk].is_first and not (self.v_turn and chunk == 1)

    def sends_activation(self, chunk: int) -> bool:
        """The chunk's output is a message: not the model's last stage (the loss), nor the V's turn."""
        return not self.stages[chunk].is_last and not (self.v_turn and chunk == 0)

    # Transfers, queued until the next commit. A gradient travels against its activation.
    def recv_forward(self, phase: int):
        chunk = self.chunk(phase)
        if self.receives_activation(chunk):
            self.inputs[chunk].append(self.comm.queue_recv(self.peers(chunk)[0], "activation"))

    def send_forward(self, phase: int):
        chunk = self.chunk(phase)
        if self.sends_activation(chunk):
            mb, out = self.outputs[chunk].popleft()
            self.comm.queue_send(out, self.peers(chunk)[1], "activation")
            self.sent.append((chunk, mb))

    def recv_backward(self, phase: int):
        chunk = self.chunk(phase)
        if self.sends_activation(chunk):
            self.output_grads[chunk].append(self.comm.queue_recv(self.peers(chunk)[1], "gradient"))

    def send_backward(self, phase: int):
        chunk = self.chunk(phase)
        if self.receives_activation(chunk):
            self.comm.queue_send(self.input_grads[chunk].popleft(), self.peers(chunk)[0], "gradient")

    def commit(self):
        """Post the queued transfers as one batch; then free the outputs that went out (the send in
        flight holds their values until the peer has them)."""
        self.comm.commit()
        for chunk, mb in self.sent:
            self.stash.deallocate(mb, chunk)
        self.sent.clear()

    # Compute. Each runs the chunk's next microbatch, as a generator that a pair can interleave (overlap.py).
    def _forward(self, chunk: int):
        drive(self._forward_steps(chunk))

    def _backward(self, chunk: int, split: bool):
        drive(self._backward_steps(chunk, split))

    def _forward_steps(self, chunk: int):
        mb = self.first_mb[chunk] + self.passes["F"][chunk]
        self.passes["F"][chunk] += 1
        x = None if self.stages[chunk].is_first else self.inputs[chunk].popleft()
        out = yield from self.stash.forward_steps(mb, x, chunk)
        if self.v_turn and chunk == 0:  # the V turns here: chunk 1's input is this output's values
            self.inputs[1].append(out.detach())
            self.stash.deallocate(mb, 0)  # so the output keeps only its graph, as if it had been sent
        elif self.sends_activation(chunk):
            self.outputs[chunk].append((mb, out))

    def _backward_steps(self, chunk: int, split: bool):
        mb = self.first_mb[chunk] + self.passes["B"][chunk]
        self.passes["B"][chunk] += 1
        out_grad = None if self.stages[chunk].is_last else self.output_grads[chunk].popleft()
        input_grad = yield from self.stash.backward_steps(mb, out_grad, chunk, split)
        if self.v_turn and chunk == 1:  # the V turns back: chunk 0's output gradient, with no message
            self.output_grads[0].append(input_grad)
        elif self.receives_activation(chunk):
            self.input_grads[chunk].append(input_grad)

    def forward(self, phase: int, recv=True, send=True):
        """F of the phase's next microbatch, with its transfers (DeepSeek's _forward_chunk)."""
        if recv:
            self.recv_forward(phase)
        self.commit()
        self._forward(self.chunk(phase))
        if send:
            self.send_forward(phase)

    def backward(self, phase: int, split=False, recv=True, send=True):
        """B of the phase's next microbatch; split: its W waits in the store (zero bubble)."""
        if recv:
            self.recv_backward(phase)
        self.commit()
        self._backward(self.chunk(phase), split)
        if send:
            self.send_backward(phase)

    def forward_backward(self, phase0: int, phase1: int, recv0=True):
        """F of phase0 and B of phase1, two different microbatches going opposite ways: one pair, whose
        transfers go in the same batches. The stage's hook runs the two passes (generators): dense, one after
        the other, on one stream, on any device; with experts, cut into nodes (attention, dispatch, experts,
        combine) and interleaved, so that one's all-to-all hides behind the other's compute (overlap.py), as
        DeepSeek-V3 does in its modules' own overlapped_forward_backward."""
        if self.sequential_pairs:  # --pairs sequential: F's output leaves before B, B's gradient is waited for after F
            self.forward(phase0, recv=recv0)
            self.backward(phase1)
            return
        if recv0:
            self.recv_forward(phase0)
        self.recv_backward(phase1)
        self.commit()
        chunk0, chunk1 = self.chunk(phase0), self.chunk(phase1)
        self.stages[chunk0].overlapped_forward_backward(partial(self._forward_steps, chunk0),
                                                        partial(self._backward_steps, chunk1, False))
        self.send_forward(phase0)
        self.send_backward(phase1)

    def weight(self):
        """W of the oldest split B, whichever chunk ran it (the WeightGradStore knows)."""
        self.commit()
        chunk, mb = WeightGradStore.oldest()
        self.stash.backward_weights(mb, chunk)


def eight_phases(rank: TwoWayRank, v_ranks: int, place: int, crossing: int):
    """The phase table, in the order DeepSeek's DualPipe and DualPipeV run it.

    The V's turn (DualPipeV's last rank, DualPipe's two middle ranks) sends its newest phase-0
    output at once in phase 2 and splits phase 4's first pair, so that the turn's microbatch can
    start back up before this rank's next forward.
    """
    count = phase_counts(v_ranks, place, crossing)
    turn = place == v_ranks - 1
    for _ in range(count["nF0"]):
        rank.forward(0)

    rank.recv_forward(0)
    for j in range(count["nF0F1"]):
        rank.forward(0, recv=False, send=turn)
        rank.recv_forward(0)
        rank.forward(1, send=not turn or j < count["nF0F1"] - 1)
        if not turn:
            rank.send_forward(0)

    for _ in range(count["nB1W1F1"]):
        rank.backward(1, split=True)
        rank.recv_forward(1)
        rank.weight()
        rank.forward(1, recv=False)

    for j in range(count["nF0B1F1B0"]):
        if j == 0 and turn:  # not paired: B1 can start as soon as F0 is done
            rank.forward(0, recv=False, send=False)
            rank.send_forward(1)
            rank.backward(1, send=False)
            rank.send_forward(0)
            rank.send_backward(1)
        else:
            rank.forward_backward(0, 1, recv0=j > 0)
        rank.forward_backward(1, 0)

    for _ in range(count["nB1F1B0"]):
        rank.backward(1)
        rank.forward_backward(1, 0)

    split = False  # from half-way through phase 6 every B leaves its W for phases 7 and 8
    for j in range(count["nB1B0"]):
        split = split or (j == count["nB1B0"] // 2 and place % 2 == 1)
        rank.backward(1, split=split)
        split = split or (j == count["nB1B0"] // 2 and place % 2 == 0)
        rank.backward(0, split=split)

    for _ in range(count["nWB0"]):
        rank.weight()
        rank.backward(0, split=True)

    for _ in range(count["nW"]):
        rank.weight()
    rank.commit()
    assert not WeightGradStore.queue, "every W of the step has run"


def idle_chains(stages: int, f, b, w, sequential_pairs=False) -> dict:
    """Each rank's idle time in the order eight_phases runs, with pass times F, B, W (a pair's backward
    whole, B + W) and free messages that leave where the code commits them. It is the longest of a few
    chains of dependent passes, each of n = PP/2 - 1 links (PP the number of stages), the same on every
    rank and for every m; tests/two_way.py finds it exact in every allowed configuration.

    A pair as DeepSeek runs it (the default) is one unit both ways: it starts once every input of its
    commit is there, its backward's gradient included, and its outputs leave when both its passes are
    done. Six chains; n(2F+B-W) is the longest when F <= B <= (1 + 1/n)F and W <= B, one F per link more
    than ZB-H1's n(F+B-W). DeepSeek's table writes (PP/2-1)(F&B+B-3W), B a whole backward: with a pair
    F&B = F + B + W (no overlap), that is n(F+2B-W), the first chain when F = B.

    sequential_pairs (--pairs sequential): the pair's forward commits alone, so its output leaves
    before the backward runs, and the backward waits for its gradient only then. Ten chains; in the same
    range of times the longest is n(F+B-W), ZB-H1's."""
    n = stages // 2 - 1
    if n <= 0:  # one V of one rank (DualPipe's p = 2, DualPipeV's p = 1): nothing to wait for
        return {"0": 0}
    if sequential_pairs:
        return {"n(F+B-W)": n * (f + b - w), "nF": n * f, "nB-F": n * b - f, "2nB-nW-F": 2 * n * b - n * w - f,
                "(n+1)F-B": (n + 1) * f - b, "(n+1)F+(n-1)B-nW": (n + 1) * f + (n - 1) * b - n * w,
                "2nF-nB-(n-1)W": 2 * n * f - n * b - (n - 1) * w, "2nF-(2n-1)W": 2 * n * f - (2 * n - 1) * w,
                "(2n+1)F-2B-(2n+1)W": (2 * n + 1) * f - 2 * b - (2 * n + 1) * w,
                "(2n+1)F-(n+2)B-(n+1)W": (2 * n + 1) * f - (n + 2) * b - (n + 1) * w}
    return {"n(2F+B-W)": n * (2 * f + b - w), "(2n+1)F+(n-1)B-nW": (2 * n + 1) * f + (n - 1) * b - n * w,
            "(n-1)F+2nB-nW": (n - 1) * f + 2 * n * b - n * w, "2nF": 2 * n * f, "(2n+1)F-B": (2 * n + 1) * f - b,
            "(n-1)F+nB": (n - 1) * f + n * b}


def run_two_way(stash, comm, v_shape: bool, sequential_pairs=False):
    """One step of DualPipeV (v_shape) or DualPipe on this rank; returns the rank's share of the loss."""
    rank = TwoWayRank(stash, comm, v_shape, sequential_pairs)
    eight_phases(rank, *place_in_v(v_shape, comm.num_stages, comm.stage, len(stash.microbatches)))
    return stash.loss


def dualpipe_forward_backward(stages, comm, microbatches, sequential_pairs=False):
    """DualPipe: half the microbatches enter at each end."""
    return run_two_way(Stash(stages, comm, microbatches, split=True), comm, False, sequential_pairs)


def dualpipev_forward_backward(stages, comm, microbatches, sequential_pairs=False):
    """DualPipeV: every microbatch goes down the V and back up."""
    return run_two_way(Stash(stages, comm, microbatches, split=True), comm, True, sequential_pairs)


SCHEDULES = {"dualpipe": dualpipe_forward_backward, "dualpipev": dualpipev_forward_backward}


def schedule_of(args):
    """The function that runs one step of args.schedule, with the pairs of --pairs."""
    return partial(SCHEDULES[args.schedule], sequential_pairs=args.pairs == "sequential")


def model_chunks(args, stage: int):
    """(global indices of this rank's model chunks, how many chunks the model is cut into)."""
    if args.schedule == "dualpipe":  # stage r of the forward direction, stage p-1-r of the reverse one
        return [stage, args.pp - 1 - stage], args.pp
    return [stage, 2 * args.pp - 1 - stage], 2 * args.pp  # the V: stage r going down, 2p-1-r coming back up


def twin_copies(args) -> bool:
    """Whether every stage is held twice: DualPipe's rank r holds, second, the stage rank p-1-r holds first.
    The two copies sum their gradients after each step (finalize_grads.sum_twin_gradients)."""
    return args.schedule == "dualpipe"


def bubble_formula(args, times=None):
    """(text, value): idle fraction of each rank. DualPipe and DualPipeV idle the longest of a few chains
    of n = PP/2-1 links (idle_chains), n(2F+B-W) for F <= B <= (1+1/n)F and W <= B (n(F+B-W) with
    --pairs sequential), beside N(F+B+W) of compute, N the passes of each kind a rank runs. times gives
    the mean durations of one forward, B and W (measured in the same run; equal if left out)."""
    f, b, w = times or (1, 1, 1)
    stages = model_chunks(args, 0)[1]
    passes = 2 * args.microbatches if args.schedule == "dualpipev" else args.microbatches
    chains = idle_chains(stages, f, b, w, args.pairs == "sequential")
    longest = max(chains, key=chains.get)
    idle = chains[longest]
    which = f"{longest} (the longest of {len(chains)} chains, n = PP/2-1)" if len(chains) > 1 \
        else "0 (one rank per V)"
    text = (f"idle/(N(F+B+W)+idle), idle = {which} with --pairs {args.pairs}, PP = {stages} stages, "
            f"N = {passes} passes, F:B:W = 1:{b / f:.2f}:{w / f:.2f}")
    return text, idle / (passes * (f + b + w) + idle)


def peak_stored_microbatches(args, stage: int):
    """(text, value): on every rank, DeepSeek's table's PP+1 (chunk, microbatch) pairs, PP the number of stages."""
    return "PP+1 (chunk, microbatch) pairs", model_chunks(args, stage)[1] + 1


def add_flags(group):
    """DualPipe's flag, in the pipeline group of train.py's --help (config.py)."""
    group.add_argument("--pairs", default="overlapped",
                       help="overlapped | sequential: dualpipe and dualpipev run a pair (F of one microbatch, B of "
                       "another) as one unit, as DeepSeek does, or as F then B, each with its own transfers (CPU only)")


def check_shape(args):
    """DualPipe needs two equal halves of ranks and of microbatches, both every rank's V full, and a layer
    in each of its model chunks."""
    name = f"--schedule {args.schedule}"
    if args.schedule == "dualpipe" and args.pp % 2:
        raise ValueError(f"--pp {args.pp} must be even for {name}: rank r and rank pp-1-r hold the two "
                         "directions' copies of a stage")
    if args.schedule == "dualpipe" and args.microbatches % 2:
        raise ValueError(f"--microbatches {args.microbatches} must be even for {name}: half of them enter "
                         "at each end")
    if args.microbatches < 2 * args.pp:
        raise ValueError(f"--microbatches {args.microbatches} must be at least 2 x --pp {args.pp} = "
                         f"{2 * args.pp} for {name}: its steady state needs every rank's V full")
    _, chunks = model_chunks(args, 0)
    if chunks > args.layers:
        raise ValueError(f"{name} with --pp {args.pp} = {chunks} model chunks cannot share --layers {args.layers}: "
                         "each chunk needs a layer")
    if args.p2p != "batched":
        raise ValueError(f"--p2p {args.p2p} does not fit {name}: it commits its queued transfers in one "
                         "batch_isend_irecv; use --p2p batched")
    if args.scatter_gather:
        raise ValueError(f"--scatter-gather does not fit {name}: its transfers carry whole tensors")
    if args.tie_embeddings:
        raise ValueError(f"--tie-embeddings does not fit {name}: the embedding's and the head's copies "
                         "are not summed in its stage layout (not supported)")


def check_flags(args, cuda_available: bool):
    """DualPipe's rules, refused before any work with a ValueError of one line (config.py). --pairs
    sequential is DualPipe's, and a CPU's: on in-order streams (NCCL) its batches deadlock. It also sets
    --deallocate, always on with dualpipe and dualpipev: DeepSeek's code frees every sent output."""
    if args.schedule in SCHEDULES:
        check_shape(args)
        args.deallocate = True
    if args.pairs not in ("overlapped", "sequential"):
        raise ValueError(f"--pairs {args.pairs} is unknown: use overlapped or sequential")
    if args.pairs == "sequential" and args.schedule not in SCHEDULES:
        raise ValueError(f"--pairs sequential does not fit --schedule {args.schedule}: only dualpipe and "
                         "dualpipev run forward-backward pairs")
    if args.pairs == "sequential" and args.device == "cuda":  # config.check_device has decided the device
        raise ValueError("--pairs sequential needs --device cpu (this run would use CUDA): on NCCL, whose "
                         "transfers complete in the order posted, the sequential pairs' batches deadlock "
                         "(tests/replay.py); use --pairs overlapped")

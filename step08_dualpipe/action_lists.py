"""A schedule as data: a list of actions per rank, in PyTorch's notation, read, written and checked.

Read this before schedule_lab.py, which lowers such a list and runs it. The notation is PyTorch's own
(torch.distributed.pipelining, schedules.py):

    2F3    forward of stage 2 on microbatch 3
    2B3    its full backward
    2I3    its input-gradient backward (step 08's B: the previous stage waits for it)
    2W3    its weight-gradient backward (step 08's W: nobody waits for it)

A file has one CSV row per rank, the rank's actions in the order it runs them: what PyTorch's
_dump_csv writes (its empty cells and its communication actions are skipped: schedule_lab.py's lowering
places the transfers). The stages a rank's actions name are the stages it holds, so one list can
use the interleaved placement (rank r holds r, r+p, ...) or the V (rank r holds r and 2p-1-r).
"""
import csv
import io
import re
from collections import namedtuple

from support import outputs

TORCH_ONLY = {"SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD"}  # skipped on reading
ACTION = re.compile(r"^(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)$")


class ScheduleError(ValueError):
    """A list of actions that cannot run: one line naming the rank and the action."""


class Action(namedtuple("Action", "stage kind mb")):
    """One compute: kind F, B, I or W of stage `stage` (the model's chunk) on microbatch `mb`."""

    def __str__(self):
        return f"{self.stage}{self.kind}{self.mb}"


def parse_action(text: str, rank: int, place: int):
    """PyTorch's compact notation -> Action; None for an empty cell or a communication action of PyTorch's."""
    text = text.strip()
    found = ACTION.match(text)
    if text and not found:
        raise ScheduleError(f"rank {rank}, action {place} '{text}': unknown action; write STAGE KIND MICROBATCH, "
                            "KIND one of F, B, I, W (e.g. 0F1, 2I3)")
    if not text or found.group(2) in TORCH_ONLY:
        return None
    if not found.group(3):
        raise ScheduleError(f"rank {rank}, action {place} '{text}': a compute needs its microbatch (e.g. {text}0)")
    return Action(int(found.group(1)), found.group(2), int(found.group(3)))


def parse_rows(rows):
    """Rows of cells (one row per rank) -> [[Action]] per rank."""
    plan = [[parse_action(cell, rank, place) for place, cell in enumerate(row)] for rank, row in enumerate(rows)]
    return [[action for action in actions if action is not None] for actions in plan]


def read_schedule(path: str):
    """A compute-only CSV (PyTorch's _dump_csv, one row per rank; UTF-8, a byte-order mark allowed) -> [[Action]]
    per rank. Bytes that are not UTF-8 are a ScheduleError naming the first one's position."""
    with open(path, "rb") as file:
        data = file.read()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ScheduleError(f"byte {err.start} (0x{data[err.start]:02x}) is not UTF-8: save the list as UTF-8 "
                            "text") from None
    return parse_rows(list(csv.reader(io.StringIO(text, newline=""))))


def rendered(plan) -> bytes:
    """[[Action]] per rank -> the CSV that PyTorch's _load_csv reads back, as csv.writer writes it."""
    text = io.StringIO(newline="")
    csv.writer(text).writerows([[str(action) for action in actions] for actions in plan])
    return text.getvalue().encode()


def write_schedule(path: str, plan):
    """The CSV of [[Action]] per rank, written whole through a temporary file (support/outputs.py)."""
    outputs.write(path, rendered(plan), "wb")


def is_list(head: bytes) -> bool:
    """Whether a file is a list this course wrote: exactly the bytes rendered() makes of the actions it holds
    (PyTorch's format has no room for a mark: a list written alike, byte for byte, by another tool passes too)."""
    try:
        return rendered(parse_rows(csv.reader(io.StringIO(head.decode(), newline="")))) == head
    except ValueError:  # UnicodeDecodeError and ScheduleError included
        return False


def placement(plan) -> dict:
    """stage -> the rank whose actions name it."""
    return {action.stage: rank for rank, actions in enumerate(plan) for action in actions}


def stages_of(plan, rank: int) -> list:
    """The stages a rank holds, in model order: its chunks 0, 1, ..."""
    return sorted({action.stage for action in plan[rank]})


def layout_problems(plan, pp: int, microbatches: int) -> list:
    """Problems of shape, each one line: ranks, stages and microbatches that do not exist or do not fit."""
    if len(plan) != pp:
        return [f"the list has {len(plan)} rows (ranks), but --pp is {pp}"]
    problems, owners = [], {}
    for rank, actions in enumerate(plan):
        for action in actions:
            owners.setdefault(action.stage, set()).add(rank)
    n_stages = len(owners)
    for rank, actions in enumerate(plan):
        for place, action in enumerate(actions):
            if action.stage >= n_stages:
                problems.append(f"rank {rank}, action {place} {action}: stage {action.stage} does not exist "
                                f"(the list's {n_stages} stages must be 0..{n_stages - 1})")
            if action.mb >= microbatches:
                problems.append(f"rank {rank}, action {place} {action}: microbatch {action.mb} does not exist "
                                f"(--microbatches {microbatches})")
    problems += [f"stage {stage} is on ranks {sorted(ranks)}: each stage lives on one rank"
                 for stage, ranks in sorted(owners.items()) if len(ranks) > 1]
    held = {len(stages_of(plan, rank)) for rank in range(pp)}
    if len(held) > 1:
        problems.append(f"ranks hold {sorted(held)} stages each: every rank must hold the same number")
    return problems


def order_problems(plan, microbatches: int) -> list:
    """Problems of order on each rank, one line each naming the rank and the action: every (stage, mb) is
    forwarded once and backwarded once (one B, or an I and then a W), and each backward follows its forward."""
    problems = []
    for rank, actions in enumerate(plan):
        seen = {}
        for place, action in enumerate(actions):
            key, where = (action.stage, action.mb), f"rank {rank}, action {place} {action}"
            if (action.kind, key) in seen:
                problems.append(f"{where}: runs twice")
            needs = {"F": None, "B": "F", "I": "F", "W": "I"}[action.kind]
            if needs and (needs, key) not in seen:
                problems.append(f"{where}: before its {action.stage}{needs}{action.mb}")
            if action.kind == "B" and ("I", key) in seen or action.kind == "I" and ("B", key) in seen:
                problems.append(f"{where}: the microbatch's backward runs both whole (B) and split (I)")
            seen[action.kind, key] = place
        for stage in stages_of(plan, rank):
            for mb in range(microbatches):
                missing = [kind for kind in ("F", "I" if ("I", (stage, mb)) in seen else "B") if (kind, (stage, mb))
                           not in seen] + (["W"] if ("I", (stage, mb)) in seen and ("W", (stage, mb)) not in seen else [])
                problems += [f"rank {rank}: {stage}{kind}{mb} is missing" for kind in missing]
    return problems

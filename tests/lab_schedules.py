"""PyTorch's ZB-V and Looped BFS as list files for the lab (step 08's torch_schedules.py builds them).

    python tests/lab_schedules.py zbv|looped-bfs PP MICROBATCHES OUT.csv

then, for example: python tests/lab.py OUT.csv --pp PP --microbatches MICROBATCHES. The same lists run
in train.py as --schedule zbv and --schedule looped-bfs.
"""
import sys
from pathlib import Path

STEP = Path(__file__).resolve().parent.parent / "step08_dualpipe"

if __name__ == "__main__":
    sys.path.insert(0, str(STEP))
    from action_lists import Action, write_schedule
    from torch_schedules import GENERATORS

    if len(sys.argv) != 5 or sys.argv[1] not in GENERATORS:
        sys.exit("usage: python tests/lab_schedules.py zbv|looped-bfs PP MICROBATCHES OUT.csv")
    plan = GENERATORS[sys.argv[1]](int(sys.argv[2]), int(sys.argv[3]))
    write_schedule(sys.argv[4], [[Action(*a) for a in row] for row in plan])

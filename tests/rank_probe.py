"""One rank of tests/test_warm.py: prints what it was started with, joins the group, and fails if asked.

    torchrun --standalone --nproc_per_node 2 tests/rank_probe.py [fail]

Every rank prints its argv, environment, working folder, sys.path[0] and __file__, joins a gloo group (through
the rendezvous store the launcher runs) and meets the others at a barrier. With `fail`, rank 1 raises before
it joins, so rank 0 waits to join until the launcher stops it: both launchers stop it, whatever the timing.
"""
import json
import os
import sys

import torch.distributed as dist

print("argv", json.dumps(sys.argv))
print("env", json.dumps(dict(sorted(os.environ.items()))))
print("where", os.getcwd(), sys.path[0], __file__, __name__)
print("stderr of rank", os.environ["RANK"], file=sys.stderr)
if sys.argv[1:] == ["fail"] and os.environ["RANK"] == "1":
    raise RuntimeError("rank 1 fails, as asked")
dist.init_process_group("gloo")
dist.barrier()
print("joined", dist.get_rank(), "of", dist.get_world_size())
dist.destroy_process_group()

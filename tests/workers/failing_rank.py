"""One rank's DDP hook raises at step 2 and the rank exits with that error (uncaught: its atexit
commlib.shutdown() runs); the others wait in backward for its bucket. `failing_rank.py OUT RANK`.

Every other rank writes OUT/rank<r>.json with the error its backward raised and how long it
waited for it; pytest checks they got the failed rank's own error, at once.
"""
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import commlib.torch as cl

out, failing = Path(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
rank = dist.get_rank()
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
model = DDP(net)
state = cl.CommlibState(net.named_parameters(), policy="*=omnireduce")


def hook(state, bucket):
    if rank == failing and state.iteration == 2:
        raise ValueError(f"rank {rank}'s own failure in its hook")
    return cl.ddp_comm_hook(state, bucket)


model.register_comm_hook(state, hook)
for step in range(4):
    loss = model(torch.randn(4, 8)).sum()
    start = time.monotonic()
    try:
        loss.backward()
    except Exception as exc:
        if rank == failing:
            raise   # exits with its error, as a user's script does
        result = {"rank": rank, "step": step, "error": f"{type(exc).__name__}: {exc}",
                  "seconds": time.monotonic() - start}
        (out / f"rank{rank}.json").write_text(json.dumps(result))
        sys.exit(0)

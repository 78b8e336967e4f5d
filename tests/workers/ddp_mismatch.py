"""A DDP bucket whose `head.weight` has another shape on the last rank than on the others, or
(`ddp_mismatch.py OUT names`) the same shapes under other names there (`tail.*`).

DDP is built with init_sync=False, which skips its own shape check, so the mismatch reaches the
hook as a real bucket would. Every rank writes OUT/rank<r>.json with the error its backward raised
(type and message) and how long it took; pytest checks each rank got the same clear error.
"""
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import commlib
import commlib.torch as cl

out = Path(sys.argv[1])
names = sys.argv[2:] == ["names"]
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank, size = dist.get_rank(), dist.get_world_size()
last = rank == size - 1
net = torch.nn.Sequential()
net.add_module("body", torch.nn.Linear(8, 16))
net.add_module("tail" if last and names else "head", torch.nn.Linear(16, 5 if last and not names else 4))
model = DDP(net, init_sync=False)
model.register_comm_hook(cl.CommlibState(net.named_parameters(), policy="*=ring"), cl.ddp_comm_hook)
start = time.monotonic()
error = None
try:
    model(torch.randn(4, 8)).sum().backward()
except Exception as exc:   # what DDP raises where it waits for the bucket: reported to pytest
    error = {"type": type(exc).__name__, "message": str(exc)}
result = {"rank": rank, "error": error, "seconds": time.monotonic() - start,
          "records": sorted(commlib.records())}
(out / f"rank{rank}.json").write_text(json.dumps(result))
commlib.shutdown()

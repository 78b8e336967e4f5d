"""`auto` measures dense tensors: switchml and the ring are tried, a block of steps each. The ring sleeps SLOW_S per
call until step FLIP, then switchml does. 'w.0' and 'w.1' (one group: the same dtype and size
band) are reduced every step under `auto`; 'named.w' goes to the ring by a policy rule and
'caller.w' to switchml by the caller's algorithm=. 'named.w' is float64: it never fuses with the
trial's ring bucket, whose sleep would otherwise be shared by three tensors' bytes, not two. Reports, per step, what commlib.records() shows
of each tensor, whether each result is the sum, and on rank 0 the full submissions its controller
handled per name."""
import time

import numpy as np

import commlib
from commlib.backends.ring import RingBackend
from commlib.backends.switchml import SwitchMLBackend
from commlib.testing import full_submissions, report

STEPS, FLIP, SLOW_S = 30, 12, 0.05
slow = "ring"


def sleeping(cls):
    """cls.allreduce, SLOW_S late while `slow` names it."""
    allreduce = cls.allreduce

    def late(self, array, name, *args, **kwargs):
        if slow == cls.name:
            time.sleep(SLOW_S)
        return allreduce(self, array, name, *args, **kwargs)
    cls.allreduce = late


sleeping(RingBackend)
sleeping(SwitchMLBackend)
commlib.init(policy="named.*=ring;*=auto")
rank, size = commlib.rank(), commlib.size()
full = full_submissions()   # per name, on rank 0


def tensor(step, r, i):
    dtype = np.float64 if names[i] == "named.w" else np.float32
    return np.arange(1000, dtype=dtype) * (r + 1) + step + i   # small integers: exact in any order


names = ["w.0", "w.1", "named.w", "caller.w"]
steps = []
for step in range(STEPS):
    slow = "ring" if step < FLIP else "switchml"
    handles = [commlib.allreduce_async(tensor(step, rank, i), name=name, op=commlib.Sum,
                                       algorithm="switchml" if name == "caller.w" else None)
               for i, name in enumerate(names)]
    exact = {name: bool(np.array_equal(commlib.synchronize(h), sum(tensor(step, r, i) for r in range(size))))
             for i, (name, h) in enumerate(zip(names, handles))}
    records = commlib.records()
    steps.append({"records": {name: {"algorithm": records[name]["algorithm"], "auto": records[name].get("auto")}
                              for name in names}, "exact": exact, "full": dict(full)})
report(rank=rank, steps=steps, flip=FLIP, slow_s=SLOW_S)
commlib.shutdown()

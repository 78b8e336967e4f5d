"""A backend defined outside commlib's package (as a user's own module would): registering it is
all it takes for `auto`, the policy and the compressors to route to it. Reports, per tensor, the
algorithm commlib.records() names, whether the sum is right, and how many calls the toy saw."""
import numpy as np

import commlib
from commlib.backends import Backend, register
from commlib.testing import report


@register
class ToyBackend(Backend):
    """The ring engine's sum under another name, counting its calls."""
    name = "toy"
    dtypes = (np.dtype("float32"),)
    carries = {"dense": 1, "summable": 1}   # ahead of every built-in carrier of both kinds
    calls = 0

    @classmethod
    def available(cls, ctx):
        return (ctx.engine is not None), "needs the job's ring engine"

    def allreduce(self, array, name):
        ToyBackend.calls += 1
        return self.ctx.engine.allreduce(array, name)


commlib.init(policy="named.*=toy;*=auto")
rank, size = commlib.rank(), commlib.size()
x = np.arange(1000, dtype=np.float32) + rank
expected = sum(np.arange(1000, dtype=np.float32) + r for r in range(size))
out = {}
for name, kwargs in (("auto.dense", {}), ("named.dense", {}), ("auto.fp16", {"compression": "fp16"}),
                     ("auto.int64", {})):
    value = x.astype(np.int64) if name == "auto.int64" else x
    got = commlib.allreduce(value, name=name, op=commlib.Sum, **kwargs)
    out[name] = {"algorithm": commlib.records()[name]["algorithm"],
                 "exact": bool(np.array_equal(got, expected.astype(value.dtype)))}
report(rank=rank, tensors=out, toy_calls=ToyBackend.calls)
commlib.shutdown()

"""Plain dense allreduce through an existing engine (Horovod/Gloo, MPI, torch.distributed).

The fallback and the baseline: commlib does not hand-roll a ring; see commlib.engine."""
import numpy as np

from commlib.backends import Backend, register


@register
class RingBackend(Backend):
    name = "ring"
    on_engine = True
    carries = {"dense": 20, "summable": 10}
    ops = ("sum", "min", "max", "product")
    dtypes = tuple(np.dtype(d) for d in ("float16", "float32", "float64", "int8", "uint8", "int32", "int64"))
    reduces_scratch = True   # the engines' collectives reduce in place: a fused bucket needs no copy first

    @classmethod
    def available(cls, ctx):
        if ctx.engine is None:
            return False, "no collective engine (Horovod, MPI or torch.distributed) in this job"
        return True, ""

    def allreduce(self, array, name, op="sum", scratch=False):
        return self.ctx.engine.allreduce(array, name, op, scratch)

    def stats(self):
        return {"engine": self.ctx.engine.name}

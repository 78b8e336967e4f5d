"""Allgather: every rank receives every rank's payload, through the ring's engine (Horovod, MPI,
torch.distributed). It carries what cannot be summed on the wire: compressed payloads that are
decoded rank by rank (signs, quantized codes) and sparsifiers' (values, indices)."""
import numpy as np

from commlib.backends import register
from commlib.backends.ring import RingBackend


@register
class AllgatherBackend(RingBackend):
    name = "allgather"
    carries = {"sparse": 20, "gather": 10}
    ops = ("sum",)

    def allgather(self, array, name):
        return self.ctx.engine.allgather(np.ascontiguousarray(array).reshape(-1), name)

    def allreduce(self, array, name):
        return np.sum(self.allgather(array, name), axis=0, dtype=array.dtype)

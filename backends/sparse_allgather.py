"""Sparse allgather: Horovod's sparse path, written once for every front-end. Each rank sends its
(row indices, row values), of any length, to every rank in ONE allgather through the ring's engine;
every rank then sums them (a coalescing sum: the union of the rows, repeated rows added). It moves
n (4 + row bytes) per rank (int32 indices where the table allows) and N of those to each, so it
wins at low row density and little overlap between ranks; the baseline every sparse claim is measured against (commlib.traffic models it)."""
import numpy as np

from commlib import traffic
from commlib.backends import Backend, register
from commlib.sparse import coalesce, index_dtype, payload_bytes


@register
class SparseAllgatherBackend(Backend):
    name = "sparse_allgather"
    on_engine = True
    carries = {"rows": 10}
    ops = ("sum",)
    dtypes = tuple(np.dtype(d) for d in ("float16", "float32", "float64", "int32", "int64"))

    @classmethod
    def available(cls, ctx):
        if ctx.engine is None:
            return False, "no collective engine (Horovod, MPI or torch.distributed) in this job"
        return True, ""

    def enabled(self, meta):
        return False   # never picked for dense tensors: it sums by gathering every rank's whole array

    @classmethod
    def traffic(cls, stats):
        return traffic.allgather(stats)

    def allreduce(self, array, name):
        return np.sum(self.ctx.engine.allgather(np.ascontiguousarray(array).reshape(-1), name), axis=0,
                      dtype=array.dtype)

    def allreduce_rows(self, rows, values, nrows, name, counts=None):
        """(unique sorted rows, summed values) of the union of every rank's rows. `counts` (every
        rank's row count, from the negotiation) spares the engine its round that exchanges sizes."""
        width, dtype = values.shape[1], values.dtype
        index = index_dtype(nrows)
        # one message per rank: [row count][rows, int32 where the table allows, padded to 8 bytes][values];
        # never empty, which gloo refuses
        rows = np.ascontiguousarray(rows, dtype=index)
        payload = np.zeros(payload_bytes(rows.size, width * dtype.itemsize, nrows), dtype=np.uint8)
        payload[:8].view(np.int64)[0] = rows.size
        start = payload.size - values.nbytes
        payload[8:8 + rows.nbytes] = rows.view(np.uint8)
        payload[start:] = np.ascontiguousarray(values).reshape(-1).view(np.uint8)
        if counts is None:
            parts = self.ctx.engine.allgather(payload, name)
        else:
            sizes = [payload_bytes(count, width * dtype.itemsize, nrows) for count in counts]
            parts = self.ctx.engine.allgather_sized(payload, sizes, name)
        all_rows, all_values = [], []
        for part in parts:
            part = np.ascontiguousarray(part)
            count = int(part[:8].view(np.int64)[0])
            start = payload_bytes(count, 0, nrows)
            all_rows.append(part[8:8 + count * index.itemsize].view(index))
            all_values.append(part[start:start + count * width * dtype.itemsize].view(dtype).reshape(count, width))
        return coalesce(np.concatenate(all_rows).astype(np.int64), np.concatenate(all_values))


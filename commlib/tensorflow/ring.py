"""commlib's ring engine over Horovod's TensorFlow ops, for jobs that initialize horovod.tensorflow.

commlib's own `horovod` engine initializes horovod.torch, a second Horovod instance in the process;
under `horovodrun --gloo` both instances rendezvous under the same keys of horovodrun's store, so
the second can connect to the first's sockets (a gloo "Connection refused" abort, at random).
This engine reuses the TF instance instead. It is registered as `horovod_tensorflow`: choose it
with COMMLIB_RING_ENGINE=horovod_tensorflow (or commlib.init(ring_engine=...)).
"""
import numpy as np

from commlib import engine as engines


class HorovodTensorFlowEngine(engines.Engine):
    name = "horovod_tensorflow"

    def __init__(self):
        import horovod.tensorflow as hvd
        if not hvd.is_initialized():
            hvd.init()
        self.hvd = hvd
        super().__init__(hvd.size())

    def allreduce_sum(self, array, name):
        import tensorflow as tf
        return self.hvd.allreduce(tf.constant(array), op=self.hvd.Sum, name=f"commlib.{name}").numpy()

    def allgather(self, array, name):
        import tensorflow as tf
        lengths = self.hvd.allgather(tf.constant([array.size], tf.int64), name=f"commlib.{name}.lengths").numpy()
        flat = self.hvd.allgather(tf.constant(np.ascontiguousarray(array)), name=f"commlib.{name}").numpy()
        return self._split(flat, lengths.tolist())

    def broadcast_object(self, obj):
        return self.hvd.broadcast_object(obj, root_rank=0, name="commlib.broadcast_object")


engines.ENGINES.setdefault(HorovodTensorFlowEngine.name, HorovodTensorFlowEngine)

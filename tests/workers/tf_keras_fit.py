"""tf.keras model.fit with commlib.tensorflow.keras.DistributedOptimizer and Horovod's callbacks,
against the same fit with Horovod's own Keras DistributedOptimizer.

Every rank starts from its own random weights; BroadcastGlobalVariablesCallback(0) must make them
rank 0's, MetricAverageCallback must make the logged loss the same on every rank. After two
epochs, every rank reports whether the weights are identical on all ranks, their difference (relative) from
Horovod's and the logged losses; tests/test_tensorflow.py checks them. argv: policy.
"""
import sys

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd
import commlib
import commlib.tensorflow.keras as cl
from commlib.testing import report

policy = sys.argv[1]
hvd.init()
commlib.init(policy=policy)
rng = np.random.default_rng(7 + hvd.rank())   # different data on every rank
x, y = rng.normal(size=(64, 10)).astype("float32"), rng.normal(size=(64, 1)).astype("float32")


def fit(distributed_optimizer):
    tf.keras.utils.set_random_seed(1000 + hvd.rank())   # a different start on every rank
    model = tf.keras.Sequential([tf.keras.Input((10,)), tf.keras.layers.Dense(16, activation="relu"),
                                 tf.keras.layers.Dense(1)])
    model.compile(optimizer=distributed_optimizer(tf.keras.optimizers.SGD(0.05)), loss="mse")
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                        callbacks=[cl.BroadcastGlobalVariablesCallback(0), cl.MetricAverageCallback()])
    return np.concatenate([w.ravel() for w in model.get_weights()]), history.history["loss"][-1]


(mine, my_loss), (reference, _) = fit(cl.DistributedOptimizer), fit(hvd.DistributedOptimizer)
everyone = hvd_tf.allgather_object((mine, my_loss))
report(rank=hvd.rank(), same_on_all_ranks=all(np.array_equal(everyone[0][0], w) for w, _ in everyone),
       losses=[float(loss) for _, loss in everyone],
       relative_diff_vs_horovod=float(np.abs(mine - reference).max() / np.abs(reference).max()),
       algorithms=sorted({r["algorithm"] for r in commlib.records().values()}))
commlib.shutdown()

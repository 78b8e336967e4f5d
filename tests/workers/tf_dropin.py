"""What TF Horovod users write beside the plain tape, with commlib's objects, on 2 ranks.

Rank r reports (commlib.testing.report) the gradients it got for: a scalar tf.Variable (eagerly and
in tf.function), a watched eager tensor, a tape over a process set of rank 0 only, Horovod's own and
commlib's PartialDistributedGradientTape / PartialDistributedOptimizer with a local layer, and
whether a Keras copy (from_config) of commlib's optimizer, and a model saved and loaded back (load_model), still
reduce through commlib.
tests/test_tensorflow.py checks them.
"""
import os
import tempfile

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import commlib
import commlib.tensorflow as cl
import commlib.tensorflow.keras as cl_keras
from commlib.tensorflow import GradientReducer
from commlib.testing import report

only_rank0 = hvd.ProcessSet([0])
hvd.init(process_sets=[only_rank0])
commlib.init(policy="*=ring")
r = hvd.rank()
out = {"rank": r}


def scalar_gradient(make_tape, v):
    with tf.GradientTape() as tape:
        loss = v * v   # d(v^2)/dv = 2 (r + 1): the average over 2 ranks is 3
    return make_tape(tape).gradient(loss, [v])[0]


scalars = [tf.Variable(float(r + 1), name=f"scalar{i}") for i in range(3)]
out["scalar eager"] = float(scalar_gradient(cl.DistributedGradientTape, scalars[0]))
out["scalar function"] = float(tf.function(lambda: scalar_gradient(cl.DistributedGradientTape, scalars[1]))())
out["scalar outside the set"] = float(scalar_gradient(
    lambda t: cl.DistributedGradientTape(t, process_set=only_rank0), scalars[2]))

c = tf.constant([float(r + 1)])
with tf.GradientTape() as tape:
    tape.watch(c)
    loss = tf.reduce_sum(c * c)
out["watched tensor"] = cl.DistributedGradientTape(tape).gradient(loss, [c])[0].numpy().tolist()


def model():
    tf.keras.utils.set_random_seed(0)
    return tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(3), tf.keras.layers.Dense(2)])


x = tf.constant(np.random.default_rng(r).normal(size=(8, 4)), tf.float32)


def partial_tape(factory):
    m = model()
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(m(x) ** 2)
    tape = factory(tape, local_layers=m.layers[1])
    return [g.numpy() for g in tape.gradient(loss, m.trainable_variables)]


theirs, ours = partial_tape(hvd.PartialDistributedGradientTape), partial_tape(cl.PartialDistributedGradientTape)
out["partial tape vs horovod"] = max(float(np.abs(a - b).max()) for a, b in zip(theirs, ours))


def partial_optimizer(factory):
    m = model()
    m.compile(optimizer=factory(tf.keras.optimizers.SGD(0.1), local_layers=m.layers[1]), loss="mse")
    m.train_on_batch(x, tf.zeros((8, 2)))
    return [w.numpy() for w in m.trainable_variables]


theirs, ours = (partial_optimizer(hvd_keras.PartialDistributedOptimizer if hasattr(hvd_keras, "PartialDistributedOptimizer")
                                  else __import__("horovod.keras", fromlist=["x"]).PartialDistributedOptimizer),
                partial_optimizer(cl_keras.PartialDistributedOptimizer))
out["partial optimizer vs horovod"] = max(float(np.abs(a - b).max()) for a, b in zip(theirs, ours))

opt = cl_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1))
copy = type(opt).from_config(opt.get_config())
out["copy reduces through commlib"] = isinstance(copy._allreduce_grads, GradientReducer)

m = model()   # saved and loaded back: its optimizer still commlib's (Horovod's load_model would wrap its own)
m.compile(optimizer=cl_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)), loss="mse")
m.train_on_batch(x, tf.zeros((8, 2)))
saved = os.path.join(tempfile.mkdtemp(), "model.h5")
m.save(saved)
loaded = cl_keras.load_model(saved)
loaded.train_on_batch(x, tf.zeros((8, 2)))
out["loaded model reduces through commlib"] = isinstance(loaded.optimizer._allreduce_grads, GradientReducer)
out["keras names horovod's"] = [name for name in ("Compression", "allreduce", "elastic", "callbacks")
                                if getattr(cl_keras, name) is getattr(hvd_keras, name)]

out["records"] = sorted(commlib.records())
commlib.shutdown()
# `import commlib.tensorflow as hvd`, one line changed: the tape and optimizer commlib's, the rest Horovod's own
out["horovods own"] = [name for name in ("init", "allreduce", "alltoall", "reducescatter", "broadcast_variables")
                       if getattr(cl, name) is getattr(hvd, name)]
report(**out)

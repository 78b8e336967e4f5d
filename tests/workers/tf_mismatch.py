"""Rank 1's model has another shape: commlib.tensorflow's tape fails on every rank with commlib's
Mismatch, well within the negotiation timeout. Eagerly the exception is commlib.Mismatch itself; inside tf.function
it crosses TF's numpy_function and arrives as a tf.errors.OpError whose message is commlib's.
argv: eager | function. Rank r prints "TF-MISMATCH-OK r".
"""
import sys
import time

import tensorflow as tf

import horovod.tensorflow as hvd
import commlib
import commlib.tensorflow as cl
from commlib.testing import report

eager = sys.argv[1] == "eager"
hvd.init()
# generous: tracing the tf.function can take seconds on a busy machine, and a mismatch is found as
# soon as both ranks have submitted, whatever the timeout
commlib.init(policy="*=ring", timeout_s=30.0, negotiation_timeout_s=30.0)
width = 5 if hvd.rank() == 1 else 4
layer = tf.keras.layers.Dense(width)
layer.build((None, 3))


def step(x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(x))
    return cl.DistributedGradientTape(tape).gradient(loss, layer.trainable_variables)


start = time.monotonic()
try:
    (step if eager else tf.function(step))(tf.ones((2, 3)))
    error, message = None, ""
except (commlib.CommError, tf.errors.OpError) as exc:   # in a graph TF wraps commlib's error in its own
    error, message = type(exc).__name__, str(exc)
report(rank=hvd.rank(), error=error, message=message[-2000:], elapsed_s=round(time.monotonic() - start, 2))
commlib.shutdown()

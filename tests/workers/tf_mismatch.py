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
    raise SystemExit("no error raised")
except (commlib.Mismatch, tf.errors.OpError) as exc:
    elapsed = time.monotonic() - start
    assert isinstance(exc, commlib.Mismatch) if eager else "Mismatch" in str(exc), str(exc)[-600:]
    assert "ranks disagree on shape: rank 0 gave [3, 4]; rank 1 gave [3, 5]" in str(exc), str(exc)
    assert elapsed < 30.0, elapsed
    print(f"TF-MISMATCH-OK {hvd.rank()} after {elapsed:.1f}s: {type(exc).__name__}", flush=True)
commlib.shutdown()

"""commlib.tensorflow vs Horovod's own TF objects, from the same start, on every rank.

argv: mode policy [compression|none [options]]
  mode: tape-eager | tape-function (DistributedGradientTape) | optimizer (Keras 2 DistributedOptimizer
        .minimize inside tf.function) | embedding (IndexedSlices gradients, tape in tf.function and eagerly)
  options, e.g. "op=sum,predivide=2,passes=2,sparse_as_dense=1" (Horovod's op,
        gradient_predivide_factor, backward_passes_per_step, sparse_as_dense; the same on both sides).
After a few steps with different data per rank, every rank reports (commlib.testing.report) whether
the parameters are identical on all ranks, their largest difference from plain Horovod's (relative
to the largest parameter), the errors for what commlib cannot honor and its records;
tests/test_tensorflow.py checks them.
"""
import sys

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
import commlib
import commlib.tensorflow as cl
from commlib.testing import report

mode, policy = sys.argv[1], sys.argv[2]
compression = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] != "none" else None
options = dict(kv.split("=") for kv in sys.argv[4].split(",")) if len(sys.argv) > 4 else {}
hvd.init()
commlib.init(policy=policy)
op = {"average": hvd.Average, "sum": hvd.Sum}[options.get("op", "average")]
predivide = float(options.get("predivide", 1.0))
passes = int(options.get("passes", 1))
sparse_as_dense = options.get("sparse_as_dense") == "1"
if compression == "hvd.fp16":
    compression = hvd.Compression.fp16
STEPS, BATCH = 4, 16
EMBEDDING = mode == "embedding"
checks = {}   # mode-specific observations, reported with the rest


def make_model():
    tf.keras.utils.set_random_seed(0)   # the same start on every rank and for both runs
    if EMBEDDING:
        return tf.keras.Sequential([tf.keras.Input((4,), dtype="int32"), tf.keras.layers.Embedding(500, 8),
                                    tf.keras.layers.GlobalAveragePooling1D(), tf.keras.layers.Dense(1)])
    return tf.keras.Sequential([tf.keras.Input((20,)), tf.keras.layers.Dense(32, activation="tanh"),
                                tf.keras.layers.Dense(3)])


def batches():
    rng = np.random.default_rng(100 + hvd.rank())   # different data on every rank
    for _ in range(STEPS * passes):
        if EMBEDDING:
            yield tf.constant(rng.integers(0, 500, (BATCH, 4)), tf.int32), tf.constant(rng.normal(size=(BATCH, 1)),
                                                                                         tf.float32)
        else:
            yield tf.constant(rng.normal(size=(BATCH, 20)), tf.float32), tf.constant(rng.normal(size=(BATCH, 3)),
                                                                                       tf.float32)


def loss_of(model, x, y):
    return tf.reduce_mean(tf.square(model(x) - y))


def train_tape(distributed_tape, eager):
    model = make_model()
    opt = tf.keras.optimizers.SGD(0.1)
    seen = []

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_of(model, x, y)
        tape = distributed_tape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        seen.append([type(g).__name__ for g in grads])
        opt.apply_gradients(zip(grads, model.trainable_variables))

    run = step if eager else tf.function(step)
    for x, y in batches():
        run(x, y)
    return model, seen


def train_optimizer(distributed_optimizer):
    model = make_model()
    opt = distributed_optimizer(tf.keras.optimizers.SGD(0.1))

    @tf.function
    def step(x, y):
        opt.minimize(lambda: loss_of(model, x, y), model.trainable_variables, tape=tf.GradientTape())

    for x, y in batches():
        step(x, y)
    return model, []


def flat(model):
    return np.concatenate([w.numpy().ravel() for w in model.trainable_variables])


hvd_kwargs = dict(op=op, gradient_predivide_factor=predivide, sparse_as_dense=sparse_as_dense)
if mode == "optimizer":
    ours, _ = train_optimizer(lambda o: cl.DistributedOptimizer(o, compression=compression,
                                                                backward_passes_per_step=passes, **hvd_kwargs))
    # horovod.tensorflow.DistributedOptimizer drops op= for Keras optimizers (Horovod 0.28.1 does not
    # pass it on to the Keras one, so op=Sum averages); the Keras one honors it, as commlib's does
    import horovod.tensorflow.keras as hvd_keras
    theirs, _ = train_optimizer(lambda o: hvd_keras.DistributedOptimizer(o, backward_passes_per_step=passes,
                                                                         **hvd_kwargs))
else:
    eager = mode == "tape-eager"
    ours, seen = train_tape(lambda t: cl.DistributedGradientTape(t, compression=compression, **hvd_kwargs), eager)
    theirs, _ = train_tape(lambda t: hvd.DistributedGradientTape(t, **hvd_kwargs), eager)
    if EMBEDDING:   # eagerly, too: the embedding's gradient comes back as IndexedSlices unless sparse_as_dense
        eager_model, seen = train_tape(lambda t: cl.DistributedGradientTape(t, compression=compression,
                                                                              **hvd_kwargs), True)
        checks["embedding_gradient_type"] = seen[0][0]
        # eager and traced kernels may round differently (TF promises no bit-identity between them)
        function_params = flat(ours)
        checks["eager_vs_function"] = float(np.abs(flat(eager_model) - function_params).max()
                                            / np.abs(function_params).max())
        # row-sparse travel (rows counted) unless sparse_as_dense densified it first
        checks["embedding_rows"] = [r.get("union_rows") for name, r in commlib.records().items()
                                    if name.startswith("embedding")]

mine, reference = flat(ours), flat(theirs)
everyone = hvd.allgather(tf.constant(mine[None]), name="check.params").numpy()
unsupported = {"op=Adasum": dict(op=hvd.Adasum), "groups": dict(groups=2),
               "process_set": dict(process_set=hvd.ProcessSet([0])), "device_dense": dict(device_dense="/gpu:0")}
errors = {}
for label, kwargs in unsupported.items():
    try:
        cl.DistributedGradientTape(tf.GradientTape(), **kwargs)
        errors[label] = None
    except commlib.CommError as exc:
        errors[label] = f"{type(exc).__name__}: {exc}"
report(rank=hvd.rank(), mode=mode, same_on_all_ranks=all(np.array_equal(everyone[0], row) for row in everyone),
       trained=not np.array_equal(mine, flat(make_model())),
       relative_diff_vs_horovod=float(np.abs(mine - reference).max() / np.abs(reference).max()),
       unsupported=errors,
       records=sorted([name, r["algorithm"], r["compression"]] for name, r in commlib.records().items()),
       **checks)
commlib.shutdown()

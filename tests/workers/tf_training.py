"""commlib.tensorflow vs Horovod's own TF objects, from the same start, on every rank.

argv: mode policy tolerance [compression|none [options]]
  mode: tape-eager | tape-function (DistributedGradientTape) | optimizer (Keras 2 DistributedOptimizer
        .minimize inside tf.function) | embedding (IndexedSlices gradients, tape in tf.function and eagerly)
  options, e.g. "op=sum,predivide=2,passes=2,sparse_as_dense=1" (Horovod's op,
        gradient_predivide_factor, backward_passes_per_step, sparse_as_dense; the same on both sides).
After a few steps with different data per rank, every rank checks that the parameters are identical
on all ranks and within `tolerance` (relative to the largest parameter) of plain Horovod's, and
that what commlib cannot honor is a clear ConfigError. Rank r prints "TF-OK r ...".
"""
import sys

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
import commlib
import commlib.tensorflow as cl

mode, policy, tolerance = sys.argv[1], sys.argv[2], float(sys.argv[3])
compression = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] != "none" else None
options = dict(kv.split("=") for kv in sys.argv[5].split(",")) if len(sys.argv) > 5 else {}
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
        assert seen[0][0] == ("EagerTensor" if sparse_as_dense else "IndexedSlices"), seen[0]
        assert np.array_equal(flat(eager_model), flat(ours)), "eager and tf.function runs differ"

mine, reference = flat(ours), flat(theirs)
everyone = hvd.allgather(tf.constant(mine[None]), name="check.params").numpy()
assert all(np.array_equal(everyone[0], row) for row in everyone), "ranks diverged"
assert not np.array_equal(mine, flat(make_model())), "training did not change the parameters"
diff = np.abs(mine - reference).max() / np.abs(reference).max()
assert diff <= tolerance, f"commlib vs horovod differ by {diff:.3g} (relative) > {tolerance}"

unsupported = {"op=Adasum": dict(op=hvd.Adasum), "groups": dict(groups=2),
               "process_set": dict(process_set=hvd.ProcessSet([0])), "device_dense": dict(device_dense="/gpu:0")}
for label, kwargs in unsupported.items():
    try:
        cl.DistributedGradientTape(tf.GradientTape(), **kwargs)
        raise SystemExit(f"{label}: no error raised")
    except commlib.ConfigError as exc:
        assert "commlib" in str(exc), str(exc)
used = sorted({(name, r["algorithm"], r["compression"]) for name, r in commlib.records().items()})
if EMBEDDING:
    assert any(name.startswith("embedding") and alg == "omnireduce" for name, alg, _ in used), used
print(f"TF-OK {hvd.rank()} mode {mode} relative diff {diff:.3g} records {used}", flush=True)
commlib.shutdown()

"""Keras 3 model.fit through commlib.keras.DistributedOptimizer (no Horovod), run with the
.venv-keras3 python under mpirun (ring through mpi4py) or torchrun-style ranks (torch.distributed).

Each rank fits its shard of every global batch; the result must equal (within `tolerance`,
relative) a single-process fit of the whole data with the global batch, which every rank computes
locally, and be identical on all ranks. argv: policy tolerance [fit|tape]; tape: a custom loop with
commlib.tensorflow.DistributedGradientTape in a tf.function, Horovod absent. KERAS_BACKEND picks
tensorflow or torch. Rank r prints "KERAS3-OK r ...".
"""
import sys

import numpy as np

import commlib
import commlib.keras

policy, tolerance = sys.argv[1], float(sys.argv[2])
mode = sys.argv[3] if len(sys.argv) > 3 else "fit"
commlib.init(policy=policy)
import keras  # noqa: E402  after init: torch.distributed / MPI are up before Keras' backend starts

rank, size = commlib.rank(), commlib.size()
GLOBAL_BATCH, STEPS = 16, 6
local_batch = GLOBAL_BATCH // size
rng = np.random.default_rng(3)
x = rng.normal(size=(GLOBAL_BATCH * STEPS, 12)).astype("float32")
y = (x[:, :1] * 2 - x[:, 1:2] + 0.1 * rng.normal(size=(len(x), 1))).astype("float32")
# rank r's part of global batch k: rows [16k + r*local_batch, 16k + (r+1)*local_batch)
shard = np.concatenate([np.arange(k * GLOBAL_BATCH + rank * local_batch, k * GLOBAL_BATCH + (rank + 1) * local_batch)
                        for k in range(STEPS)])


class Scale(keras.layers.Layer):
    """One learned scalar: a shape=() weight, whose gradient reaches commlib as a 0-d value."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(), initializer="ones")

    def call(self, x):
        return x * self.scale


def fit(optimizer, x, y, batch_size):
    keras.utils.set_random_seed(0)   # the same start everywhere
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1),
                              Scale()])
    commlib.keras.broadcast_variables(model.variables)   # the scalar too
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    return np.concatenate([w.ravel() for w in model.get_weights()])


def tape_loop(distributed, x, y, batch_size):
    import tensorflow as tf
    import commlib.tensorflow
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.1)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb) - yb))
        if distributed:
            tape = commlib.tensorflow.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    for _ in range(2):
        for k in range(0, len(x), batch_size):
            step(x[k:k + batch_size], y[k:k + batch_size])
    return np.concatenate([w.ravel() for w in model.get_weights()])


if mode == "tape":
    mine = tape_loop(True, x[shard], y[shard], local_batch)
    reference = tape_loop(False, x, y, GLOBAL_BATCH)
else:
    mine = fit(commlib.keras.DistributedOptimizer(keras.optimizers.SGD(0.1)), x[shard], y[shard], local_batch)
    reference = fit(keras.optimizers.SGD(0.1), x, y, GLOBAL_BATCH)
summed = commlib.allreduce(mine, name="check.params", op=commlib.Sum, algorithm="ring")
assert np.array_equal(summed, mine * size), "ranks' weights differ after fit"
diff = np.abs(mine - reference).max() / np.abs(reference).max()
assert diff <= tolerance, f"2-rank fit vs single-process large batch differ by {diff:.3g} (relative) > {tolerance}"
for label, make in {"op": lambda: commlib.keras.DistributedOptimizer(keras.optimizers.SGD(0.1), op="max"),
                    "predivide with Sum": lambda: commlib.keras.DistributedOptimizer(
                        keras.optimizers.SGD(0.1), op=commlib.Sum, gradient_predivide_factor=2.0)}.items():
    try:
        make()
        raise SystemExit(f"{label}: no error raised")
    except commlib.ConfigError as exc:
        assert "commlib" in str(exc) or "gradient_predivide_factor" in str(exc), str(exc)
if mode == "tape":   # Horovod's own options cannot be honored without Horovod: a clear error
    import tensorflow as tf
    import commlib.tensorflow
    try:
        commlib.tensorflow.DistributedGradientTape(tf.GradientTape(), groups=2)
        raise SystemExit("groups without Horovod: no error raised")
    except commlib.ConfigError as exc:
        assert "groups" in str(exc) and "Horovod" in str(exc), str(exc)
used = sorted({r["algorithm"] for name, r in commlib.records().items() if not name.startswith("check.")})
print(f"KERAS3-OK {rank} {mode} backend {keras.backend.backend()} keras {keras.__version__} relative diff {diff:.3g} "
      f"algorithms {used}", flush=True)
commlib.shutdown()

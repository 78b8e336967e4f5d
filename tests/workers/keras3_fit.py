"""Keras 3 model.fit through commlib.keras.DistributedOptimizer (no Horovod), run with the
.venv-keras3 python under mpirun (ring through mpi4py) or torchrun-style ranks (torch.distributed).

Each rank fits its shard of every global batch; the result must equal (within `tolerance`,
relative) a single-process fit of the whole data with the global batch, which every rank computes
locally, and be identical on all ranks. argv: policy [fit|tape|mixed]; tape: a custom loop with
commlib.tensorflow.DistributedGradientTape in a tf.function, Horovod absent; mixed: fit under the
mixed_float16 dtype policy with rank 0's rows 3000 times larger, so that float16 overflows on rank 0
only (Keras' loss scaling must skip those steps on every rank alike). KERAS_BACKEND picks
tensorflow or torch. Every rank reports (commlib.testing.report) the backend, whether its weights
equal the others', their relative difference from the single-process fit, the errors for what
commlib cannot honor and the algorithms it used; tests/test_keras3.py checks them.
"""
import sys

import numpy as np

import commlib
import commlib.keras
from commlib.testing import report

policy = sys.argv[1]
mode = sys.argv[2] if len(sys.argv) > 2 else "fit"
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
if mode == "mixed":
    keras.mixed_precision.set_global_policy("mixed_float16")
    for k in range(STEPS):   # rank 0's part of every global batch
        x[k * GLOBAL_BATCH:k * GLOBAL_BATCH + local_batch] *= 3e3


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
    def step(xb, yb):   # the distributed tape in Horovod's `with` form
        with (commlib.tensorflow.DistributedGradientTape(tf.GradientTape()) if distributed
              else tf.GradientTape()) as tape:
            loss = tf.reduce_mean(tf.square(model(xb) - yb))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    for _ in range(2):
        for k in range(0, len(x), batch_size):
            step(x[k:k + batch_size], y[k:k + batch_size])
    return np.concatenate([w.ravel() for w in model.get_weights()])


if mode == "tape":
    mine = tape_loop(True, x[shard], y[shard], local_batch)
    reference = tape_loop(False, x, y, GLOBAL_BATCH)
elif mode == "mixed":   # an optimizer class of the script's own, which Keras cannot find by name
    MySGD = type("MySGD", (keras.optimizers.SGD,), {})
    mine = fit(commlib.keras.DistributedOptimizer(MySGD(0.1)), x[shard], y[shard], local_batch)
    reference = fit(MySGD(0.1), x, y, GLOBAL_BATCH)
else:
    mine = fit(commlib.keras.DistributedOptimizer(keras.optimizers.SGD(0.1)), x[shard], y[shard], local_batch)
    reference = fit(keras.optimizers.SGD(0.1), x, y, GLOBAL_BATCH)
summed = commlib.allreduce(mine, name="check.params", op=commlib.Sum, algorithm="ring")
odd = keras.Variable(np.array([1.0, 2.0, 3.0] if rank == 0 else [np.inf, np.nan, 0.0], np.float32))
commlib.keras.broadcast_variables([odd])   # rank 0's values, whatever the others held
unsupported = {"op": lambda: commlib.keras.DistributedOptimizer(keras.optimizers.SGD(0.1), op="max"),
               "predivide with Sum": lambda: commlib.keras.DistributedOptimizer(
                   keras.optimizers.SGD(0.1), op=commlib.Sum, gradient_predivide_factor=2.0)}
if mode == "tape":   # Horovod's own options cannot be honored without Horovod: a clear error
    import tensorflow as tf
    import commlib.tensorflow
    unsupported["groups"] = lambda: commlib.tensorflow.DistributedGradientTape(tf.GradientTape(), groups=2)
errors = {}
for label, make in unsupported.items():
    try:
        make()
        errors[label] = None
    except commlib.CommError as exc:
        errors[label] = f"{type(exc).__name__}: {exc}"
report(rank=rank, mode=mode, backend=keras.backend.backend(), keras=keras.__version__,
       broadcast=keras.ops.convert_to_numpy(odd.value).tolist(),
       same_on_all_ranks=bool(np.array_equal(summed, mine * size)),
       relative_diff=float(np.abs(mine - reference).max() / np.abs(reference).max()), unsupported=errors,
       algorithms=sorted({r["algorithm"] for name, r in commlib.records().items() if not name.startswith("check.")}))
commlib.shutdown()

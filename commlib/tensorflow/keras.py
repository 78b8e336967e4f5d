"""tf.keras (Keras 2, TF <= 2.15) front-end: Horovod's Keras DistributedOptimizer with commlib
doing the communication, and Horovod's Keras callbacks beside it.

    import horovod.tensorflow.keras as hvd, commlib.tensorflow.keras as cl
    hvd.init()
    model.compile(optimizer=cl.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), policy="*=switchml"), ...)
    model.fit(x, y, callbacks=[cl.callbacks.BroadcastGlobalVariablesCallback(0),
                               cl.callbacks.MetricAverageCallback()])

Or one line changed in a Horovod Keras script, `import commlib.tensorflow.keras as hvd`: the
optimizers and load_model are commlib's, every other name horovod.tensorflow.keras's own.
"""
from commlib import horovod_options
from commlib.tensorflow import distributed_optimizer, local_variables
from commlib.errors import BackendUnavailable

try:
    from horovod.tensorflow.keras import (callbacks, init, is_initialized, local_rank,  # noqa: F401  (re-exported)
                                          local_size, rank, shutdown, size, broadcast_global_variables)
    from horovod.tensorflow.keras.callbacks import (BroadcastGlobalVariablesCallback,  # noqa: F401
                                                    LearningRateScheduleCallback, LearningRateWarmupCallback,
                                                    MetricAverageCallback)
except ImportError as _exc:
    raise BackendUnavailable(f"commlib.tensorflow.keras needs horovod built with TensorFlow ({_exc}); run "
                             f"`make install`, or use commlib.keras (Keras 3, no Horovod)") from _exc


def DistributedOptimizer(optimizer, compression=None, op=None, gradient_predivide_factor=1.0,
                         sparse_as_dense=False, backward_passes_per_step=1, policy=None, algorithm=None,
                         **horovod_kwargs):
    """Horovod's `horovod.tensorflow.keras.DistributedOptimizer(optimizer, ...)`, its gradients
    reduced by commlib (policy, algorithm, compression as in commlib.tensorflow)."""
    import horovod.tensorflow.keras as hvd
    return distributed_optimizer(hvd.DistributedOptimizer, optimizer, compression, op, gradient_predivide_factor,
                                 sparse_as_dense, backward_passes_per_step, policy, algorithm, horovod_kwargs)


def PartialDistributedOptimizer(optimizer, *args, local_layers=None, **kwargs):
    """Horovod's `PartialDistributedOptimizer`: DistributedOptimizer's (arguments as there), the
    gradients of `local_layers` (Keras layers) kept local, as Horovod keeps them."""
    opt = DistributedOptimizer(optimizer, *args, **kwargs)
    for variable in local_variables(local_layers):
        opt.register_local_var(variable)
    return opt


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=None, legacy_opts=False,
               policy=None, algorithm=None):
    """Horovod's `load_model`: a saved Keras model, its optimizer wrapped in commlib's DistributedOptimizer
    (Horovod's own would wrap it in Horovod's, reducing past commlib without a word)."""
    import tensorflow as tf
    from horovod._keras import load_model as load

    def wrap_optimizer(cls):
        return lambda **kwargs: DistributedOptimizer(cls(**kwargs), compression=compression, policy=policy,
                                                     algorithm=algorithm)
    return load(tf.keras, wrap_optimizer, filepath, custom_optimizers, custom_objects, legacy_opts)


# horovod.tensorflow.keras's names beside commlib's (Compression, allreduce, elastic, ...)
__getattr__ = horovod_options.names_of("horovod.tensorflow.keras", __name__)

"""tf.keras (Keras 2, TF <= 2.15) front-end: Horovod's Keras DistributedOptimizer with commlib
doing the communication, and Horovod's Keras callbacks beside it.

    import horovod.tensorflow.keras as hvd, commlib.tensorflow.keras as cl
    hvd.init()
    model.compile(optimizer=cl.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), policy="*=switchml"), ...)
    model.fit(x, y, callbacks=[cl.callbacks.BroadcastGlobalVariablesCallback(0),
                               cl.callbacks.MetricAverageCallback()])
"""
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

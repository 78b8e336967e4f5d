"""Keras 3 front-end, no Horovod (TF >= 2.16 and Keras 3, where Horovod's TF ops cannot go):
an optimizer that reduces the gradients across ranks with commlib before applying them.

    import keras, commlib, commlib.keras
    commlib.init(policy="*=switchml")        # rank/size from mpirun or torchrun
    model.compile(optimizer=commlib.keras.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    commlib.keras.broadcast_variables(model.variables)   # the same start on every rank
    model.fit(x_shard, y_shard, ...)

Run with `mpirun -np 4 python train.py` (the ring through mpi4py) or `torchrun --nproc-per-node 4
train.py` (torch.distributed gloo). Backends: tensorflow (eagerly or inside model.fit's tf.function,
through commlib.tensorflow's one-crossing-per-step boundary; compile with jit_compile=False, as XLA
cannot call back into Python) and torch (gradients go to commlib as torch tensors).
"""
import numpy as np

import commlib
from commlib.errors import ConfigError
from commlib.policy import Policy


def DistributedOptimizer(optimizer, policy=None, algorithm=None, compression=None, op=commlib.Average,
                         gradient_predivide_factor=1.0, sparse_as_dense=False):
    """A copy of the Keras 3 `optimizer` (same class name and config) whose apply() first reduces the
    gradients with commlib: averaged by default (op=commlib.Sum sums), named by the variables' paths
    ("sequential/dense/kernel") for the policy. Returns a new optimizer, as Horovod's does.
    Under the global mixed_float16 dtype policy (set it before building the optimizer, as Keras asks)
    it is a LossScaleOptimizer whose inner optimizer is a copy of `optimizer`: compile() would
    otherwise wrap it in one, which skips apply() on a rank whose own gradients overflowed, and the
    ranks would reduce different steps; so the gradients are reduced first and every rank skips or
    applies alike. A model given its own mixed policy (not the global one): pass a LossScaleOptimizer."""
    import keras
    if op not in (commlib.Average, commlib.Sum):
        raise ConfigError(f"commlib.keras reduces with op=commlib.Average or commlib.Sum, not {op!r}")
    if gradient_predivide_factor != 1.0 and op != commlib.Average:
        raise ConfigError("gradient_predivide_factor only applies with op=commlib.Average")
    if keras.backend.backend() not in ("tensorflow", "torch"):
        raise ConfigError(f"commlib.keras supports the tensorflow and torch backends of Keras 3, not "
                          f"{keras.backend.backend()!r} (set KERAS_BACKEND)")
    if isinstance(policy, str):
        policy = Policy.parse(policy)
    commlib.init()
    reduce = _reducer(keras.backend.backend(), op == commlib.Average, gradient_predivide_factor, compression,
                      policy, algorithm, sparse_as_dense)
    scaler = keras.optimizers.LossScaleOptimizer
    scaled = isinstance(optimizer, scaler)
    if scaled or keras.config.dtype_policy().name == "mixed_float16":
        # the loss scaler's own copy around a copy of the inner optimizer, each made by its class, not by
        # name (a subclass Keras has not registered), and the caller's objects left as they are
        inner = optimizer.inner_optimizer if scaled else optimizer
        inner = type(inner).from_config(inner.get_config())
        options = {k: v for k, v in optimizer.get_config().items() if k != "inner_optimizer"} if scaled else {}
        base, make = scaler, lambda cls: cls(inner, **options)
    else:
        base, make = type(optimizer), lambda cls: cls.from_config(optimizer.get_config())

    def apply(self, grads, trainable_variables=None):
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
        variables = trainable_variables if trainable_variables is not None else (
            self._trainable_variables if self.built else None)   # unbuilt: Keras raises its own error
        return super(distributed, self).apply(reduce(list(grads), variables), trainable_variables)

    # a subclass made here, named like the original so saved models load without commlib; super()
    # names it explicitly (Horovod's super(self.__class__, ...) recurses when subclassed again)
    distributed = type(base.__name__, (base,), {"apply": apply, "__module__": base.__module__})
    return make(distributed)


def broadcast_variables(variables, root_rank=0):
    """Give every rank root_rank's values (call once after the model is built, before training)."""
    import keras
    if commlib.size() == 1:
        return
    for i, variable in enumerate(variables):
        value = keras.ops.convert_to_numpy(variable.value)
        mine = value if commlib.rank() == root_rank else np.zeros_like(value)   # not value * 0: inf * 0 is NaN
        variable.assign(commlib.allreduce(mine, name=f"broadcast.{i}.{variable.path}", op=commlib.Sum,
                                          algorithm="ring"))


def _reducer(backend, average, predivide, compression, policy, algorithm, sparse_as_dense):
    if backend == "tensorflow":
        from commlib.tensorflow.gradients import GradientReducer
        return GradientReducer(average, predivide, compression, policy, algorithm, sparse_as_dense)
    from commlib.tensorflow.names import tensor_names   # imports no TensorFlow

    def reduce_torch(grads, variables):
        names = tensor_names(variables, len(grads))
        handles = {i: commlib.allreduce_async(g, name=names[i], op=commlib.Average if average else commlib.Sum,
                                              algorithm=algorithm, compression=compression, policy=policy,
                                              prescale_factor=1.0 / predivide if average else 1.0,
                                              postscale_factor=predivide if average else 1.0)
                   for i, g in enumerate(grads) if g is not None}
        return [commlib.synchronize(handles[i]) if i in handles else g for i, g in enumerate(grads)]
    return reduce_torch

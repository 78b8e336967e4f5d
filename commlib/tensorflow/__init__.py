"""TensorFlow front-end: Horovod's DistributedGradientTape / DistributedOptimizer with commlib
doing the communication (TF <= 2.15, where Horovod's TF ops build).

    import tensorflow as tf, horovod.tensorflow as hvd, commlib.tensorflow as cl
    hvd.init()
    commlib.init(policy="embedding/*=omnireduce;*=switchml")
    with tf.GradientTape() as tape:
        loss = ...
    tape = cl.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    cl.broadcast_variables(model.variables, root_rank=0)   # once, after the first step

Horovod keeps doing what it does (local sources, backward_passes_per_step, the optimizer
wrapping); only the per-instance `_allreduce_grads` of the object it returns is replaced by
commlib's GradientReducer. Horovod is neither patched nor subclassed. Without Horovod's TF ops
(TF >= 2.16, Keras 3) DistributedGradientTape reduces through commlib alone, and Keras 3's
model.fit uses `commlib.keras`.

commlib's ring reuses the job's TF Horovod instance to start (commlib.engine: a second one,
horovod.torch, would race it) and carries its data on commlib's own Gloo ring.
"""
from tensorflow.autograph.experimental import do_not_convert

import commlib
from commlib import horovod_options
from commlib.errors import BackendUnavailable, ConfigError
from commlib.policy import Policy
# at module level, and the constructors below are not converted: an import inside them (commlib.init
# starts backends), traced by AutoGraph when a user builds the tape inside tf.function, makes it warn
# that it "could not transform _gcd_import"
from commlib.tensorflow.gradients import GradientReducer  # noqa: F401  (public)
from commlib.tensorflow.names import tensor_names  # noqa: F401  (public)
from commlib.tensorflow.tape import CommlibGradientTape

# horovod.tensorflow's names beside commlib's (hvd.init, broadcast_variables, allgather, ...)
__getattr__ = horovod_options.names_of("horovod.tensorflow", __name__,
                                       "run `make install`, or use commlib.keras without Horovod")


def join():
    """Horovod's hvd.join for gradients commlib reduces (see commlib.join): returns the rank that joined last."""
    return commlib.join()


@do_not_convert
def DistributedGradientTape(gradtape, compression=None, op=None, gradient_predivide_factor=1.0,
                            sparse_as_dense=False, policy=None, algorithm=None, **horovod_kwargs):
    """Horovod's `hvd.DistributedGradientTape(gradtape, ...)`, its gradients reduced by commlib.

    compression: a commlib compressor spec ("fp16", "powersgd(rank=4)", an object) or Horovod's
        Compression.none / Compression.fp16. policy: a commlib.Policy or its text, choosing the
        algorithm per variable name ("dense/kernel"); default: commlib.init's. `algorithm` forces one.
    Other arguments are Horovod's (persistent tapes, scale_local_gradients, ...).

    Where Horovod's TF ops are absent (TF >= 2.16), commlib reduces the tape's gradients by itself
    (op: None, commlib.Average or commlib.Sum; no Horovod arguments): rank and size come from the
    launcher (mpirun, torchrun), as for commlib.keras."""
    if not _horovod_available():
        return _tape_without_horovod(gradtape, compression, op, gradient_predivide_factor, sparse_as_dense, policy,
                                     algorithm, horovod_kwargs)
    hvd = _horovod()
    reducer, op = _reducer(hvd, compression, op, gradient_predivide_factor, sparse_as_dense, policy, algorithm,
                           horovod_kwargs)
    tape = hvd.DistributedGradientTape(gradtape, op=op, gradient_predivide_factor=gradient_predivide_factor,
                                       sparse_as_dense=sparse_as_dense, **horovod_kwargs)
    tape._allreduce_grads = reducer
    return tape


@do_not_convert
def PartialDistributedGradientTape(gradtape, *args, local_layers=None, **kwargs):
    """Horovod's `hvd.PartialDistributedGradientTape`: DistributedGradientTape's (arguments as
    there), the gradients of `local_layers` (Keras layers) kept local, as Horovod keeps them."""
    tape = DistributedGradientTape(gradtape, *args, **kwargs)
    if not hasattr(tape, "register_local_source"):
        raise ConfigError("local_layers need Horovod's tape (horovod built with TensorFlow); without it "
                          "commlib.tensorflow reduces every gradient: use DistributedGradientTape")
    for variable in local_variables(local_layers):
        tape.register_local_source(variable)
    return tape


def local_variables(local_layers):
    """The trainable variables of Horovod's `local_layers` argument (a layer, layers, or None)."""
    import tensorflow as tf
    if local_layers is None:
        return []
    if isinstance(local_layers, tf.keras.layers.Layer):
        local_layers = [local_layers]
    if not all(isinstance(layer, tf.keras.layers.Layer) for layer in local_layers):
        raise ValueError("All local layers must be of tf.keras.layers.Layer type.")   # Horovod's words
    return [variable for layer in local_layers for variable in layer.trainable_weights]


@do_not_convert
def DistributedOptimizer(optimizer, compression=None, op=None, gradient_predivide_factor=1.0,
                         sparse_as_dense=False, backward_passes_per_step=1, policy=None, algorithm=None,
                         **horovod_kwargs):
    """Horovod's `hvd.DistributedOptimizer(optimizer, ...)` (a tf.compat.v1 optimizer or a Keras 2
    one), its gradients reduced by commlib; arguments as DistributedGradientTape's."""
    return distributed_optimizer(_horovod().DistributedOptimizer, optimizer, compression, op,
                                 gradient_predivide_factor, sparse_as_dense, backward_passes_per_step, policy,
                                 algorithm, horovod_kwargs)


def distributed_optimizer(horovod_factory, optimizer, compression, op, gradient_predivide_factor, sparse_as_dense,
                          backward_passes_per_step, policy, algorithm, horovod_kwargs):
    """The optimizer Horovod's `horovod_factory` (its TF or its Keras DistributedOptimizer) returns,
    its gradients reduced by commlib."""
    reducer, op = _reducer(_horovod(), compression, op, gradient_predivide_factor, sparse_as_dense, policy, algorithm,
                           horovod_kwargs)
    opt = horovod_factory(optimizer, op=op, gradient_predivide_factor=gradient_predivide_factor,
                          sparse_as_dense=sparse_as_dense, backward_passes_per_step=backward_passes_per_step,
                          **horovod_kwargs)
    if type(opt).__bases__ == (type(optimizer),):   # Keras: a class Horovod made for this optimizer alone
        _copies_install(type(opt), reducer)
    return install(opt, reducer)


def _copies_install(cls, reducer):
    """Keras copies an optimizer with from_config (clone_model, restoring), which runs Horovod's
    __init__ again and with it Horovod's own allreduce: the copies of this class get the reducer too."""
    init = cls.__init__

    def __init__(self, **kwargs):
        init(self, **kwargs)
        install(self, reducer)
    cls.__init__ = __init__


def install(horovod_object, reducer):
    """Make Horovod's optimizer or tape reduce through `reducer`. Its aggregation helper
    (backward_passes_per_step > 1) captured the allreduce function when it was built, so it is
    re-pointed too (the eager helper calls it `allreduce_grads`, the graph one `_allreduce_grads`)."""
    horovod_object._allreduce_grads = reducer
    helper = getattr(horovod_object, "_agg_helper", None)
    if helper is not None:
        for attribute in ("allreduce_grads", "_allreduce_grads"):
            if hasattr(helper, attribute):
                setattr(helper, attribute, reducer)
    return horovod_object


def _reducer(hvd, compression, op, gradient_predivide_factor, sparse_as_dense, policy, algorithm, horovod_kwargs):
    """Check what commlib can honor (clear errors for the rest) and build the reducer."""
    if not hvd.is_initialized():
        raise commlib.CommError("call hvd.init() before commlib.tensorflow's DistributedGradientTape/Optimizer")
    op = horovod_options.check(hvd, op, horovod_kwargs)
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ConfigError("gradient_predivide_factor only applies with op=hvd.Average (as in Horovod)")
    for device in ("device_dense", "device_sparse"):
        if horovod_kwargs.get(device):
            raise ConfigError(f"{device}= places Horovod's ops; commlib reduces on the host, so leave it unset")
    if compression is None or compression is hvd.Compression.none:
        compression = None
    elif compression is hvd.Compression.fp16:
        compression = "fp16"
    if isinstance(policy, str):
        policy = Policy.parse(policy)
    commlib.init()
    return GradientReducer(op == hvd.Average, gradient_predivide_factor, compression, policy, algorithm,
                           sparse_as_dense, horovod_kwargs.get("process_set")), op


def _tape_without_horovod(gradtape, compression, op, predivide, sparse_as_dense, policy, algorithm, horovod_kwargs):
    if horovod_kwargs:
        raise ConfigError(f"{', '.join(sorted(horovod_kwargs))}: Horovod's options, and Horovod's TF ops are not "
                          f"installed here; commlib.tensorflow without Horovod takes op, compression, "
                          f"gradient_predivide_factor, sparse_as_dense, policy and algorithm")
    op = commlib.Average if op is None else op
    if op not in (commlib.Average, commlib.Sum):
        raise ConfigError(f"without Horovod, commlib.tensorflow reduces with op=commlib.Average or commlib.Sum, "
                          f"not {op!r}")
    if predivide != 1.0 and op != commlib.Average:
        raise ConfigError("gradient_predivide_factor only applies with op=commlib.Average")
    if isinstance(policy, str):
        policy = Policy.parse(policy)
    commlib.init()
    reducer = GradientReducer(op == commlib.Average, predivide, compression, policy, algorithm, sparse_as_dense)
    return CommlibGradientTape(gradtape, reducer)


def _horovod_available():
    try:
        _horovod()
        return True
    except BackendUnavailable:
        return False


def _horovod():
    try:
        import horovod.tensorflow as hvd
    except Exception as exc:   # absent (ImportError), or built against another TF (its ops fail to load)
        raise BackendUnavailable(f"commlib.tensorflow's Horovod objects need horovod built with TensorFlow "
                                 f"({exc}); run `make install`, or use commlib.keras without Horovod") from exc
    return hvd

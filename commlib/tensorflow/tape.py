"""A distributed GradientTape without Horovod (TF >= 2.16, where Horovod's TF ops do not build):
the wrapped tape's gradient(), then commlib's reduction of all of them at once."""
import tensorflow as tf


class CommlibGradientTape:
    """What commlib.tensorflow.DistributedGradientTape returns when Horovod's TF ops are absent.
    Everything but gradient() is the wrapped tape's."""

    def __init__(self, tape, reducer):
        self._tape, self._reducer = tape, reducer

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        flat = tf.nest.flatten(sources)
        grads = self._tape.gradient(target, flat, output_gradients, unconnected_gradients)
        return tf.nest.pack_sequence_as(sources, self._reducer(grads, flat))

    def __enter__(self):   # `with DistributedGradientTape(tf.GradientTape()) as tape:`, as Horovod's
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._tape, name)

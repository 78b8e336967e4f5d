"""tf.keras (TF 2.15) model.fit with Horovod's callbacks; commlib does the communication.

    horovodrun -np 4 -H localhost:4 --gloo python examples/tf_keras_fit.py

`auto` measures each gradient's block density: sparse ones go to OmniReduce, dense ones to the
SwitchML software switch (commlib starts it when all ranks are local), else the ring.
"""
import argparse

import numpy as np
import tensorflow as tf

import horovod.tensorflow.keras as hvd
import commlib
import commlib.tensorflow.keras as cl

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=5)
args = parser.parse_args()

hvd.init()
commlib.init(policy="*=auto")

rng = np.random.default_rng(hvd.rank())   # each worker its own shard
x = rng.normal(size=(2048, 20)).astype("float32")
y = (x @ np.linspace(-1, 1, 20, dtype="float32")[:, None] + 0.1 * rng.normal(size=(2048, 1))).astype("float32")

model = tf.keras.Sequential([tf.keras.Input((20,)), tf.keras.layers.Dense(64, activation="relu"),
                             tf.keras.layers.Dense(1)])
lr = 0.01 * hvd.size()   # scale the learning rate by the number of workers, warm it up over the first epoch
model.compile(optimizer=cl.DistributedOptimizer(tf.keras.optimizers.SGD(lr)), loss="mse")
callbacks = [cl.BroadcastGlobalVariablesCallback(0),   # rank 0's initial weights everywhere
             cl.MetricAverageCallback(),               # logged metrics averaged over the workers
             # momentum_correction=False: Horovod 0.28.1 cannot set the momentum of Keras 2.11+ optimizers
             cl.LearningRateWarmupCallback(initial_lr=lr, warmup_epochs=1, momentum_correction=False)]
history = model.fit(x, y, batch_size=64, epochs=args.epochs, callbacks=callbacks, verbose=0)
if hvd.rank() == 0:
    print("loss per epoch:", " ".join(f"{v:.4f}" for v in history.history["loss"]))
    print("algorithms:", sorted({r["algorithm"] for r in commlib.records().values()}))
commlib.shutdown()

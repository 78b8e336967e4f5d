"""TF2 + Horovod with a GradientTape; commlib does the communication.

    horovodrun -np 4 -H localhost:4 --gloo python examples/tf_gradient_tape.py

The policy sends the embedding's (sparse, IndexedSlices) gradient to OmniReduce and the dense
layers' through the SwitchML software switch, which commlib starts by itself when all ranks are
local.
"""
import argparse

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
import commlib
import commlib.tensorflow as cl

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
args = parser.parse_args()

hvd.init()
commlib.init(policy="embedding/*=omnireduce;*=switchml")

tf.keras.utils.set_random_seed(hvd.rank())   # different starts: the broadcast below fixes that
model = tf.keras.Sequential([tf.keras.Input((8,), dtype="int32"), tf.keras.layers.Embedding(1000, 32),
                             tf.keras.layers.GlobalAveragePooling1D(), tf.keras.layers.Dense(64, activation="relu"),
                             tf.keras.layers.Dense(1)])
opt = tf.keras.optimizers.Adam(0.01)
rng = np.random.default_rng(hvd.rank())           # each worker its own data
true_scores = np.linspace(-1, 1, 1000).astype("float32")


@tf.function
def train_step(tokens, target):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(tokens) - target))
    tape = cl.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss


for step in range(args.steps):
    tokens = rng.integers(0, 1000, (64, 8))
    target = true_scores[tokens].sum(axis=1, keepdims=True)
    loss = train_step(tf.constant(tokens, tf.int32), tf.constant(target))
    if step == 0:   # after the first step, when the optimizer's variables exist: rank 0's everywhere
        cl.broadcast_variables(model.variables, root_rank=0)
        cl.broadcast_variables(opt.variables, root_rank=0)
    if hvd.rank() == 0 and (step % 20 == 0 or step == args.steps - 1):
        print(f"step {step} loss {float(loss):.4f}", flush=True)

if hvd.rank() == 0:
    print("algorithms:", sorted({(name, r["algorithm"]) for name, r in commlib.records().items()}))
commlib.shutdown()

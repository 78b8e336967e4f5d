"""Keras 3 (TF >= 2.16, or the torch backend) model.fit without Horovod; commlib does the communication.

    mpirun -np 4 python examples/keras3_fit.py                            # ring through mpi4py
    KERAS_BACKEND=torch torchrun --nproc-per-node 4 examples/keras3_fit.py   # ring through torch.distributed

(with `.venv-keras3/bin/python`, which `make install` builds). The policy sends every gradient
through the SwitchML software switch, which commlib starts by itself when all ranks are local.
"""
import argparse

import numpy as np

import commlib
import commlib.keras

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=5)
args = parser.parse_args()

commlib.init(policy="*=switchml")   # rank and size from mpirun / torchrun
import keras  # noqa: E402  after commlib.init, so that MPI / torch.distributed are up first

rng = np.random.default_rng(commlib.rank())   # each worker its own shard
x = rng.normal(size=(2048, 20)).astype("float32")
y = (x @ np.linspace(-1, 1, 20, dtype="float32")[:, None] + 0.1 * rng.normal(size=(2048, 1))).astype("float32")

model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)])
optimizer = commlib.keras.DistributedOptimizer(keras.optimizers.SGD(0.01 * commlib.size()))
model.compile(optimizer=optimizer, loss="mse", jit_compile=False)   # XLA cannot call back into commlib
commlib.keras.broadcast_variables(model.variables, root_rank=0)    # rank 0's initial weights everywhere
history = model.fit(x, y, batch_size=64, epochs=args.epochs, verbose=0)
if commlib.rank() == 0:
    print("loss per epoch:", " ".join(f"{v:.4f}" for v in history.history["loss"]))
    print("algorithms:", sorted({r["algorithm"] for r in commlib.records().values()}))
commlib.shutdown()

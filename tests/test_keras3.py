"""Keras 3 (TF 2.21, no Horovod) through commlib.keras, in the second environment `.venv-keras3`
that `make install` builds: 2-rank model.fit equals the single-process large-batch fit, under
mpirun (ring through mpi4py) and torchrun (torch.distributed), with the TensorFlow and the torch
backends of Keras 3. The ranks run the .venv-keras3 python; this file runs in the main suite."""
import re
import subprocess

import pytest

from launch import ROOT, WORKERS, _env, _run, free_port

KERAS3_BIN = ROOT / ".venv-keras3" / "bin"
pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(not (KERAS3_BIN / "python").exists(),
                                 reason=".venv-keras3 is not built here: `make keras3` (part of `make install`, "
                                        "so CI has it) builds it")]
SCRIPT = str(WORKERS / "keras3_fit.py")


def _mpirun(script, *args, env=None, timeout=240):
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "PYTHONUNBUFFERED",
           "-x", "OMP_NUM_THREADS", *[a for k in (env or {}) for a in ("-x", k)],
           str(KERAS3_BIN / "python"), str(script), *map(str, args)]
    return _run(cmd, timeout, _env(env))


def _torchrun(*args, env=None, timeout=240):
    cmd = [str(KERAS3_BIN / "torchrun"), "--nproc-per-node", "2", "--master-port", str(free_port()), SCRIPT,
           *map(str, args)]
    return _run(cmd, timeout, _env(env))


def _ok(out, backend, algorithm):
    assert out.returncode == 0 and out.stdout.count("KERAS3-OK") == 2, out.stdout
    assert f"backend {backend}" in out.stdout and f"'{algorithm}'" in out.stdout, out.stdout


def test_fit_under_mpirun_matches_single_process_large_batch():
    _ok(_mpirun(SCRIPT, "*=ring", 1e-5, env={"KERAS_BACKEND": "tensorflow"}), "tensorflow", "ring")


def test_fit_through_switchml_under_torchrun():
    _ok(_torchrun("*=switchml", 1e-4, env={"KERAS_BACKEND": "tensorflow"}), "tensorflow", "switchml")


@pytest.mark.long
def test_fit_with_the_torch_backend_of_keras3():
    _ok(_torchrun("*=ring", 1e-5, env={"KERAS_BACKEND": "torch"}), "torch", "ring")


@pytest.mark.long
def test_example_keras3_fit_trains():
    out = _mpirun(ROOT / "examples" / "keras3_fit.py", "--epochs", 3)
    assert out.returncode == 0, out.stdout
    losses = [float(v) for v in re.search(r"loss per epoch: ([\d. ]+)", out.stdout).group(1).split()]
    assert len(losses) == 3 and losses[-1] < 0.5 * losses[0] and "switchml" in out.stdout, out.stdout


@pytest.mark.long
def test_gradient_tape_without_horovod_on_tf_2_21():
    """commlib.tensorflow.DistributedGradientTape in a tf.function where Horovod is not installed."""
    _ok(_mpirun(SCRIPT, "*=ring", 1e-5, "tape", env={"KERAS_BACKEND": "tensorflow"}), "tensorflow", "ring")


TAPE_IN_FUNCTION = """
import tensorflow as tf
import commlib, commlib.tensorflow as cl
v = tf.Variable(1.0)

@tf.function
def step():
    with tf.GradientTape() as tape:
        loss = v * v
    return cl.DistributedGradientTape(tape).gradient(loss, [v])[0]   # starts commlib (one rank)

print("gradient", float(step()))
commlib.shutdown()
"""


def test_tape_built_inside_tf_function_is_not_traced_by_autograph(tmp_path):
    """The tape's constructor is Python set-up (it starts commlib, which imports modules): AutoGraph
    must not convert it, or it warns that it "could not transform _gcd_import". (A script in a file:
    AutoGraph converts only functions whose source it can read.)"""
    script = tmp_path / "tape_in_function.py"
    script.write_text(TAPE_IN_FUNCTION)
    env = {k: v for k, v in _env(None).items() if k not in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK")}
    out = subprocess.run([str(KERAS3_BIN / "python"), str(script)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and "gradient 2.0" in out.stdout, out.stdout + out.stderr
    assert "could not transform" not in out.stderr, out.stderr

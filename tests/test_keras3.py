"""Keras 3 (TF 2.21, no Horovod) through commlib.keras, in the second environment `.venv-keras3`
that `make install` builds: 2-rank model.fit equals the single-process large-batch fit, under
mpirun (ring through mpi4py) and torchrun (torch.distributed), with the TensorFlow and the torch
backends of Keras 3. The ranks run the .venv-keras3 python; this file runs in the main suite."""
import re
import subprocess

import pytest

from commlib.testing import results
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


def check(out, backend, algorithm, tolerance):
    """tests/workers/keras3_fit.py: each rank's weights the same as the others' and within
    `tolerance` (relative) of the single-process fit, through `algorithm`; what commlib cannot
    honor refused with a ConfigError."""
    assert out.returncode == 0, out.stdout
    for r in results(out.stdout, 2):
        assert r["backend"] == backend and algorithm in r["algorithms"], r
        assert r["same_on_all_ranks"], f"rank {r['rank']}: the ranks' weights differ after the fit"
        diff = r["relative_diff"]
        assert diff <= tolerance, f"rank {r['rank']}: the 2-rank fit is {diff:.3g} (relative) from the single-process one"
        for label, error in r["unsupported"].items():
            assert error and error.startswith("ConfigError"), (r["rank"], label, error)
        for label in ("op", "predivide with Sum"):
            error = r["unsupported"][label]
            assert "commlib" in error or "gradient_predivide_factor" in error, (r["rank"], label, error)
        assert r["broadcast"] == [1.0, 2.0, 3.0], f"rank {r['rank']}: broadcast_variables gave {r['broadcast']}"
    return r


@pytest.mark.long   # a variant: mpirun where torchrun stays
def test_fit_under_mpirun_matches_single_process_large_batch():
    check(_mpirun(SCRIPT, "*=ring", env={"KERAS_BACKEND": "tensorflow"}), "tensorflow", "ring", 1e-5)


def test_fit_through_switchml_under_torchrun():
    check(_torchrun("*=switchml", env={"KERAS_BACKEND": "tensorflow"}), "tensorflow", "switchml", 1e-4)


def test_mixed_precision_fit_skips_an_overflow_on_one_rank_on_every_rank():
    """mixed_float16: commlib's optimizer is the LossScaleOptimizer's own (the gradients are reduced
    before the finiteness check), so a step that overflows on rank 0 only is skipped on both ranks, as
    on rank 1 too (before: rank 1 applied it alone, the ranks' steps paired wrongly, and the job ended
    in a Mismatch). Only the ranks' agreement is checked: the single-process fit scales a loss averaged
    over twice the rows, so it overflows on other steps."""
    check(_torchrun("*=ring", "mixed", env={"KERAS_BACKEND": "tensorflow"}), "tensorflow", "ring", float("inf"))


@pytest.mark.long
def test_fit_with_the_torch_backend_of_keras3():
    check(_torchrun("*=ring", env={"KERAS_BACKEND": "torch"}), "torch", "ring", 1e-5)


@pytest.mark.long
def test_example_keras3_fit_trains():
    out = _mpirun(ROOT / "examples" / "keras3_fit.py", "--epochs", 3)
    assert out.returncode == 0, out.stdout
    losses = [float(v) for v in re.search(r"loss per epoch: ([\d. ]+)", out.stdout).group(1).split()]
    assert len(losses) == 3 and losses[-1] < 0.5 * losses[0] and "switchml" in out.stdout, out.stdout


@pytest.mark.long
def test_gradient_tape_without_horovod_on_tf_2_21():
    """commlib.tensorflow.DistributedGradientTape in a tf.function where Horovod is not installed."""
    r = check(_mpirun(SCRIPT, "*=ring", "tape", env={"KERAS_BACKEND": "tensorflow"}), "tensorflow", "ring", 1e-5)
    assert "groups" in r["unsupported"] and "Horovod" in r["unsupported"]["groups"], r["unsupported"]


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

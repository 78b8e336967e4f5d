"""commlib.tensorflow (TF 2.15 through Horovod's own TF objects) inside real horovodrun / mpirun jobs.

Each worker trains with commlib's object and with Horovod's own from the same start and checks, on
every rank, that the parameters agree across ranks and with Horovod's (1e-6 relative for ring and
omnireduce, the quantization bound for switchml, the compressor's error for fp16 / PowerSGD)."""
import re

import horovod.tensorflow  # noqa: F401  built by `make install`: without it the suite fails, never skips
import pytest

from launch import ROOT, horovodrun, mpirun

pytestmark = pytest.mark.multiprocess
EXAMPLES = ROOT / "examples"


def _ok(out, marker, ranks):
    assert out.returncode == 0 and out.stdout.count(marker) == ranks, out.stdout
    return out.stdout


def test_gradient_tape_eager_matches_horovod():
    _ok(horovodrun(2, "tf_training.py", "tape-eager", "*=ring", 1e-6, timeout=240), "TF-OK", 2)


def test_gradient_tape_in_tf_function_matches_horovod_on_4_ranks():
    _ok(horovodrun(4, "tf_training.py", "tape-function", "*=ring", 1e-6, "none", "predivide=2", timeout=300), "TF-OK", 4)


def test_keras_optimizer_sum_and_several_backward_passes():
    """On Horovod's own TF ring (the horovod_tensorflow engine) rather than commlib's Gloo ring."""
    _ok(horovodrun(2, "tf_training.py", "optimizer", "*=ring", 1e-6, "none", "op=sum,passes=2", timeout=240,
                   env={"COMMLIB_RING_ENGINE": "horovod_tensorflow"}), "TF-OK", 2)


def test_switchml_within_quantization_bound():
    out = _ok(horovodrun(2, "tf_training.py", "tape-function", "*=switchml", 1e-4, timeout=240),
              "TF-OK", 2)
    assert "'switchml'" in out, out


@pytest.mark.parametrize("compression, tolerance", [("hvd.fp16", 2e-3), ("powersgd(rank=4)", 0.1)])
def test_compression_within_its_error(compression, tolerance):
    out = _ok(horovodrun(2, "tf_training.py", "tape-function", "*=ring", tolerance, compression, timeout=240), "TF-OK", 2)
    assert ("fp16" if "fp16" in compression else "powersgd") in out, out


@pytest.mark.parametrize("sparse_as_dense", ["0", "1"])
def test_embedding_indexed_slices_take_the_sparse_path(sparse_as_dense):
    """IndexedSlices reach omnireduce (exact) and come back as IndexedSlices (dense with sparse_as_dense),
    eagerly and in tf.function."""
    _ok(horovodrun(2, "tf_training.py", "embedding", "embedding*=omnireduce;*=ring", 1e-6, "none",
                   f"sparse_as_dense={sparse_as_dense}", timeout=300), "TF-OK", 2)


def test_under_mpirun_with_the_mpi4py_ring():
    out = _ok(mpirun(2, "tf_training.py", "tape-function", "*=ring", 1e-6, timeout=240), "TF-OK", 2)
    assert "'ring'" in out, out


def test_keras_fit_with_horovod_callbacks_matches_horovod():
    _ok(horovodrun(2, "tf_keras_fit.py", "*=ring", 1e-6, timeout=240), "FIT-OK", 2)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_shape_mismatch_is_a_commlib_error_on_every_rank(mode):
    _ok(horovodrun(2, "tf_mismatch.py", mode, timeout=120), "TF-MISMATCH-OK", 2)


def test_example_gradient_tape_trains_through_omnireduce_and_switchml():
    out = _ok(horovodrun(2, str(EXAMPLES / "tf_gradient_tape.py"), "--steps", 60, timeout=300),
              "algorithms:", 1)
    losses = [float(v) for v in re.findall(r"step \d+ loss ([\d.]+)", out)]
    assert len(losses) >= 3 and losses[-1] < 0.5 * losses[0], out
    assert "'embedding/embeddings', 'omnireduce'" in out and "'dense/kernel', 'switchml'" in out, out


def test_example_keras_fit_with_callbacks_trains():
    out = _ok(horovodrun(2, str(EXAMPLES / "tf_keras_fit.py"), "--epochs", 3, timeout=300),
              "algorithms:", 1)
    losses = [float(v) for v in re.search(r"loss per epoch: ([\d. ]+)", out).group(1).split()]
    assert len(losses) == 3 and losses[-1] < 0.5 * losses[0], out

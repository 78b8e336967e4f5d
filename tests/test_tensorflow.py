"""commlib.tensorflow (TF 2.15 through Horovod's own TF objects) inside real horovodrun / mpirun jobs.

Each worker trains with commlib's object and with Horovod's own from the same start and checks, on
every rank, that the parameters agree across ranks and with Horovod's (1e-6 relative for ring and
omnireduce, the quantization bound for switchml, the compressor's error for fp16 / PowerSGD)."""
import re

import horovod.tensorflow  # noqa: F401  built by `make install`: without it the suite fails, never skips
import pytest

from commlib.testing import results
from launch import ROOT, horovodrun, mpirun

pytestmark = pytest.mark.multiprocess
EXAMPLES = ROOT / "examples"


def check_training(out, size, tolerance, algorithm=None):
    """tests/workers/tf_training.py: the same parameters on every rank, Horovod's within tolerance."""
    assert out.returncode == 0, out.stdout
    reports = results(out.stdout, size)
    for result in reports:
        assert result["same_on_all_ranks"] and result["trained"], result
        assert result["relative_diff_vs_horovod"] <= tolerance, result
        for label, error in result["unsupported"].items():
            assert error and error.startswith("ConfigError") and "commlib" in error, (label, error)
        assert algorithm is None or any(algorithm in f"{alg}:{comp}" for _, alg, comp in result["records"]), result
    return reports


def test_gradient_tape_eager_matches_horovod():
    check_training(horovodrun(2, "tf_training.py", "tape-eager", "*=ring", timeout=240), 2, 1e-6, "ring:None")


@pytest.mark.long
def test_gradient_tape_in_tf_function_matches_horovod_on_4_ranks():
    out = horovodrun(4, "tf_training.py", "tape-function", "*=ring", "none", "predivide=2", timeout=300)
    check_training(out, 4, 1e-6, "ring:None")


def test_keras_optimizer_sum_and_several_backward_passes():
    """On Horovod's own TF ring (the horovod_tensorflow engine) rather than commlib's Gloo ring."""
    out = horovodrun(2, "tf_training.py", "optimizer", "*=ring", "none", "op=sum,passes=2", timeout=240,
                     env={"COMMLIB_RING_ENGINE": "horovod_tensorflow"})
    check_training(out, 2, 1e-6, "ring:None")


@pytest.mark.long   # the same bound through torch: test_horovod.py's switchml_optimizer_within_quantization_bound
def test_switchml_within_quantization_bound():
    out = horovodrun(2, "tf_training.py", "tape-function", "*=switchml", timeout=240)
    check_training(out, 2, 1e-4, "switchml:None")


@pytest.mark.parametrize("compression, tolerance", [("hvd.fp16", 2e-3),
                                                          pytest.param("powersgd(rank=4)", 0.1, marks=pytest.mark.long)])
def test_compression_within_its_error(compression, tolerance):
    out = horovodrun(2, "tf_training.py", "tape-function", "*=ring", compression, timeout=240)
    check_training(out, 2, tolerance, "ring:fp16" if "fp16" in compression else "ring:powersgd")


@pytest.mark.parametrize("sparse_as_dense", ["0", pytest.param("1", marks=pytest.mark.long)])
def test_embedding_indexed_slices_take_the_sparse_path(sparse_as_dense):
    """IndexedSlices reach omnireduce as rows (exact; densified first with sparse_as_dense) and come back
    as IndexedSlices (dense with sparse_as_dense), eagerly and in tf.function."""
    out = horovodrun(2, "tf_training.py", "embedding", "embedding*=omnireduce;*=ring", "none",
                     f"sparse_as_dense={sparse_as_dense}", timeout=300)
    for result in check_training(out, 2, 1e-6):
        assert result["embedding_gradient_type"] == ("EagerTensor" if sparse_as_dense == "1" else "IndexedSlices")
        # Eager and tf.function run different kernels (fusion, reduction order), so the two models agree to
        # float32 rounding, not bit for bit: one ulp is 1.2e-7 of a value, and 4 steps of a few ops each
        # stay well inside 1e-6 of the largest parameter (seen: 7e-9). A gradient lost or reduced on one
        # path only moves the parameters by ~1e-2.
        assert result["eager_vs_function"] <= 1e-6, result
        rows = result["embedding_rows"]
        assert rows and all((r is None) == (sparse_as_dense == "1") for r in rows), result
        assert any(name.startswith("embedding") and alg == "omnireduce" for name, alg, _ in result["records"]), result


@pytest.mark.long
def test_under_mpirun_with_the_mpi4py_ring():
    check_training(mpirun(2, "tf_training.py", "tape-function", "*=ring", timeout=240), 2, 1e-6, "ring:None")


def test_keras_fit_with_horovod_callbacks_matches_horovod():
    out = horovodrun(2, "tf_keras_fit.py", "*=ring", timeout=240)
    assert out.returncode == 0, out.stdout
    for result in results(out.stdout, 2):
        assert result["same_on_all_ranks"] and result["relative_diff_vs_horovod"] <= 1e-6, result
        assert len(set(result["losses"])) == 1, f"MetricAverageCallback: ranks logged different losses {result}"
        assert result["algorithms"] == ["ring"], result


@pytest.mark.long
def test_what_horovod_users_write_beside_the_plain_tape():
    """tests/workers/tf_dropin.py: 0-d gradients, a watched eager tensor, a rank outside the tape's
    process set (its local gradient, as Horovod's), the Partial tape and optimizer equal to
    Horovod's own, and a from_config copy of the optimizer still on commlib."""
    out = horovodrun(2, "tf_dropin.py", timeout=240)
    assert out.returncode == 0, out.stdout
    for result in results(out.stdout, 2):
        local = 2.0 * (result["rank"] + 1)
        assert result["scalar eager"] == result["scalar function"] == 3.0, result
        assert result["scalar outside the set"] == local, f"rank {result['rank']}: not its local gradient {result}"
        assert result["watched tensor"] == [3.0], result
        assert result["partial tape vs horovod"] <= 1e-6 and result["partial optimizer vs horovod"] <= 1e-6, result
        assert result["copy reduces through commlib"], result
        assert "grad_0" in result["records"] and ("scalar2" in result["records"]) == (result["rank"] == 0), result
        assert result["horovods own"] == ["init", "allreduce", "alltoall", "reducescatter", "broadcast_variables"], result
        assert result["loaded model reduces through commlib"], result
        assert result["keras names horovod's"] == ["Compression", "allreduce", "elastic", "callbacks"], result
    assert "could not transform" not in out.stdout, out.stdout


@pytest.mark.parametrize("mode", ["eager", pytest.param("function", marks=pytest.mark.long)])
def test_shape_mismatch_is_a_commlib_error_on_every_rank(mode):
    out = horovodrun(2, "tf_mismatch.py", mode, timeout=120)
    assert out.returncode == 0, out.stdout
    for result in results(out.stdout, 2):
        # in a graph TF wraps the error raised in tf.numpy_function (UnknownError) but keeps commlib's message
        assert result["error"] == "Mismatch" if mode == "eager" else "Mismatch" in result["message"], result
        assert "ranks disagree on shape: rank 0 gave [3, 4]; rank 1 gave [3, 5]" in result["message"], result
        assert result["elapsed_s"] < 30.0, result


def _example(out):
    assert out.returncode == 0 and out.stdout.count("algorithms:") == 1, out.stdout
    return out.stdout


@pytest.mark.long
def test_example_gradient_tape_trains_through_omnireduce_and_switchml():
    out = _example(horovodrun(2, str(EXAMPLES / "tf_gradient_tape.py"), "--steps", 60, timeout=300))
    losses = [float(v) for v in re.findall(r"step \d+ loss ([\d.]+)", out)]
    assert len(losses) >= 3 and losses[-1] < 0.5 * losses[0], out
    assert "'embedding/embeddings', 'omnireduce'" in out and "'dense/kernel', 'switchml'" in out, out


@pytest.mark.long
def test_example_keras_fit_with_callbacks_trains():
    out = _example(horovodrun(2, str(EXAMPLES / "tf_keras_fit.py"), "--epochs", 3, timeout=300))
    losses = [float(v) for v in re.search(r"loss per epoch: ([\d. ]+)", out).group(1).split()]
    assert len(losses) == 3 and losses[-1] < 0.5 * losses[0], out

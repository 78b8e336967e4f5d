"""commlib inside real `horovodrun` and `mpirun` jobs (Horovod built from its sdist by `make install`)."""
import re

import horovod.torch  # noqa: F401  built by `make install`: without it the suite fails, never skips
import pytest

from commlib.testing import results
from launch import horovodrun, mpirun
from test_core_multiprocess import check_closed_form

pytestmark = pytest.mark.multiprocess


def check_optimizer(out, size, tolerance, algorithm):
    """tests/workers/torch_optimizer.py: the same parameters everywhere, Horovod's within tolerance."""
    assert out.returncode == 0, out.stdout
    for result in results(out.stdout, size):
        assert result["same_on_all_ranks"], result
        assert result["max_diff_vs_horovod"] <= tolerance, result
        for label, error in result["unsupported"].items():
            assert error and error.startswith("ConfigError") and "commlib" in error, (label, error)
        assert any(algorithm in used for used in result["algorithms"]), result


def test_closed_form_under_horovodrun_gloo():
    out = horovodrun(2, "basic.py", timeout=180)
    assert out.returncode == 0, out.stdout
    check_closed_form(results(out.stdout, 2))


def test_closed_form_under_mpirun_uses_mpi4py():
    out = mpirun(2, "basic.py", timeout=180)
    assert out.returncode == 0, out.stdout
    check_closed_form(results(out.stdout, 2))


def test_rank_that_never_calls_init_is_a_timeout_not_a_hang():
    out = horovodrun(2, "errors.py", "noinit", timeout=90)
    assert out.returncode == 0, out.stdout
    rank0 = results(out.stdout, 2)[0]
    assert rank0["error"] == "CommTimeout" and "commlib.init()" in rank0["message"], rank0
    assert rank0["elapsed_s"] < 4.0 + 3.0, rank0


def test_wrong_shape_under_horovodrun_raises_mismatch_on_every_rank():
    out = horovodrun(4, "errors.py", "mismatch", timeout=120)
    assert out.returncode == 0, out.stdout
    for result in results(out.stdout, 4):
        assert result["error"] == "Mismatch" and "rank 1 gave [5]" in result["message"], result


def test_distributed_optimizer_matches_horovod_on_4_ranks():
    check_optimizer(horovodrun(4, "torch_optimizer.py", "*=ring", timeout=240), 4, 1e-5, "ring:None")


def test_distributed_optimizer_sum_and_several_backward_passes():
    out = horovodrun(2, "torch_optimizer.py", "*=ring", "none", "op=sum,passes=2", timeout=240)
    check_optimizer(out, 2, 1e-5, "ring:None")


@pytest.mark.parametrize("compression, tolerance", [("hvd.fp16", 2e-3), ("fp16", 2e-3), ("powersgd(rank=4)", 0.05)])
def test_distributed_optimizer_with_compression(compression, tolerance):
    out = horovodrun(2, "torch_optimizer.py", "*=ring", compression, timeout=240)
    check_optimizer(out, 2, tolerance, "ring:fp16" if "fp16" in compression else "ring:powersgd")


def test_switchml_optimizer_within_quantization_bound():
    check_optimizer(horovodrun(2, "torch_optimizer.py", "*=switchml", timeout=240), 2, 1e-4, "switchml:None")


def test_demo_trains_through_the_local_switch_and_loss_decreases():
    """`make demo`: 4 workers, no configuration, the embedded switch carries the dense gradients."""
    out = horovodrun(4, "-m commlib.demo", "--steps", "60", timeout=240)
    assert out.returncode == 0, out.stdout
    losses = [float(v) for v in re.findall(r"Iter #\d+: loss ([\d.]+)", out.stdout)]
    assert len(losses) >= 4 and losses[-1] < 0.7 * losses[0], out.stdout
    assert "Total img/sec on 4 CPU(s)" in out.stdout and "Algorithms used: switchml (none)" in out.stdout, out.stdout

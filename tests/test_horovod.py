"""commlib inside real `horovodrun` and `mpirun` jobs (Horovod built from its sdist by `make install`)."""
import re

import horovod.torch  # noqa: F401  built by `make install`: without it the suite fails, never skips
import pytest

from launch import horovodrun, mpirun

pytestmark = pytest.mark.multiprocess


def test_closed_form_under_horovodrun_gloo():
    out = horovodrun(2, "basic.py", timeout=180)
    assert out.returncode == 0 and out.stdout.count("OK ") == 2, out.stdout


def test_closed_form_under_mpirun_uses_mpi4py():
    out = mpirun(2, "basic.py", timeout=180)
    assert out.returncode == 0 and out.stdout.count("OK ") == 2, out.stdout


def test_rank_that_never_calls_init_is_a_timeout_not_a_hang():
    out = horovodrun(2, "errors.py", "noinit", timeout=90)
    assert out.returncode == 0 and out.stdout.count("NOINIT-OK") == 1 and out.stdout.count("NOINIT-DONE") == 2, \
        out.stdout


def test_wrong_shape_under_horovodrun_raises_mismatch_on_every_rank():
    out = horovodrun(4, "errors.py", "mismatch", timeout=120)
    assert out.returncode == 0 and out.stdout.count("MISMATCH-OK") == 4, out.stdout


def test_distributed_optimizer_matches_horovod_on_4_ranks():
    out = horovodrun(4, "torch_optimizer.py", "*=ring", "1e-5", timeout=240)
    assert out.returncode == 0 and out.stdout.count("OPTIMIZER-OK") == 4, out.stdout


def test_distributed_optimizer_sum_and_several_backward_passes():
    out = horovodrun(2, "torch_optimizer.py", "*=ring", "1e-5", "none", "op=sum,passes=2", timeout=240)
    assert out.returncode == 0 and out.stdout.count("OPTIMIZER-OK") == 2, out.stdout


@pytest.mark.parametrize("compression, tolerance", [("hvd.fp16", 2e-3), ("fp16", 2e-3), ("powersgd(rank=4)", 0.05)])
def test_distributed_optimizer_with_compression(compression, tolerance):
    out = horovodrun(2, "torch_optimizer.py", "*=ring", tolerance, compression, timeout=240)
    assert out.returncode == 0 and out.stdout.count("OPTIMIZER-OK") == 2, out.stdout
    assert "fp16" in out.stdout if "fp16" in compression else "powersgd" in out.stdout


def test_switchml_optimizer_within_quantization_bound():
    out = horovodrun(2, "torch_optimizer.py", "*=switchml", "1e-4", timeout=240)
    assert out.returncode == 0 and out.stdout.count("OPTIMIZER-OK") == 2 and "switchml" in out.stdout, out.stdout


def test_demo_trains_through_the_local_switch_and_loss_decreases():
    """`make demo`: 4 workers, no configuration, the embedded switch carries the dense gradients."""
    out = horovodrun(4, "-m commlib.demo", "--steps", "60", timeout=240)
    assert out.returncode == 0, out.stdout
    losses = [float(v) for v in re.findall(r"Iter #\d+: loss ([\d.]+)", out.stdout)]
    assert len(losses) >= 4 and losses[-1] < 0.7 * losses[0], out.stdout
    assert "Total img/sec on 4 CPU(s)" in out.stdout and "Algorithms used: switchml (none)" in out.stdout, out.stdout

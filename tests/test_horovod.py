"""commlib inside real `horovodrun` and `mpirun` jobs (Horovod built from its sdist by `make install`)."""
import json
import re
import subprocess
import sys

import horovod.torch  # noqa: F401  built by `make install`: without it the suite fails, never skips
import pytest

from commlib.testing import results
from launch import horovodrun, mpirun
from helpers import check_closed_form

pytestmark = pytest.mark.multiprocess


def check_optimizer(out, size, tolerance, algorithm, engine="gloo"):
    """tests/workers/torch_optimizer.py: the same parameters everywhere, Horovod's within tolerance;
    the ring's data on commlib's own Gloo ring unless COMMLIB_RING_ENGINE says otherwise."""
    assert out.returncode == 0, out.stdout
    for result in results(out.stdout, size):
        assert result["engine"] == engine, result
        assert result["same_on_all_ranks"], result
        assert result["max_diff_vs_horovod"] <= tolerance, result
        for label, error in result["unsupported"].items():
            assert error and error.startswith("ConfigError") and "commlib" in error, (label, error)
        assert any(algorithm in used for used in result["algorithms"]), result


@pytest.mark.parametrize("engine", ["auto", "horovod"])   # auto: commlib's own Gloo ring
def test_closed_form_under_horovodrun_gloo(engine):
    out = horovodrun(2, "basic.py", timeout=180, env={"COMMLIB_RING_ENGINE": engine})
    assert out.returncode == 0, out.stdout
    check_closed_form(results(out.stdout, 2))


def test_closed_form_under_mpirun_uses_mpi4py():
    out = mpirun(2, "basic.py", timeout=180)
    assert out.returncode == 0, out.stdout
    check_closed_form(results(out.stdout, 2))


@pytest.mark.long
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


@pytest.mark.long
def test_distributed_optimizer_matches_horovod_on_4_ranks():
    check_optimizer(horovodrun(4, "torch_optimizer.py", "*=ring", timeout=240), 4, 1e-5, "ring:None")


def test_distributed_optimizer_sum_and_several_backward_passes():
    out = horovodrun(2, "torch_optimizer.py", "*=ring", "none", "op=sum,passes=2", timeout=240,
                     env={"COMMLIB_RING_ENGINE": "horovod"})   # Horovod's own ring carries the data
    check_optimizer(out, 2, 1e-5, "ring:None", engine="horovod")


@pytest.mark.parametrize("compression, tolerance", [("hvd.fp16", 2e-3), ("fp16", 2e-3),
                                                     pytest.param("powersgd(rank=4)", 0.05, marks=pytest.mark.long)])
def test_distributed_optimizer_with_compression(compression, tolerance):
    out = horovodrun(2, "torch_optimizer.py", "*=ring", compression, timeout=240)
    check_optimizer(out, 2, tolerance, "ring:fp16" if "fp16" in compression else "ring:powersgd")


def test_a_horovod_script_with_its_import_changed_trains_through_commlib():
    """`import commlib.torch as hvd` is the one line a Horovod script changes: its optimizer is commlib's
    (every parameter reduced by commlib), the rest Horovod's own, and it trains as Horovod does."""
    out = horovodrun(2, "horovod_script.py", timeout=240)
    assert out.returncode == 0, out.stdout
    for result in results(out.stdout, 2):
        assert result["size"] == 2 and result["same_on_all_ranks"], result
        assert result["max_diff_vs_horovod"] <= 1e-4, result   # switchml's quantization bound, where auto chose it
        assert result["reduced_by_commlib"] == ["0.bias", "0.weight", "2.bias", "2.weight"], result
        assert result["horovods_own"] == ["init", "rank", "allreduce", "allgather", "broadcast_parameters",
                                          "Compression"], result


def test_switchml_optimizer_within_quantization_bound():
    check_optimizer(horovodrun(2, "torch_optimizer.py", "*=switchml", timeout=240), 2, 1e-4, "switchml:None")


@pytest.mark.long
def test_demo_trains_through_the_local_switch_and_loss_decreases():
    """`make demo`: 4 workers, no configuration; the embedded switch carries dense gradients (kept by
    `auto`, or measured against the ring on the first steps)."""
    out = horovodrun(4, "-m commlib.demo", "--steps", "60", timeout=240)
    assert out.returncode == 0, out.stdout
    losses = [float(v) for v in re.findall(r"Iter #\d+: loss ([\d.]+)", out.stdout)]
    assert len(losses) >= 4 and losses[-1] < 0.7 * losses[0], out.stdout
    assert "Total img/sec on 4 CPU(s)" in out.stdout, out.stdout
    assert re.search(r"Algorithms used: .*switchml|auto measured .*switchml \d", out.stdout), out.stdout


BEFORE_INIT = """
import json, torch, horovod.torch as hvd, commlib.torch as cl
m = torch.nn.Linear(2, 2)
out = {}
for make in (hvd.DistributedOptimizer, cl.DistributedOptimizer):
    for case, params in (("not initialized", list(m.named_parameters())),
                         ("duplicate names", [("a", p) for p in m.parameters()])):
        try:
            make(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=params)
            out[make.__module__ + ": " + case] = "no error"
        except Exception as exc:
            out[make.__module__ + ": " + case] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def test_optimizer_before_hvd_init_raises_horovods_own_error():
    """A script written for Horovod that catches its ValueError keeps working with commlib's optimizer."""
    done = subprocess.run([sys.executable, "-c", BEFORE_INIT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for case in ("not initialized", "duplicate names"):
        theirs, ours = got["horovod.torch.optimizer: " + case], got["commlib.torch: " + case]
        assert ours == theirs and theirs.startswith("ValueError"), (case, ours, theirs)

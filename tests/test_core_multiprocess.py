"""The core across real processes (torch.distributed engine), with a hard timeout per launch. Each
rank reports its result (commlib.testing.report); the checks here say which field differed."""
import pytest

from helpers import check_closed_form
from launch import spawn

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("nprocs", [2, pytest.param(4, marks=pytest.mark.long)])
def test_closed_form_sums_fusion_and_types(nprocs):
    check_closed_form(spawn(nprocs, "basic.py", timeout=120).check().results())


def test_wrong_shape_raises_mismatch_on_every_rank():
    for result in spawn(3, "errors.py", "mismatch", timeout=90).check().results():
        assert result["error"] == "Mismatch" and result["elapsed_s"] < 4.0, result
        assert "'grad.w'" in result["message"] and "shape" in result["message"], result
        assert "rank 1 gave [5]" in result["message"], result


def test_tensor_refused_on_one_rank_fails_every_rank_at_once():
    """With the default 600 s negotiation timeout, the others learn rank 1's reason at once."""
    for result in spawn(3, "errors.py", "refused", timeout=90).check().results():
        assert result["error"] == "InvalidTensor" and result["elapsed_s"] < 5.0, result
        assert "dtype bool cannot be reduced" in result["message"], result
        assert result["rank"] == 1 or "failed on rank 1" in result["message"], result
        assert result["after"] == [3.0] * 4, f"the job should go on after a refused tensor: {result}"
        assert result["everyone"] == "InvalidTensor" and result["again"] == [3.0] * 4, result
        float8 = result["float8"]
        assert float8["error"] == "InvalidTensor" and float8["elapsed_s"] < 5.0, result
        assert "float8_e4m3fn cannot be reduced" in float8["message"], result
        assert result["after_float8"] == [3.0] * 4, f"the job should go on after a refused float8 tensor: {result}"


def test_a_tensor_resized_in_flight_leaves_its_sum_exact():
    results = spawn(n := 3, "errors.py", "resized", timeout=90).check().results()
    for result in results:
        assert result["sums"] == [[float(sum(range(1, n + 1)))]] * 2, f"a sum read freed or changed memory: {result}"
        assert "not resizable" in result["refused"], f"the large tensor's resize was not refused: {result}"


@pytest.mark.long
def test_rank_that_never_calls_times_out_everywhere():
    results = spawn(3, "errors.py", "timeout", timeout=90).check().results()
    assert results[1]["error"] is None, results[1]       # rank 1 slept through it
    for result in (results[0], results[2]):
        assert result["error"] == "CommTimeout" and result["elapsed_s"] < 4.0 + 3.0, result
        assert "'late'" in result["message"] and "not by rank 1" in result["message"], result


@pytest.mark.long
def test_dead_rank_is_a_peer_failure():
    ranks = spawn(3, "errors.py", "dead", timeout=90)
    assert ranks[1].returncode == 3, ranks.output
    for r in (0, 2):
        assert ranks[r].returncode == 0, ranks.output
    results = ranks.results(silent=[1])            # rank 1 died before it could report
    for r in (0, 2):
        assert results[r]["error"] == "PeerFailure" and "rank 1" in results[r]["message"], results[r]


def test_settings_that_differ_between_ranks_fail_init_everywhere():
    for result in spawn(3, "errors.py", "settings", timeout=90).check().results():
        assert result["error"] == "Mismatch" and "fusion_threshold: [4096, 1024, 4096]" in result["message"], result

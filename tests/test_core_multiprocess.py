"""The core across real processes (torch.distributed engine), with a hard timeout per launch."""
import pytest

from launch import spawn

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("nprocs", [2, 4])
def test_closed_form_sums_fusion_and_types(nprocs):
    ranks = spawn(nprocs, "basic.py", timeout=120).check()
    assert all(f"OK {r}" in p.stdout for r, p in enumerate(ranks))
    assert all("fused 0" not in p.stdout for p in ranks), "20 small tensors should have been fused"


def test_wrong_shape_raises_mismatch_on_every_rank():
    ranks = spawn(3, "errors.py", "mismatch", timeout=90).check()
    assert all("MISMATCH-OK" in p.stdout for p in ranks), ranks.output


def test_rank_that_never_calls_times_out_everywhere():
    ranks = spawn(3, "errors.py", "timeout", timeout=90).check()
    assert all("TIMEOUT-OK" in p.stdout for p in ranks), ranks.output


def test_dead_rank_is_a_peer_failure():
    ranks = spawn(3, "errors.py", "dead", timeout=90)
    assert ranks[1].returncode == 3
    for r in (0, 2):
        assert ranks[r].returncode == 0 and "DEAD-OK" in ranks[r].stdout, ranks.output


def test_settings_that_differ_between_ranks_fail_init_everywhere():
    ranks = spawn(3, "errors.py", "settings", timeout=90).check()
    assert all("SETTINGS-OK" in p.stdout for p in ranks), ranks.output

"""OmniReduce through commlib.init() in real processes (torchrun environment), hard timeouts."""
import pytest

from helpers import check_omnireduce_sums
from launch import spawn

import commlib.backends.omnireduce as om   # noqa: E402

if om.lib is None:   # not built: a failure of the suite, never a quiet skip
    raise ImportError(om.IMPORT_ERROR)

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]


@pytest.mark.parametrize("nprocs,mode", [pytest.param(3, "colocated", marks=pytest.mark.long), (2, "dedicated")])
def test_sparse_sums_through_commlib(nprocs, mode):
    check_omnireduce_sums(spawn(nprocs, "omnireduce_worker.py", "sums", mode, timeout=120).check().results())


@pytest.mark.long
def test_dead_rank_fails_the_others_within_the_timeout():
    ranks = spawn(3, "omnireduce_worker.py", "dead", "colocated", timeout=90)
    assert ranks[1].returncode == 3, ranks.output
    results = ranks.results(silent=[1])
    for r in (0, 2):
        assert ranks[r].returncode == 0, ranks.output
        result = results[r]
        assert result["error"] and "rank 1" in result["message"], result
        assert result["elapsed_s"] < result["timeout_s"] + 4.0, result

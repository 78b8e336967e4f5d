"""OmniReduce through commlib.init() in real processes (torchrun environment), hard timeouts."""
import pytest

from launch import spawn

import commlib.backends.omnireduce as om   # noqa: E402

if om.lib is None:   # not built: a failure of the suite, never a quiet skip
    raise ImportError(om.IMPORT_ERROR)

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]


@pytest.mark.parametrize("nprocs,mode", [(3, "colocated"), (2, "dedicated")])
def test_sparse_sums_through_commlib(nprocs, mode):
    ranks = spawn(nprocs, "omnireduce_worker.py", "sums", mode, timeout=120).check()
    assert all(f"OK {r}" in p.stdout for r, p in enumerate(ranks)), ranks.output


def test_dead_rank_fails_the_others_within_the_timeout():
    ranks = spawn(3, "omnireduce_worker.py", "dead", "colocated", timeout=90)
    assert ranks[1].returncode == 3, ranks.output
    for r in (0, 2):
        assert ranks[r].returncode == 0 and "DEAD-OK" in ranks[r].stdout, ranks.output

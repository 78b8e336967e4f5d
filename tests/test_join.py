"""commlib.join (Horovod's hvd.join): ranks whose data runs out at different steps. Each rank's
results are checked against the reduction over the ranks still running that step."""
import pytest

from launch import spawn

pytestmark = pytest.mark.multiprocess


def expected(step, size):
    """tests/workers/join.py: rank r reduces (r + 1) * (step + 1) and runs r + 1 steps."""
    running = [(r + 1) * (step + 1) for r in range(step, size)]
    return {"sums": [float(sum(running))] * 4, "min": float(min(running)), "max": -min(running),
            "average": sum(running) * (1 / size)}   # over the job's size, as Horovod's


@pytest.mark.parametrize("policy", ["*=ring", "default", "w*=omnireduce", "w*=allgather:topk(ratio=1.0)"])
def test_uneven_ranks_join(policy):
    size = 3
    for result in spawn(size, "join.py", policy, timeout=120).check().results():
        for step, got in enumerate(result["steps"]):
            assert got == expected(step, size), (policy, result["rank"], step, got)
        assert result["last"] == size - 1, f"rank {size - 1} joined last: {result}"
        assert result["after"] == [float(size)] * 4, f"a job goes on after every rank joined: {result}"


def test_join_fails_when_a_rank_neither_reduces_nor_joins():
    results = spawn(2, "join.py", "timeout", timeout=60, env={"COMMLIB_NEGOTIATION_TIMEOUT_S": "3"}).check().results()
    assert results[0]["error"] == "CommTimeout" and results[0]["elapsed_s"] < 6, results[0]
    assert "every rank must call commlib.join()" in results[0]["message"], results[0]


def test_sparse_tensor_with_a_joined_rank_is_refused_clearly():
    results = spawn(2, "join.py", "sparse", timeout=60).check().results()
    assert results[0]["error"] is None, results[0]
    assert results[1]["error"].startswith("Mismatch") and "rank 0 joined" in results[1]["error"], results[1]

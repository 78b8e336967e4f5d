"""Process sets (issue 14, item 4): commlib's reduction over a subset of ranks against Horovod's
own with the same process set in the same horovodrun job, through every algorithm."""
import horovod.torch  # noqa: F401  built by `make install`: without it the suite fails, never skips
import pytest

from commlib.testing import results
from launch import horovodrun, mpirun, spawn

pytestmark = pytest.mark.multiprocess

# switchml quantizes (about n^2 * 2^-31 of a block's largest value); ring and omnireduce sum the
# integer-valued test tensors exactly
TOLERANCE = {"ring": 0.0, "omnireduce": 0.0, "switchml": 1e-6}


def check(out, size, algorithm):
    assert out.returncode == 0, out.stdout
    for result in results(out.stdout, size):
        rank = result["rank"]
        labels = [label for label in result["diffs"] if not label.startswith(("all", "own"))]
        assert len(labels) == 2 * 3 * len(result["sets"]), result   # Average and Sum, 3 steps, every set
        for label, diff in result["diffs"].items():
            assert diff <= TOLERANCE[algorithm], (rank, label, diff)
        for label, used in result["algorithms"].items():
            assert used == algorithm, (rank, label, used)
        for name, set_size in result["set_sizes"].items():
            assert set_size == len(name) - 3, (rank, name, set_size)   # "set012" has 3 ranks
        assert result["outside_error"].startswith("ConfigError") and f"rank {rank}" in result["outside_error"] \
            and "not in" in result["outside_error"], result["outside_error"]
        assert result["optimizer_same_in_set"], result
        assert result["optimizer_vs_horovod"] <= (1e-4 if algorithm == "switchml" else 1e-5), result
        if algorithm == "switchml":   # every set registered as its own job (here: on a switch its first rank embeds)
            jobs = [tuple(job[:2]) for job in result["switch"].values()]
            assert len(set(jobs)) == len(jobs) == len(result["sets"]) + 1, result["switch"]
            # a set streams once (the job: from the host's cores, 0): several sets never oversubscribe a host
            assert {name: job[2] for name, job in result["switch"].items()} == \
                {name: 0 if name == "all" else 1 for name in result["switch"]}, result["switch"]
        if algorithm == "omnireduce":   # every set its own aggregators, one colocated in each of its ranks
            everyone = [address for addresses in result["aggregators"].values() for address in addresses]
            assert len(set(everyone)) == len(everyone), result["aggregators"]
            assert {name: len(a) for name, a in result["aggregators"].items()} == \
                dict(result["set_sizes"], all=size), result["aggregators"]


@pytest.mark.parametrize("algorithm", ["ring", pytest.param("switchml", marks=pytest.mark.long),
                                       pytest.param("omnireduce", marks=pytest.mark.long)])
def test_process_sets_match_horovod_on_4_ranks(algorithm):
    """{0,1} and {2,3} at once (disjoint, each with its own controller), {1,2,3} beside them."""
    check(horovodrun(4, "process_sets.py", algorithm, timeout=300), 4, algorithm)


@pytest.mark.parametrize("algorithm", ["ring", "switchml", "omnireduce"])
def test_single_rank_process_sets_on_2_ranks(algorithm):
    check(horovodrun(2, "process_sets.py", algorithm, timeout=240), 2, algorithm)


def test_commlib_init_before_hvd_init_with_process_sets():
    """commlib.init() first leaves Horovod uninitialized, so hvd.init(process_sets=...) still works."""
    check(horovodrun(2, "process_sets.py", "ring", "commlib-first", timeout=240), 2, "ring")


@pytest.mark.long
def test_ring_engine_horovod_reduces_over_horovods_own_process_set():
    out = horovodrun(4, "process_sets.py", "ring", timeout=300, env={"COMMLIB_RING_ENGINE": "horovod"})
    check(out, 4, "ring")


@pytest.mark.parametrize("launcher, engine", [(mpirun, "mpi"), (spawn, "torch")])
def test_commlib_process_sets_without_horovod(launcher, engine):
    """commlib.ProcessSet: MPI's Create_group under mpirun, torch.distributed.new_group under torchrun."""
    out = launcher(4, "process_sets.py", "plain", timeout=180)
    if launcher is spawn:
        found = out.check().results()
    else:
        assert out.returncode == 0, out.stdout
        found = results(out.stdout, 4)
    for result in found:
        rank, members = result["rank"], result["set"]
        assert members == [rank % 2, rank % 2 + 2], result
        assert result["half"] == [float(sum(r + 1 for r in members))] * 8, result
        assert result["all"] == [10.0] * 8 and result["set_rank"] == members.index(rank), result
        assert result["engines"] == [engine, engine], result


@pytest.mark.long
def test_tensorflow_tape_over_a_process_set():
    """commlib.tensorflow.DistributedGradientTape(process_set=) equals Horovod's tape over {0,1}; rank 2 idles."""
    out = horovodrun(3, "process_sets.py", "tf", timeout=240)
    assert out.returncode == 0, out.stdout
    found = results(out.stdout, 3)
    assert [r["included"] for r in found] == [True, True, False], found
    for result in found[:2]:   # d/dv sum((r+1) v^2) averaged over ranks 0 and 1: 3v
        assert result["ours"] == result["horovod"] == [3.0 * i for i in range(6)], result

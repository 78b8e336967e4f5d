"""Issue 27: `dist.init_process_group("commlib")`, in the manner of PyTorch's process-group tests:
every collective x dtype x op against a Gloo group of the same job (tests/workers/c10d.py), Work
semantics, subgroups, DDP with no hook, FSDP2, a mismatch and a missing rank on every rank."""
import pytest

from launch import spawn

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(360)]


def run(nprocs, scenario, *args, **env):
    return spawn(nprocs, "c10d.py", scenario, *args, timeout=300, env=env).check().results()


@pytest.mark.parametrize("nprocs, policy, algorithms", [(2, "*=ring", ["ring"]), (4, "*=auto", ["ring", "switchml"])])
def test_every_collective_dtype_and_op_equals_gloo(nprocs, policy, algorithms):
    """Exact inputs: equal to Gloo's result bit for bit, through the ring or the embedded switch."""
    for result in run(nprocs, "collectives", COMMLIB_POLICY=policy):
        differ = {case: got for case, got in result["allreduce"].items()
                  if not (got["equal"] and got["completed"] and got["waited"] and got["future"])}
        assert not differ, f"rank {result['rank']}: {differ}"
        assert len(result["allreduce"]) == 6 * 5 - 2, result["allreduce"].keys()   # no AVG of integers
        other = result["other"]
        expected = {"all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast"}
        expected |= {"send_recv"} if result["rank"] == nprocs - 1 else set()
        expected |= {"new_group"} if result["rank"] < 2 else set()
        assert set(other) == expected and all(other.values()), f"rank {result['rank']}: {other}"
        assert result["algorithms"] == algorithms, result


def test_ddp_without_a_hook_follows_gloo():
    """DDP's buckets go through the embedded switch (quantized: within float32 rounding here)."""
    for result in run(2, "ddp"):
        assert result["relative_diff"] < 1e-6, result
        assert result["losses"] == pytest.approx(result["gloo_losses"], rel=1e-5), result
        assert result["algorithms"] == ["switchml"], result


def test_fsdp2_trains_as_on_gloo():
    """FSDP2's reduce-scatter and all-gather go through the backend's Gloo group: the same losses."""
    for result in run(2, "fsdp"):
        assert result["losses"] == result["gloo_losses"], result


def test_int8_reduce_scatter_and_all_gather_within_their_stated_bound():
    """COMMLIB_C10D_INT8 opts in: every element within the bound commlib/torch/int8_collectives.py states
    (float32 rounding of the scales and sums aside: 1e-3 of it), and FSDP2 trains within 1e-3 of Gloo."""
    for result in run(2, "int8", COMMLIB_C10D_INT8="reduce_scatter,all_gather"):
        assert set(result["worst_over_bound"]) == {"reduce_scatter/sum", "reduce_scatter/avg", "all_gather"}
        assert all(0 < worst <= 1.001 for worst in result["worst_over_bound"].values()), result
        fsdp = result["fsdp"]
        assert fsdp["losses"] != fsdp["gloo_losses"], "int8 did not reach FSDP2's collectives"
        assert fsdp["losses"] == pytest.approx(fsdp["gloo_losses"], rel=1e-3), fsdp


def test_a_mismatch_is_a_clear_error_on_every_rank_at_once():
    for result in run(2, "mismatch"):
        assert result["error"].startswith("Mismatch: tensor 'allreduce.noname.0': ranks disagree on shape"), result
        assert "rank 0 gave [12]; rank 1 gave [10]" in result["error"], result
        assert result["seconds"] < 10, result


@pytest.mark.long
def test_a_rank_that_never_calls_is_a_timeout_naming_it():
    first, last = run(2, "missing", 8, COMMLIB_NEGOTIATION_TIMEOUT_S="3", COMMLIB_STALL_WARNING_S="1")
    assert first["error"].startswith("CommTimeout: tensor 'allreduce.noname.0' was submitted by rank 0 but not by "
                                     "rank 1 within 3.0s"), first
    assert 3 <= first["seconds"] < 15, first


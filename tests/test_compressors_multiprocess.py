"""Compressors through the real core: 4 processes, commlib.allreduce(x, compression=..., algorithm=...)
on ring (summable payloads), allgather and omnireduce (sparse payloads) equals the in-process
reference of tests/compressor_harness.py; plus a policy rule ('*.weight=allgather:topk(...)')."""
import pytest

from launch import spawn

pytestmark = pytest.mark.multiprocess


def check(cases):
    """Every rank: each case went where expected at every step and equals the reference."""
    for result in spawn(4, "compressed_allreduce.py", "|".join(cases), timeout=240).check().results():
        assert sorted(result["cases"]) == sorted(cases), result
        for case, got in result["cases"].items():
            tolerance = 2e-3 if case.startswith("fp16") else 1e-5
            assert got["algorithms"] == [got["expected"]] * 2, (result["rank"], case, got)
            assert all(isinstance(d, float) and d <= tolerance for d in got["max_diff"]), (result["rank"], case, got)
        policy = result["policy"]
        assert policy["record"]["algorithm"] == "allgather" and "topk" in policy["record"]["compression"], policy
        assert policy["max_diff"] <= 1e-5, policy
        assert result["bucket"]["fused_with"] == [2, 2, 2], f"3 powersgd tensors not fused: {result['bucket']}"
        assert all(d <= 1e-5 for d in result["bucket"]["max_diff"]), result["bucket"]

CASES = ["topk(ratio=0.1)@allgather", "signsgd@allgather", "qsgd@allgather", "threshold(tau=1.5)@allgather",
         "randomk(ratio=0.1)@ring", "fp16@ring", "powersgd(rank=2)@ring", "efsignsgd@allgather"]


def test_compressed_allreduce_four_processes():
    check(CASES)


@pytest.mark.long
def test_every_other_method_four_processes():
    """The methods the cases above leave out: each through the real core equals its reference."""
    cases = ["none@ring", "signum@allgather", "onebit@allgather", "natural@allgather", "terngrad@allgather",
             "adaq@allgather", "inceptionn@allgather", "sketch@allgather", "u8bit@allgather", "dgc@allgather"]
    check(cases)


def test_sparse_payloads_ride_omnireduce():
    """Top-k, threshold and DGC outputs through the sparse collective (decoded to dense, zeros skipped)."""
    cases = ["topk(ratio=0.1)@omnireduce", "threshold(tau=1.5)@omnireduce", "dgc@omnireduce",
             # no algorithm given: sparse payloads prefer omnireduce, gather-only ones allgather, summable the ring
             "topk(ratio=0.1)@auto>omnireduce", "signsgd@auto>allgather", "qsgd@auto>allgather", "fp16@auto>ring"]
    check(cases)

"""Compressors through the real core: 4 processes, commlib.allreduce(x, compression=..., algorithm=...)
on ring (summable payloads), allgather and omnireduce (sparse payloads) equals the in-process
reference of tests/compressor_harness.py; plus a policy rule ('*.weight=allgather:topk(...)')."""
import pytest

from launch import spawn

pytestmark = pytest.mark.multiprocess

CASES = ["topk(ratio=0.1)@allgather", "signsgd@allgather", "qsgd@allgather", "threshold(tau=1.5)@allgather",
         "randomk(ratio=0.1)@ring", "fp16@ring", "powersgd(rank=2)@ring", "efsignsgd@allgather"]


def test_compressed_allreduce_four_processes():
    ranks = spawn(4, "compressed_allreduce.py", "|".join(CASES), timeout=240).check()
    assert all(f"COMPRESSED-OK {r} {len(CASES)}" in p.stdout for r, p in enumerate(ranks)), ranks.output


def test_every_other_method_four_processes():
    """The methods the cases above leave out: each through the real core equals its reference."""
    cases = ["none@ring", "signum@allgather", "onebit@allgather", "natural@allgather", "terngrad@allgather",
             "adaq@allgather", "inceptionn@allgather", "sketch@allgather", "u8bit@allgather", "dgc@allgather"]
    ranks = spawn(4, "compressed_allreduce.py", "|".join(cases), timeout=240).check()
    assert all(f"COMPRESSED-OK {r} {len(cases)}" in p.stdout for r, p in enumerate(ranks)), ranks.output


def test_sparse_payloads_ride_omnireduce():
    """Top-k, threshold and DGC outputs through the sparse collective (decoded to dense, zeros skipped)."""
    cases = ["topk(ratio=0.1)@omnireduce", "threshold(tau=1.5)@omnireduce", "dgc@omnireduce",
             # no algorithm given: sparse payloads prefer omnireduce, gather-only ones allgather, summable the ring
             "topk(ratio=0.1)@auto>omnireduce", "signsgd@auto>allgather", "qsgd@auto>allgather", "fp16@auto>ring"]
    ranks = spawn(4, "compressed_allreduce.py", "|".join(cases), timeout=240).check()
    assert all(f"COMPRESSED-OK {r} {len(cases)}" in p.stdout for r, p in enumerate(ranks)), ranks.output

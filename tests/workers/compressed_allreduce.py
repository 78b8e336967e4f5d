"""Compressed allreduce across real processes equals the in-process reference; each rank reports,
per case, where the tensor went and how far it was from the reference (the test checks).

argv[1]: cases "spec@algorithm|spec@auto>expected_algorithm|...". Each rank builds every rank's input (seeded by
case and rank), computes the reference with 4 thread-ranks of fresh compressors (FakeComm), then
reduces its own input through commlib.allreduce(..., compression=spec, algorithm=algorithm).
Two steps per case, so memories and warm starts are exercised. A policy rule routes
'*.weight' through topk without naming a compression at the call. Three powersgd tensors started
together are fused into one bucket (a 50 ms negotiation cycle releases them in one batch) and equal
their tensor-by-tensor reference."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # compressor_harness
import commlib                                                      # noqa: E402
import commlib.compressors as C                                     # noqa: E402
from commlib.testing import report                                  # noqa: E402
from compressor_harness import run_ranks                            # noqa: E402

POLICY_SPEC = "topk(ratio=0.05)"
commlib.init(policy=f"*.weight=allgather:{POLICY_SPEC};*=ring", cycle_time_ms=50)
rank, size = commlib.rank(), commlib.size()
torch.set_num_threads(1)


def inputs(case, step):
    return [torch.randn(16, 24, generator=torch.Generator().manual_seed(1000 * case + 10 * step + r)) * (r + 1)
            for r in range(size)]


def reference(spec, algorithm, steps, name):
    """Outputs of rank `rank` over the steps, from thread-ranks in this process (the tensor name
    matters: random streams are seeded by it)."""
    comps = [C.build(*C.parse(spec)) for _ in range(size)]

    def main(r, comm):
        return [comps[r].reduce(x[r], name, comm, True) for x in steps]

    return run_ranks(size, main, algorithm)[rank]


def max_diff(got, expected):
    same = isinstance(got, torch.Tensor) and got.shape == expected.shape
    return (got - expected).abs().max().item() if same else f"got {type(got).__name__} {getattr(got, 'shape', '')}"


cases = {}   # "spec@algorithm" -> {"algorithms": [per step], "max_diff": [per step], "expected": algorithm}
for case, text in enumerate(sys.argv[1].split("|")):
    # 'auto>allgather': call with algorithm="auto", expect the core to dispatch to allgather
    spec, _, algorithm = text.partition("@")
    algorithm, _, dispatched = algorithm.partition(">")
    steps = [inputs(case, s) for s in range(2)]
    expected = reference(spec, dispatched or algorithm, steps, f"case{case}.t")
    result = cases[text] = {"expected": dispatched or algorithm, "algorithms": [], "max_diff": []}
    for s, x in enumerate(steps):
        got = commlib.allreduce(x[rank], name=f"case{case}.t", compression=spec, algorithm=algorithm)
        result["algorithms"].append(commlib.records()[f"case{case}.t"]["algorithm"])
        result["max_diff"].append(max_diff(got, expected[s]))

# the policy route: no compression= at the call, the rule '*.weight' picks topk over allgather
x = inputs(len(cases), 0)
expected = reference(POLICY_SPEC, "allgather", [x], "layer.weight")[0]
policy = {"max_diff": max_diff(commlib.allreduce(x[rank], name="layer.weight"), expected),
          "record": {k: commlib.records()["layer.weight"][k] for k in ("algorithm", "compression")}}

# a bucket of compressed tensors: one reduce_bucket, the same result as one by one
bucket = [inputs(len(cases) + 1 + i, 0) for i in range(3)]
spec = "powersgd(rank=2)"
handles = [commlib.allreduce_async(x[rank], name=f"bucket.{i}", compression=spec, algorithm="ring")
           for i, x in enumerate(bucket)]
bucketed = {"max_diff": [max_diff(commlib.synchronize(h), reference(spec, "ring", [x], f"bucket.{i}")[0])
                         for i, (x, h) in enumerate(zip(bucket, handles))],
            "fused_with": [commlib.records()[f"bucket.{i}"]["fused_with"] for i in range(3)]}
commlib.shutdown()
report(rank=rank, cases=cases, policy=policy, bucket=bucketed)

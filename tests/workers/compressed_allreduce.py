"""Compressed allreduce across real processes equals the in-process reference.

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


failures = []
cases = [c.split("@") for c in sys.argv[1].split("|")]
for case, (spec, algorithm) in enumerate(cases):
    # 'auto>allgather': call with algorithm="auto", expect the core to dispatch to allgather
    algorithm, _, dispatched = algorithm.partition(">")
    dispatched = dispatched or algorithm
    steps = [inputs(case, s) for s in range(2)]
    expected = reference(spec, dispatched, steps, f"case{case}.t")
    for s, x in enumerate(steps):
        got = commlib.allreduce(x[rank], name=f"case{case}.t", compression=spec, algorithm=algorithm)
        if commlib.records()[f"case{case}.t"]["algorithm"] != dispatched:
            failures.append(f"{spec}@{algorithm} went to {commlib.records()[f'case{case}.t']['algorithm']}")
        tol = 2e-3 if spec.startswith("fp16") else 1e-5
        if not (isinstance(got, torch.Tensor) and got.shape == x[rank].shape and
                torch.allclose(got, expected[s], rtol=tol, atol=tol)):
            failures.append(f"{spec}@{algorithm} step {s}: max|diff| {(got - expected[s]).abs().max():.3g}")

# the policy route: no compression= at the call, the rule '*.weight' picks topk over allgather
x = inputs(len(cases), 0)
expected = reference(POLICY_SPEC, "allgather", [x], "layer.weight")[0]
got = commlib.allreduce(x[rank], name="layer.weight")
if not torch.allclose(got, expected, atol=1e-5):
    failures.append(f"policy *.weight: max|diff| {(got - expected).abs().max():.3g}")
record = commlib.records()["layer.weight"]
if record["algorithm"] != "allgather" or "topk" not in str(record["compression"]):
    failures.append(f"policy *.weight was dispatched as {record}")

# a bucket of compressed tensors: one reduce_bucket, the same result as one by one
bucket = [inputs(len(cases) + 1 + i, 0) for i in range(3)]
spec = "powersgd(rank=2)"
handles = [commlib.allreduce_async(x[rank], name=f"bucket.{i}", compression=spec, algorithm="ring")
           for i, x in enumerate(bucket)]
for i, (x, handle) in enumerate(zip(bucket, handles)):
    got, expected = commlib.synchronize(handle), reference(spec, "ring", [x], f"bucket.{i}")[0]
    if not torch.allclose(got, expected, atol=1e-5):
        failures.append(f"bucket.{i}: max|diff| {(got - expected).abs().max():.3g}")
fused = [commlib.records()[f"bucket.{i}"]["fused_with"] for i in range(3)]
if fused != [2, 2, 2]:
    failures.append(f"the three powersgd tensors were not fused into one bucket: fused_with {fused}")

commlib.shutdown()
if failures:
    print("FAILURES", rank, *failures, sep="\n")
    sys.exit(1)
print("COMPRESSED-OK", rank, len(cases))

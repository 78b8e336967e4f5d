"""CUDA tensors through the core: every algorithm hands back a tensor on the caller's device.

Rank r contributes (r + 1) * x on the GPU, so the sum is n(n+1)/2 * x: exact through the ring
and for int32, within the quantization bound through switchml, exact through omnireduce; bf16
and sparse COO inputs come back on the GPU in their own dtype and layout rules (dense sum).
Dense tensors are staged through pinned host memory (commlib.tensors.Staged)."""
import torch

import commlib
from commlib.testing import report

commlib.init(policy="*=ring")
r, n = commlib.rank(), commlib.size()
total = n * (n + 1) // 2
cuda = torch.device("cuda", 0)
failures = []


def check(label, got, expected, dtype, atol):
    if not (isinstance(got, torch.Tensor) and got.device == cuda and got.dtype == dtype
            and got.shape == expected.shape):
        failures.append(f"{label}: got {type(got).__name__} {getattr(got, 'device', '?')} "
                        f"{getattr(got, 'dtype', '?')} {tuple(getattr(got, 'shape', ()))}")
    else:   # a sparse result's values, densified (comparisons take no sparse operands)
        got = got.to_dense().float().cpu() if got.is_sparse else got.float().cpu()
        if not torch.allclose(got, expected.float().cpu(), atol=atol, rtol=0):
            failures.append(f"{label}: max|diff| {(got - expected.float().cpu()).abs().max():.3g}")


x = torch.linspace(-1, 1, 70001, device=cuda)
for algorithm, atol in (("ring", 1e-5), ("switchml", 1e-4), ("omnireduce", 1e-5)):
    got = commlib.allreduce((r + 1) * x, name=f"f.{algorithm}", op=commlib.Sum, algorithm=algorithm)
    check(f"float32 {algorithm}", got, total * x, torch.float32, atol)
    xi = (r + 1) * torch.arange(5000, dtype=torch.int32, device=cuda)
    got = commlib.allreduce(xi, name=f"i.{algorithm}", op=commlib.Sum, algorithm=algorithm)
    check(f"int32 {algorithm}", got, total * torch.arange(5000, dtype=torch.int32), torch.int32, 0)

half = torch.full((300,), float(r + 1), dtype=torch.bfloat16, device=cuda)
check("bfloat16 average", commlib.allreduce(half, name="bf16"), torch.full((300,), total / n), torch.bfloat16, 1e-2)

# an embedding gradient: rank r touches rows r and r+1 of a 10 x 4 table
rows = torch.tensor([[r, r + 1]], device=cuda)
sparse = torch.sparse_coo_tensor(rows, torch.ones(2, 4, device=cuda), (10, 4))
dense = torch.zeros(10, 4)
for k in range(n):
    dense[k:k + 2] += 1
got = commlib.allreduce(sparse, name="emb", op=commlib.Sum, algorithm="omnireduce")
if not got.is_sparse:
    failures.append(f"sparse COO omnireduce: came back {got.layout}, not sparse")
check("sparse COO omnireduce", got, dense, torch.float32, 0)

# compressed: the compressor runs on the GPU; summable payloads ride the ring, sparse ones omnireduce
for spec, algorithm in (("fp16", "ring"), ("powersgd(rank=2)", "ring"), ("topk(ratio=0.5)", "omnireduce"),
                        ("signsgd", "allgather")):
    g = torch.full((64, 32), float(r + 1), device=cuda)
    got = commlib.allreduce(g, name=f"c.{spec}", compression=spec, algorithm=algorithm)
    # every rank's input is constant: fp16, rank-2 PowerSGD and top-50% of a constant sum exactly;
    # signsgd's majority vote of positive inputs is +1
    expected = torch.ones(64, 32) if spec == "signsgd" else torch.full((64, 32), total / n)
    if spec.startswith("topk"):
        expected = None   # which half is kept is the compressor's choice: check the device and the mean
        if not (got.device == cuda and got.shape == g.shape and abs(got.sum().item() / (64 * 32 / 2) - total / n) < 1e-4):
            failures.append(f"{spec}: {got.device} {tuple(got.shape)} sum {got.sum().item()}")
    else:
        check(f"{spec}@{algorithm}", got, expected, torch.float32, 1e-3)
    record = commlib.records()[f"c.{spec}"]
    if record["algorithm"] != algorithm:
        failures.append(f"{spec} went through {record['algorithm']}, not {algorithm}")

commlib.shutdown()
report(rank=r, failures=failures)

"""CUDA tensors end to end: staged through pinned host memory, reduced by every algorithm and
compressor path, handed back on the caller's device. Runs where a GPU is present (checked on an
H100 machine); on CPU-only machines, such as CI's, there is nothing to check."""
import json

import pytest
import torch

from commlib.tensors import Staged
from helpers import check_grads, ddp_results, exact, switchml_bound
from launch import spawn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def test_staging_round_trip_keeps_device_and_dtype():
    t = torch.randn(33, 7, device="cuda").to(torch.bfloat16)
    staged = Staged(t)
    host = staged.array
    assert host.dtype.name == "float32" and host.shape == (33 * 7,)
    assert torch.equal(torch.from_numpy(host).view(33, 7), t.float().cpu())
    back = staged.restore(host * 2)
    assert back.device == t.device and back.dtype == torch.bfloat16 and torch.equal(back, t * 2)


@pytest.mark.multiprocess
def test_cuda_tensors_through_every_algorithm_two_ranks():
    for result in spawn(2, "cuda_allreduce.py", timeout=240).check().results():
        assert result["failures"] == [], result


@pytest.mark.multiprocess
def test_ddp_buckets_of_cuda_gradients_whole_and_per_parameter_equal_ddps_own(tmp_path):
    """DDP on the GPU (both ranks on cuda:0, gloo): commlib's hook reduces its CUDA buckets, per
    parameter on the first step and whole from the second, to exactly DDP's own allreduce (ring:
    the dyadic fixture of ddp_grads.py sums exactly), and the switch within its quantization bound."""
    scenarios = {"ring": ["*=ring", "cuda"], "per_parameter": ["*=ring", "cuda,per_parameter"],
                 "switchml": ["*=switchml", "cuda,float"]}
    spawn(2, "ddp_grads.py", tmp_path, json.dumps(scenarios), timeout=300).check()
    for name in scenarios:
        results = ddp_results(tmp_path, name, 2)
        check_grads(results, switchml_bound if name == "switchml" else exact)
        whole = [n for n in results[0]["record_names"] if n.startswith("bucket(")]
        assert whole == ([] if name == "per_parameter" else ["bucket(head.bias+3)"]), results[0]["record_names"]

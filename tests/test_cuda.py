"""CUDA tensors end to end: staged through pinned host memory, reduced by every algorithm and
compressor path, handed back on the caller's device. Runs where a GPU is present (checked on an
H100 machine); on CPU-only machines, such as CI's, there is nothing to check."""
import pytest
import torch

from commlib.tensors import Staged
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

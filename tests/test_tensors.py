"""Staged: a caller's tensor as the 1-D host array the backends reduce, and the result back."""
import gc

import numpy as np
import pytest
import torch

from commlib.errors import InvalidTensor
from commlib.tensors import COPY_MAX, Staged

CASES = {
    "2-d": lambda: torch.randn(3, 4),
    "requires grad": lambda: torch.randn(5, requires_grad=True),
    "empty": lambda: torch.zeros(2, 0),
    "0-d": lambda: torch.tensor(3.0),
    "sliced rows (contiguous, offset)": lambda: torch.randn(4, 4)[1:],
    "transposed (not contiguous)": lambda: torch.randn(4, 4).t(),
    "int64": lambda: torch.arange(6, dtype=torch.int64),
    "float16": lambda: torch.randn(3, dtype=torch.float16),
    "bfloat16": lambda: torch.randn(3, dtype=torch.bfloat16),
}


@pytest.mark.parametrize("case", CASES)
def test_the_host_array_holds_the_tensors_values_in_its_travel_dtype(case):
    tensor = CASES[case]()
    expected = tensor.detach().float() if tensor.dtype == torch.bfloat16 else tensor.detach()
    array = Staged(tensor).array
    assert array.ndim == 1 and array.dtype == expected.numpy().dtype, (array.dtype, tensor.dtype)
    assert np.array_equal(array, expected.reshape(-1).numpy()), (array, tensor)


def test_a_large_cpu_tensor_is_viewed_not_copied_and_kept_alive_by_its_array():
    tensor = torch.full((COPY_MAX,), 7.0)
    array = Staged(tensor).array
    assert np.shares_memory(array, tensor.numpy())
    del tensor
    gc.collect()
    torch.randn(COPY_MAX)   # would reuse the memory if the array did not hold the tensor
    assert (array == 7.0).all(), array[:5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.float64])
def test_restore_gives_the_callers_dtype_and_shape(dtype):
    tensor = torch.arange(12, dtype=dtype).reshape(3, 4)
    staged = Staged(tensor)
    out = staged.restore(staged.array * 2)
    assert out.dtype == dtype and out.shape == tensor.shape, (out.dtype, out.shape)
    assert torch.equal(out, tensor * 2), out


@pytest.mark.parametrize("dtype", [torch.complex64, torch.bool])
def test_a_dtype_that_cannot_be_summed_is_refused_with_what_to_do(dtype):
    with pytest.raises(InvalidTensor, match="use a float or integer dtype"):
        Staged(torch.zeros(3, dtype=dtype))


def test_a_tensor_cannot_pull_its_memory_from_under_the_backends():
    """The backends read `array` on the background thread: a small tensor's is a copy made at once
    (its caller may resize it after), a larger one's a view whose tensor torch refuses to resize."""
    small = torch.ones(COPY_MAX // 4)
    copied = Staged(small).array
    assert copied.ctypes.data != small.data_ptr()   # (not .numpy(): that would pin its size)
    small.resize_(1 << 22)
    assert (copied == 1.0).all()
    large = torch.ones(COPY_MAX)
    viewed = Staged(large).array
    with pytest.raises(RuntimeError, match="not resizable"):
        large.resize_(1 << 22)
    assert (viewed == 1.0).all()


def test_values_behind_a_negative_bit_are_read_as_the_tensor_holds_them():
    tensor = torch._neg_view(torch.arange(4.0))
    staged = Staged(tensor)
    assert staged.array.tolist() == [-0.0, -1.0, -2.0, -3.0], staged.array


def test_a_checkout_without_the_native_module_still_imports_and_stages_small_tensors():
    """commlib._native (the C data path) is built by `make install`; without it the ring still runs,
    so commlib imports and copies a small tensor at submission through its fallback."""
    import subprocess
    import sys
    code = ("import sys, importlib.abc\n"
            "class Unbuilt(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name == 'commlib._native': raise ImportError('not built')\n"
            "sys.meta_path.insert(0, Unbuilt())\n"
            "import torch, commlib\n"
            "from commlib.tensors import Staged\n"
            "t = torch.arange(10.0)\n"
            "a = Staged(t).array\n"
            "assert a.tolist() == t.tolist() and a.ctypes.data != t.data_ptr(), a\n"
            "assert 'commlib._native' not in sys.modules\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]

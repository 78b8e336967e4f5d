"""numpy arrays and torch tensors in, the same type, device, dtype and shape out.

Backends only see contiguous 1-D numpy arrays on the host. torch CPU tensors are viewed without
a copy; CUDA tensors are staged through pinned host memory; sparse COO tensors are densified
(the result is dense); bfloat16, which numpy lacks, travels as float32.
"""
import numpy as np

from commlib.errors import InvalidTensor


class Staged:
    """A tensor's host view for the backends, and the way back to the caller's type."""

    def __init__(self, tensor):
        self.torch = _is_torch(tensor)
        if self.torch:
            import torch
            self.device, self.dtype, self.shape = tensor.device, tensor.dtype, tuple(tensor.shape)
            t = tensor.detach()
            if t.is_sparse:
                t = t.to_dense()
            if t.dtype == torch.bfloat16:
                t = t.float()
            if t.device.type != "cpu":
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
                host.copy_(t)   # synchronous: the host copy is complete when it returns
                t = host
            self.array = t.contiguous().view(-1).numpy()
        elif isinstance(tensor, np.ndarray):
            self.shape, self.dtype = tensor.shape, tensor.dtype
            self.array = np.ascontiguousarray(tensor).reshape(-1)
        else:
            raise InvalidTensor(f"commlib reduces numpy arrays and torch tensors, not {type(tensor).__name__}")
        if self.array.dtype.kind not in "fiub":
            raise InvalidTensor(f"dtype {self.array.dtype} cannot be reduced; use a float or integer dtype")

    def restore(self, flat):
        """The reduced 1-D host array back in the caller's type, dtype, device and shape."""
        if not self.torch:
            return flat.astype(self.dtype, copy=False).reshape(self.shape)
        import torch
        out = torch.from_numpy(np.ascontiguousarray(flat)).view(self.shape)
        return out.to(device=self.device, dtype=self.dtype, non_blocking=False)


def _is_torch(tensor):
    try:
        import torch
    except ImportError:
        return False
    return isinstance(tensor, torch.Tensor)

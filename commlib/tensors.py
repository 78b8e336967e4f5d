"""numpy arrays and torch tensors in, the same type, device, dtype and shape out.

Backends only see contiguous 1-D numpy arrays on the host, read on the background thread. A small
torch CPU tensor is copied at submission, read by address (a torch call releases the GIL, and
taking it back behind a busy rank's threads costs more than the copy); a larger one is viewed
without a copy through .numpy(), after which torch refuses to resize it; CUDA tensors are staged
through pinned host memory; bfloat16, which numpy lacks, travels as float32. torch sparse COO
tensors (and commlib.sparse.RowSparse) are held as coalesced (rows, values), `sparse`, which the
sparse algorithms reduce without densifying; only a compressor or a dense fallback asks for the
dense `array`. The host array is made only when asked for: a compressor works on the caller's
tensor where it lives.
"""
import contextlib
import ctypes
import sys
from functools import cache

import numpy as np

from commlib import sparse as row_sparse
from commlib.errors import InvalidTensor

COPY_MAX = 1 << 16   # bytes: torch CPU tensors up to this size are copied at submission (see above)


class Staged:
    """A tensor's description (for the policy and negotiation) and, on demand, its host view."""

    __slots__ = ("tensor", "kind", "torch", "sparse", "_array", "dtype", "shape", "cpu", "dtype_name", "travel_dtype",
                 "numel", "nbytes", "small")

    def __init__(self, tensor):
        if isinstance(tensor, np.generic):   # a 0-d value as numpy hands it (TF's 0-d tensors, keras' scalars)
            tensor = np.asarray(tensor)
        self.tensor, self.kind = tensor, type(tensor)
        self.torch = _is_torch(tensor)
        self.sparse = None   # coalesced RowSparse for sparse inputs
        self._array = None
        self.cpu = True      # a torch tensor's memory may be elsewhere
        self.small = False   # a dense torch CPU tensor of a dtype numpy has, copied at submission (COPY_MAX)
        if isinstance(tensor, row_sparse.RowSparse):
            self.sparse = tensor.coalesced()
            self.shape, self.dtype = tensor.shape, tensor.values.dtype
            if self.dtype.kind not in "fiu":
                raise InvalidTensor(f"dtype {self.dtype} cannot be reduced; use a float or integer dtype")
            self.dtype_name, self.travel_dtype = _name(self.dtype), self.dtype
            self.numel = int(np.prod(self.shape, dtype=np.int64))
            self.nbytes = self.numel * self.dtype.itemsize
        elif self.torch:
            self.dtype, self.shape, self.cpu = tensor.dtype, tensor.shape, tensor.is_cpu   # torch.Size: a tuple
            self.dtype_name, self.travel_dtype, itemsize = torch_dtype(tensor.dtype)
            self.numel = tensor.numel()
            self.nbytes = self.numel * itemsize
            if tensor.is_sparse:
                self.sparse = row_sparse.from_torch(tensor).coalesced()
            self.small = self.cpu and self.sparse is None and self.nbytes <= COPY_MAX and tensor.dtype is not _bfloat16()
        elif isinstance(tensor, np.ndarray):
            self.shape, self.dtype = tensor.shape, tensor.dtype
            if tensor.dtype.kind not in "fiu":
                raise InvalidTensor(f"dtype {tensor.dtype} cannot be reduced; use a float or integer dtype")
            self.dtype_name, self.travel_dtype = _name(tensor.dtype), tensor.dtype
            self.numel, self.nbytes = tensor.size, tensor.nbytes
        else:
            raise InvalidTensor(f"commlib reduces numpy arrays and torch tensors, not {type(tensor).__name__}")

    def again(self, tensor=None):
        """A Staged of `tensor` where this one described a tensor like it (the same type, dtype and shape,
        dense, on the same kind of device): this description, for it; else None. Without a tensor: the
        description alone, holding none of the caller's memory."""
        if tensor is not None and (type(tensor) is not self.kind or self.sparse is not None or
                                   tensor.dtype != self.dtype or tensor.shape != self.shape or
                                   (self.torch and (tensor.is_cpu is not self.cpu or tensor.is_sparse))):
            return None
        staged = object.__new__(Staged)
        staged.tensor, staged.kind, staged.torch, staged.cpu, staged.small = \
            tensor, self.kind, self.torch, self.cpu, self.small
        staged.sparse = staged._array = None
        staged.dtype, staged.shape, staged.dtype_name, staged.travel_dtype = \
            self.dtype, self.shape, self.dtype_name, self.travel_dtype
        staged.numel, staged.nbytes = self.numel, self.nbytes
        return staged

    def read(self):
        """Read a dense CPU torch tensor now, on the caller's thread: copied, or viewed and then never
        resized (see `array`). Returns self."""
        if self.torch and self.sparse is None and self.cpu:
            self.array
        return self

    @property
    def device(self):
        return self.tensor.device

    @property
    def array(self):
        """The contiguous 1-D host array of `travel_dtype` the backends reduce, made once (not a
        cached_property: Python 3.11's takes a lock at each first read, a microsecond a tensor)."""
        if self._array is None:
            self._array = self._host_array()
        return self._array

    def _host_array(self):
        if self.sparse is not None and not self.torch:
            return self._densified()
        if not self.torch:
            return np.ascontiguousarray(self.tensor).reshape(-1)
        if self.small and _as_stored(self.tensor):   # read now, on the caller's thread
            return _copied(self.tensor, self.numel, self.travel_dtype)
        import torch
        t = self.tensor.detach()
        if t.is_sparse:
            t = t.to_dense()
        if t.dtype == torch.bfloat16:
            t = t.float()
        if t.device.type != "cpu":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
            host.copy_(t)   # synchronous: the host copy is complete when it returns
            t = host
        if not t.is_contiguous():
            t = t.contiguous()
        # .numpy(): torch then refuses to resize the tensor (for good), whose memory the backends read later
        return t.resolve_neg().numpy().reshape(-1) if _negative(t) else t.numpy().reshape(-1)

    def _densified(self):
        out = np.zeros((self.sparse.nrows, self.sparse.width), dtype=self.travel_dtype)
        out[self.sparse.rows] = self.sparse.values
        return out.reshape(-1)

    def dense(self):
        """The caller's tensor, densified if it is sparse (what compressors work on)."""
        if self.sparse is not None and not self.torch:
            return self._densified().reshape(self.shape)
        return self.tensor.to_dense() if self.torch and self.tensor.is_sparse else self.tensor

    def restore_rows(self, rows, values):
        """A row-sparse result (unique sorted rows) in the caller's form: a coalesced torch sparse COO
        tensor on the caller's device and dtype, or a RowSparse."""
        k = self.sparse.sparse_dim
        if not self.torch:
            return row_sparse.RowSparse(rows, values.astype(self.dtype, copy=False), self.shape, k)
        return row_sparse.to_torch(rows, values, self.shape, k, self.dtype, self.device)

    def restore(self, flat):
        """The reduced 1-D host array back in the caller's type, dtype, device and shape. It runs on the
        thread that first waits (Handle.set), maybe inside its inference_mode or a dispatch mode
        (FakeTensorMode while tracing): the result is made as on commlib's own thread, outside them."""
        if not self.torch:
            return flat.astype(self.dtype, copy=False).reshape(self.shape)
        torch = sys.modules["torch"]
        if torch.is_inference_mode_enabled() or torch._C._len_torch_dispatch_stack():
            with _plain(torch):
                return self._restored(torch, flat)
        return self._restored(torch, flat)

    def _restored(self, torch, flat):
        flat = np.ascontiguousarray(flat)   # (a 1-D array: reshaped after it)
        out = torch.from_numpy(flat if flat.shape == self.shape else flat.reshape(self.shape))   # see `array`
        if out.dtype != self.dtype or not self.cpu:
            out = out.to(device=self.device, dtype=self.dtype, non_blocking=False)
        return out


def _plain(torch):
    """A context without the calling thread's inference mode and dispatch modes."""
    from torch.utils._python_dispatch import _disable_current_modes
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(False))
    stack.enter_context(_disable_current_modes())
    return stack


def viewable(tensor):
    """A torch tensor `host_array` can view: dense, contiguous, with memory on the CPU (not a ZeroTensor
    or a FakeTensor), of a dtype numpy has, its values as stored (no negative bit). Only attributes
    that keep the GIL (see _HostView): is_cpu, not tensor.device (which costs more than a small copy)."""
    return tensor.is_cpu and not tensor.is_sparse and tensor.dtype is not _bfloat16() and _as_stored(tensor)


def _as_stored(tensor):
    """Whether a dense CPU tensor's memory holds its values as they are, in order: contiguous, with memory
    (not a ZeroTensor or a FakeTensor), no negative bit."""
    return tensor.is_contiguous() and not _negative(tensor) and (tensor.data_ptr() != 0 or tensor.numel() == 0)


@cache
def _bfloat16():
    import torch
    return torch.bfloat16


def _negative(tensor):
    """tensor.is_neg(), asked of its dispatch keys as text where torch has them: is_neg releases the GIL
    (see _HostView), and the keys' object form costs microseconds in a busy process (pybind11 registers
    each instance it returns). Its first call puts the test in its place."""
    global _negative
    import torch
    keys = getattr(torch._C, "_dispatch_key_set", None)
    _negative = (lambda t: t.is_neg()) if keys is None else (lambda t: "Negative" in keys(t))
    return _negative(tensor)


def host_array(tensor):
    """A `viewable` tensor's memory as a 1-D numpy array, without a torch call (see _HostView). The
    array keeps the tensor object alive, not its memory if it is resized: for memory its owner does not
    resize while the array is used (a DDP bucket); a caller's tensor goes through Staged.array."""
    dtype = host_dtype(tensor.dtype)
    return np.asarray(_HostView(tensor, dtype)) if tensor.numel() else np.empty(0, dtype)


def _copied(tensor, numel, dtype):
    """A `viewable` tensor's `numel` values (of numpy `dtype`), copied by address with the GIL held: a
    torch call, or numpy's own copy of more than a few hundred values, releases it (see _HostView)."""
    out = np.empty(numel, dtype)
    if out.size:
        _copy_from(out, tensor.data_ptr(), out.nbytes)
    return out


def _copier():
    """(array, address, nbytes) -> copy nbytes from address into the array, keeping the GIL: cffi's
    memmove, which takes the array as a buffer; without the native module (a ring-only checkout that
    never built it), libc's memcpy through ctypes, whose numpy pointer costs 1.5 us more a call."""
    try:
        from commlib._native import ffi
    except ImportError:
        memcpy = ctypes.PyDLL(None).memcpy   # a PyDLL's calls keep the GIL
        memcpy.argtypes, memcpy.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_void_p
        return lambda out, address, nbytes: memcpy(out.ctypes.data, address, nbytes)
    return lambda out, address, nbytes: ffi.memmove(out, ffi.cast("char *", address), nbytes)


_copy_from = _copier()


class _HostView:
    """A contiguous CPU tensor's memory as numpy's array interface describes it; the array made from
    it keeps the tensor alive (its base). Not .numpy() or DLPack: those are torch calls that release the
    GIL, and taking it back behind a busy rank's other threads costs tens of us per tensor, more than
    the rest of a submission."""

    __slots__ = ("tensor", "__array_interface__")

    def __init__(self, tensor, dtype):
        self.tensor = tensor
        self.__array_interface__ = {"data": (tensor.data_ptr(), False), "shape": (tensor.numel(),),
                                    "typestr": dtype.str, "version": 3}


@cache
def host_dtype(dtype):
    """The numpy dtype a torch dtype travels as (bfloat16, which numpy lacks: float32)."""
    import torch
    return torch.empty(0, dtype=torch.float32 if dtype == torch.bfloat16 else dtype).numpy().dtype


@cache
def _name(dtype):
    """A numpy dtype's name (numpy computes dtype.name anew at every read: 1.6 us)."""
    return dtype.name


@cache
def torch_dtype(dtype):
    """(name, travel dtype, itemsize) of a torch dtype commlib reduces, else an InvalidTensor."""
    import torch
    try:
        travel = host_dtype(dtype)
    except TypeError:   # a dtype numpy has no counterpart of (float8s, bits, quantized)
        travel = None
    if dtype.is_complex or dtype == torch.bool or travel is None:
        raise InvalidTensor(f"dtype {dtype} cannot be reduced; use a float or integer dtype (float32, float16, "
                            f"bfloat16, int32, ...)")
    return str(dtype).replace("torch.", ""), travel, dtype.itemsize


_ITEMSIZE = {"bfloat16": 2}   # torch dtypes numpy does not name


def numeric_dtype(name):
    """The numpy dtype a tensor of dtype `name` (Staged.dtype_name, as submitted) travels as, or an
    InvalidTensor for a name that is not a number type."""
    try:
        dtype = np.dtype("float32" if name == "bfloat16" else name)
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in "fiu":
        raise InvalidTensor(f"dtype {name!r} cannot be reduced")
    return dtype


def nbytes(shape, dtype_name):
    """A tensor's bytes as its owner counts them (Staged.nbytes), from its shape and dtype name."""
    count = 1
    for dim in shape:
        count *= dim
    return count * (_ITEMSIZE.get(dtype_name) or numeric_dtype(dtype_name).itemsize)


def _is_torch(tensor):
    torch = sys.modules.get("torch")   # a torch tensor exists only once torch was imported
    return torch is not None and isinstance(tensor, torch.Tensor)

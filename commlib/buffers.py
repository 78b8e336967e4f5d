"""Large arrays reused once nobody holds them.

A fresh large array costs the kernel a page fault and a page of zeroing per 4 KiB at its first
write (perf here: 18% of a switchml worker's CPU, about 0.4 ns per float32 element, as much as
quantizing it), and a training step asks for the same sizes step after step: the same buckets, the
same results. So results and fusion buffers come from `POOL`, which hands a kept array out again
only when its own reference is the last one: a caller's name, a view (numpy's views hold the array
they view), a torch tensor made from it, each keeps it from being reused.
"""
import sys
import threading

import numpy as np

SMALL = 1 << 16        # bytes: malloc serves smaller arrays from memory it already touched
KEPT_BYTES = 1 << 28   # at most this much kept, in use or not (4 buckets of the default fusion threshold)


class ArrayPool:
    def __init__(self, kept_bytes=KEPT_BYTES):
        self.kept_bytes = kept_bytes
        self._kept = []   # oldest first
        self._bytes = 0
        self._lock = threading.Lock()

    def empty(self, size, dtype):
        """A 1-D array of `size` elements of `dtype`, its contents undefined (np.empty's)."""
        dtype = np.dtype(dtype)
        if size * dtype.itemsize < SMALL:
            return np.empty(size, dtype)
        with self._lock:
            for i in range(len(self._kept)):
                if self._kept[i].size == size and self._kept[i].dtype == dtype and _unused(self._kept, i):
                    array = self._kept.pop(i)
                    self._kept.append(array)   # the most recently used last: the oldest goes first
                    return array
            array = np.empty(size, dtype)
            self._kept.append(array)
            self._bytes += array.nbytes
            while self._bytes > self.kept_bytes and len(self._kept) > 1:   # forgotten, alive while used
                self._bytes -= self._kept.pop(0).nbytes
            return array

    def copy(self, array):
        """A copy of an array (C order), in pooled memory."""
        out = self.empty(array.size, array.dtype).reshape(array.shape)
        np.copyto(out, array)
        return out

    def concatenate(self, arrays):
        """np.concatenate of 1-D arrays of one dtype, in pooled memory."""
        out = self.empty(sum(a.size for a in arrays), arrays[0].dtype)
        return np.concatenate(arrays, out=out)


def _unused(kept, i):
    # references: the list's and getrefcount's own argument
    return sys.getrefcount(kept[i]) == 2


POOL = ArrayPool()

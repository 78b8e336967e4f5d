"""ArrayPool: large arrays handed out again only once nothing else holds them."""
import numpy as np
import torch

from commlib.buffers import SMALL, ArrayPool

N = SMALL   # float32 values: 4 x SMALL bytes, pooled


def test_an_array_is_reused_once_dropped_and_never_while_anything_holds_it():
    pool = ArrayPool()
    first = pool.empty(N, np.float32)
    address = first.ctypes.data
    assert pool.empty(N, np.float32).ctypes.data != address, "handed out while the caller holds it"
    view = first[10:]
    del first
    assert pool.empty(N, np.float32).ctypes.data != address, "handed out while a view of it lives"
    tensor = torch.from_numpy(view)
    del view
    assert pool.empty(N, np.float32).ctypes.data != address, "handed out while a torch tensor of it lives"
    del tensor
    assert pool.empty(N, np.float32).ctypes.data == address, "not reused once dropped"


def test_sizes_and_dtypes_are_matched_and_small_arrays_are_not_kept():
    pool = ArrayPool()
    kept = pool.empty(N, np.float32).ctypes.data
    assert pool.empty(N, np.int32).ctypes.data != kept
    assert pool.empty(N + 1, np.float32).ctypes.data != kept
    pool.empty(16, np.float32)
    assert all(a.nbytes >= SMALL for a in pool._kept), [a.nbytes for a in pool._kept]


def test_what_is_kept_stays_under_its_bound_in_use_or_not():
    pool = ArrayPool(kept_bytes=3 * 4 * N)
    held = [pool.empty(N, np.float32) for _ in range(10)]   # all in use: the oldest are forgotten, not freed
    assert sum(a.nbytes for a in pool._kept) <= 3 * 4 * N
    held[0][:] = 1.0
    assert (held[0] == 1.0).all()


def test_copy_and_concatenate_give_the_values():
    pool = ArrayPool()
    a, b = np.arange(N, dtype=np.float32), np.ones(N, np.float32)
    assert np.array_equal(pool.copy(a.reshape(2, -1)), a.reshape(2, -1))
    assert np.array_equal(pool.concatenate([a, b]), np.concatenate([a, b]))

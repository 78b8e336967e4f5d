"""Row-sparse tensors: a gradient as (row indices, row values), the form embedding gradients take.

A torch sparse COO tensor with k sparse dims (nn.Embedding(sparse=True) gives k = 1) is a table of
prod(shape[:k]) rows of prod(shape[k:]) elements of which only some are present; it travels as
those rows, never densified by the front-end. Every algorithm returns the UNION of the rows some
rank sent, each summed, as Horovod's allgather does, rows whose sum is zero included (SparseAdam
updates exactly the rows present). Algorithms that sum fixed slots (omnireduce, switchml, ring)
carry each row in a slot with one extra element, a presence count, so the union survives a zero sum.
"""
import base64

import numpy as np

from commlib.errors import InvalidTensor


class RowSparse:
    """rows (int64, n) and values (n, width) of a table of `nrows` rows; rows may repeat until
    coalesced. `shape`/`sparse_dim` describe the caller's tensor (for restoring it)."""

    __slots__ = ("rows", "values", "nrows", "shape", "sparse_dim")

    def __init__(self, rows, values, shape, sparse_dim=1):
        self.shape, self.sparse_dim = tuple(int(s) for s in shape), int(sparse_dim)
        self.nrows = int(np.prod(self.shape[:self.sparse_dim], dtype=np.int64))
        width = int(np.prod(self.shape[self.sparse_dim:], dtype=np.int64))
        self.rows = np.ascontiguousarray(rows, dtype=np.int64).reshape(-1)
        self.values = np.ascontiguousarray(values).reshape(self.rows.size, width)
        if self.rows.size and (self.rows.min() < 0 or self.rows.max() >= self.nrows):
            raise InvalidTensor(f"row indices must lie in [0, {self.nrows}) for shape {list(self.shape)}")

    @property
    def width(self):
        return self.values.shape[1]

    def coalesced(self):
        rows, values = coalesce(self.rows, self.values)
        out = RowSparse.__new__(RowSparse)
        out.rows, out.values, out.nrows, out.shape, out.sparse_dim = rows, values, self.nrows, self.shape, self.sparse_dim
        return out


def from_torch(tensor):
    """RowSparse view of a torch sparse COO tensor (host values; bfloat16 as float32)."""
    import torch
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:
        t = t.float()
    k = t.sparse_dim()
    indices = t._indices().numpy()
    rows = indices[0] if k == 1 else np.ravel_multi_index(tuple(indices), tuple(t.shape[:k]))
    return RowSparse(rows, t._values().contiguous().numpy(), tuple(t.shape), k)


def to_torch(rows, values, shape, sparse_dim, dtype, device):
    """A coalesced torch sparse COO tensor from unique sorted rows and their values."""
    import torch
    indices = np.stack(np.unravel_index(rows, shape[:sparse_dim])) if sparse_dim > 1 else rows.reshape(1, -1)
    vals = torch.from_numpy(np.ascontiguousarray(values)).reshape(len(rows), *shape[sparse_dim:])
    out = torch.sparse_coo_tensor(torch.from_numpy(np.ascontiguousarray(indices, dtype=np.int64)), vals, shape,
                                  is_coalesced=True, check_invariants=False)
    return out.to(device=device, dtype=dtype)


def coalesce(rows, values):
    """Unique sorted rows, the values of repeated rows summed (in their order of appearance)."""
    if rows.size == 0:
        return rows, values
    order = np.argsort(rows, kind="stable")
    rows = rows[order]
    starts = np.flatnonzero(np.concatenate(([True], rows[1:] != rows[:-1])))
    if starts.size == rows.size:
        return rows, values[order]
    return rows[starts], np.add.reduceat(values[order], starts, axis=0)


def index_dtype(nrows):
    """Row indices travel as int32 where the table's rows fit (half the bytes of int64)."""
    return np.dtype(np.int32) if nrows <= np.iinfo(np.int32).max + 1 else np.dtype(np.int64)


def presence_bits(ranks):
    """Bits of a row's presence count summed over `ranks` ranks (at most `ranks`: it never carries)."""
    return max(1, int(ranks).bit_length())


def presence_words(k, ranks):
    """int32 words holding k rows' presence counts packed presence_bits(ranks) bits a row."""
    return -(-k // (32 // presence_bits(ranks)))


def payload_bytes(count, row_bytes, nrows):
    """One rank's message: its count, its rows' indices (padded to 8 bytes) and their values."""
    return 8 + -(-count * index_dtype(nrows).itemsize // 8) * 8 + count * row_bytes


class RowSlots:
    """Rows laid out in a flat array for an algorithm that sums fixed positions. A slot is a row and
    its presence count (width + 1 elements). With a `block` (omnireduce's, the job's largest), the
    tensor's own block is whole slots: `rows_per_block` of them (0, or more than fit: as many as fit
    in `block`) when a slot fits, else one slot cut into the fewest equal blocks that fit; so a
    touched row costs its own block (one row by default), and a block's bitmap entry comes from the
    rows, not a scan. `self.block` is then the tensor's block, `group` the elements of one group of
    `per_group` rows (one block, or the blocks of one long row)."""

    def __init__(self, nrows, width, block=None, rows_per_block=1):
        self.nrows, self.width, self.slot = nrows, width, width + 1
        if block is None:
            self.per_group, self.group = 1, self.slot
        elif self.slot <= block:
            fit = block // self.slot
            self.per_group = min(rows_per_block, fit) if rows_per_block > 0 else fit
            self.group = block = self.per_group * self.slot
        else:
            parts = -(-self.slot // block)
            block = -(-self.slot // parts)
            self.per_group, self.group = 1, parts * block
        self.groups = -(-nrows // self.per_group)
        self.size = self.groups * self.group
        self.block = block

    def offsets(self, rows):
        return (rows // self.per_group) * self.group + (rows % self.per_group) * self.slot

    def scatter(self, rows, values, dtype):
        """(flat array, uint8 block mask or None) holding unique `rows`; untouched pages stay unmapped."""
        flat = np.zeros(self.size, dtype=dtype)
        at = self.offsets(rows)
        flat[at[:, None] + np.arange(self.width)] = values
        flat[at + self.width] = 1
        if self.block is None:
            return flat, None
        mask = np.zeros(self.size // self.block, dtype=np.uint8)
        per = self.group // self.block   # blocks per group
        first = np.unique(rows // self.per_group) * per
        mask[(first[:, None] + np.arange(per)).reshape(-1)] = 1
        return flat, mask

    def gather(self, flat):
        """(rows, values) of every slot some rank filled (its presence count > 0.5)."""
        table = flat.reshape(self.groups, self.group)[:, :self.per_group * self.slot]
        table = table.reshape(self.groups * self.per_group, self.slot)[:self.nrows]
        rows = np.flatnonzero(table[:, self.width] > 0.5)
        return rows, table[rows, :self.width]

    def touched_blocks(self, rows):
        """The block-group index of each row (what omnireduce sends one block group for)."""
        return rows // self.per_group


# -- union estimates for the traffic model: each rank sends a linear-counting sketch of its ids ------
SKETCH_BITS = 8192


def sketch(ids):
    """A linear-counting bitmap of a set of integer ids, as base64 text (the controller's JSON)."""
    bits = np.zeros(SKETCH_BITS, dtype=bool)
    if len(ids):
        bits[_mix(np.asarray(ids, dtype=np.uint64)) >> np.uint64(64 - 13)] = True
    return base64.b64encode(np.packbits(bits).tobytes()).decode()


def _mix(x):
    """splitmix64's finalizer: ids that are close (rows of one table) land on independent bits."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def union_size(sketches, counts):
    """Estimated size of the union of the sets behind `sketches` (at least the largest set, at most
    the sum of `counts`)."""
    bits = np.zeros(SKETCH_BITS // 8, dtype=np.uint8)
    for text in sketches:
        bits |= _bits(text)
    return _linear_count(bits, counts)


def others_union_sizes(sketches, counts):
    """For each set, the estimated size of the union of all the OTHER sets (ORs of the sketches
    before and after it: O(N) for N sets)."""
    bits = [_bits(text) for text in sketches]
    before = [np.zeros(SKETCH_BITS // 8, dtype=np.uint8)]
    for b in bits[:-1]:
        before.append(before[-1] | b)
    after = [np.zeros(SKETCH_BITS // 8, dtype=np.uint8)]
    for b in reversed(bits[1:]):
        after.append(after[-1] | b)
    after.reverse()
    return [_linear_count(before[r] | after[r], list(counts[:r]) + list(counts[r + 1:])) for r in range(len(bits))]


def _bits(text):
    return np.frombuffer(base64.b64decode(text), dtype=np.uint8)


def _linear_count(bits, counts):
    zeros = SKETCH_BITS - int(np.unpackbits(bits).sum())
    estimate = sum(counts) if zeros == 0 else -SKETCH_BITS * np.log(zeros / SKETCH_BITS)
    return float(min(max(estimate, max(counts, default=0)), sum(counts)))


def reduce_rows(backend, rows, values, nrows, name, counts=None):
    """Sum unique `rows` over ranks with `backend`: its own row-sparse collective when it has one
    (sparse_allgather, omnireduce's row blocks), else the table of slots as one dense array through
    its allreduce (ring, switchml: the `dense` choice). Values travel as float32 where the backend
    lacks their dtype. `counts`: every rank's row count when known (the negotiation carries them), so
    the allgather needs no round to exchange sizes. Returns the union's (unique sorted rows, values)
    in the input's dtype."""
    dtype = values.dtype
    if dtype not in backend.dtypes:
        values = values.astype(np.float32)
    if "rows" in backend.carries:
        out_rows, out_values = backend.allreduce_rows(rows, values, nrows, name, counts)
    else:
        slots = RowSlots(nrows, values.shape[1])
        flat, _ = slots.scatter(rows, values, values.dtype)
        out_rows, out_values = slots.gather(backend.allreduce(flat, name))
    return out_rows, out_values.astype(dtype, copy=False)

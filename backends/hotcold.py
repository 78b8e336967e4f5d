"""Hot/cold split of row-sparse gradients (the IMC'20 study's proposal): a few rows take most updates.

Per tensor, every rank counts how often it touches each row over a window of `hotcold_every`
calls; at the window's end the ranks sum their counts (one allgather of the touched rows' counts,
inside the same negotiated call: no extra round, no pause of other tensors) and all take the same
hot set, the K most updated rows (ties: the lower row). From the next call on, the hot rows travel
as ONE dense slab of K rows (each with its presence count) through `hotcold_hot` (switchml: summed
in the network, no indices on the wire), the other rows through `hotcold_cold` (the sparse
allgather, or omnireduce's row blocks). The result is the union of the rows, summed, as the plain
sparse sum. Before the first window ends every row is cold.

Tuning guide
  hotcold_k        hot rows per tensor; 0 picks them from the last window's counts (at most
                   hotcold_max_k): with hotcold_rule=share the fewest rows that carried `hotcold_share`
                   of the updates, with hotcold_rule=traffic every row touched often enough that the
                   allgather would carry it more bytes than its slot in the slab costs (p > (w+1) /
                   ((N-1)(w + 4/itemsize)) for a row of w values touched by a rank with probability p, int32
                   indices). The slab costs K (width + 1) values
                   each way whether touched or not: worth it when the hot rows are touched by most
                   ranks at most steps (Zipf-like ids), where the allgather carries each N times.
  hotcold_every    the window, in calls per tensor: shorter follows a drifting skew, longer costs
                   fewer count exchanges (each: touched rows x 16 bytes per rank).

records() shows per tensor `hot_k`, `hot_share` (of the last window's updates the hot set carried)
and this call's hot and cold rows; `counts(name)` gives the last window's summed per-row counts
(the skew plot of benchmarks/bench_sparse.py).
"""
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from commlib.backends import Backend, register
from commlib.errors import ConfigError
from commlib.settings import define
from commlib.sparse import coalesce, index_dtype, reduce_rows

define("hotcold_k", 0, "hot/cold split: hot rows per tensor; 0 = chosen from the window's counts by hotcold_rule")
define("hotcold_rule", "share", "hot/cold split with hotcold_k=0: 'share' (the fewest rows carrying hotcold_share of "
       "updates) or 'traffic' (every row whose slab slot costs less than its expected allgather bytes)")
define("hotcold_share", 0.5, "hot/cold split with hotcold_rule=share: the share of the window's updates the hot set carries")
define("hotcold_max_k", 65536, "hot/cold split: at most this many hot rows per tensor")
define("hotcold_every", 20, "hot/cold split: calls per tensor in a counting window; the hot set is re-agreed after each")
define("hotcold_hot", "switchml", "hot/cold split: the algorithm summing the hot slab (switchml or ring)")
define("hotcold_cold", "sparse_allgather", "hot/cold split: the algorithm for cold rows (sparse_allgather or omnireduce)")

F32 = np.dtype("float32")


class _Split:
    """One tensor's state: the agreed hot set and this window's local counts."""

    def __init__(self, nrows):
        self.hot = np.empty(0, dtype=np.int64)     # sorted, the same on every rank
        self.window = np.zeros(nrows, dtype=np.int32)
        self.calls = self.agreements = 0
        self.hot_share = 0.0                       # of the last window's updates, carried by `hot`
        self.counts = (np.empty(0, np.int64), np.empty(0, np.int64))   # last window, summed over ranks
        self.last = {}


@register
class HotColdBackend(Backend):
    name = "hotcold"
    ops = ("sum",)
    dtypes = (F32,)
    rows = True

    @classmethod
    def available(cls, ctx):
        if ctx.engine is None:
            return False, "no collective engine (Horovod, MPI or torch.distributed) in this job"
        return True, ""

    def __init__(self, ctx):
        super().__init__(ctx)
        s = ctx.settings
        self.k, self.share, self.max_k = int(s.hotcold_k), float(s.hotcold_share), int(s.hotcold_max_k)
        self.every, self.rule = int(s.hotcold_every), s.hotcold_rule
        if self.rule not in ("share", "traffic"):
            raise ConfigError(f"hotcold_rule={self.rule!r}: use 'share' or 'traffic'")
        self.hot_name, self.cold_name = s.hotcold_hot, s.hotcold_cold
        if self.k < 0 or self.max_k < 1 or not 0 < self.share <= 1 or self.every < 1:
            raise ConfigError(f"hotcold: k={self.k} (>= 0), max_k={self.max_k} (>= 1), share={self.share} (in (0, 1]) "
                              f"and every={self.every} (>= 1) are out of range")
        if self.hot_name not in ("switchml", "ring") or self.cold_name not in ("sparse_allgather", "omnireduce"):
            raise ConfigError(f"hotcold: hot={self.hot_name!r} must be switchml or ring, cold={self.cold_name!r} "
                              f"sparse_allgather or omnireduce")
        self._backends = {}
        self._tensors = {}
        # the slab's collective runs beside the cold rows' (another algorithm, its own sockets); the
        # executor calls one backend at a time, so nothing else uses the hot carrier meanwhile
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hotcold-slab")

    def bind(self, backends):
        """The job's running backends (the dispatcher calls this once every backend started)."""
        self._backends = backends

    def enabled(self, meta):
        return False   # row-sparse tensors only

    def _carrier(self, name, fallback):
        return self._backends.get(name) or self._backends[fallback]   # e.g. no switch in this job: the ring

    def allreduce(self, array, name):
        return self._carrier(self.hot_name, "ring").allreduce(array, name)

    def _split(self, name, nrows):
        split = self._tensors.get(name)
        if split is None or split.window.size != nrows:
            split = self._tensors[name] = _Split(nrows)
        return split

    @staticmethod
    def _is_hot(hot, rows):
        """(position of each row in the sorted hot set, whether it is hot)."""
        at = np.searchsorted(hot, rows)
        is_hot = np.zeros(rows.size, dtype=bool)
        inside = at < hot.size
        is_hot[inside] = hot[at[inside]] == rows[inside]
        return at, is_hot

    def plan_stats(self, name, rows, nrows, cold_stats):
        """What commlib.traffic needs from this rank to weigh the split for a tensor of unique `rows`
        now: the agreed hot set's size (0 before the first window ends) and this rank's cold rows;
        `cold_stats(cold rows)` gives the cold carrier's own stats when it is omnireduce."""
        split = self._tensors.get(name)
        hot = split.hot if split is not None and split.window.size == nrows else np.empty(0, np.int64)
        cold = rows[~self._is_hot(hot, rows)[1]]
        out = {"hot_k": int(hot.size), "hot": self._carrier(self.hot_name, "ring").name,
               "cold_algorithm": self._carrier(self.cold_name, "sparse_allgather").name, "cold": int(cold.size)}
        if out["cold_algorithm"] == "omnireduce":
            out["omnireduce"] = cold_stats(cold)
        return out

    def allreduce_rows(self, rows, values, nrows, name, counts=None):
        split = self._split(name, nrows)
        width, hot = values.shape[1], split.hot
        at, is_hot = self._is_hot(hot, rows)
        hot_sum = None
        if hot.size:   # every rank sends the whole slab (the hot set is the same everywhere), beside the cold rows
            slab = np.zeros((hot.size, width + 1), dtype=values.dtype)
            slab[at[is_hot], :width] = values[is_hot]
            slab[at[is_hot], width] = 1
            hot_sum = self._pool.submit(self._carrier(self.hot_name, "ring").allreduce, slab.reshape(-1),
                                        f"{name}.hot")
        # no hot rows yet: the cold rows are all rows, whose counts the negotiation carried
        out_rows, out_values = reduce_rows(self._carrier(self.cold_name, "sparse_allgather"), rows[~is_hot],
                                           values[~is_hot], nrows, f"{name}.cold", None if hot.size else counts)
        if hot_sum is not None:
            summed = hot_sum.result().reshape(hot.size, width + 1)
            present = summed[:, width] > 0.5
            out_rows = np.concatenate([out_rows, hot[present]])
            out_values = np.concatenate([out_values, summed[present, :width].astype(values.dtype, copy=False)])
            order = np.argsort(out_rows, kind="stable")
            out_rows, out_values = out_rows[order], out_values[order]
        self._count(split, name, rows, is_hot, width, values.dtype.itemsize)
        return out_rows, out_values

    def observe(self, rows, nrows, name, width, itemsize):
        """Count a tensor another algorithm reduced (auto weighs the split, and chose otherwise this
        time): the window goes on, and ends with the same agreement on every rank, so auto knows
        the hot set when it weighs the split again. Collective at the window's end, like the call."""
        split = self._split(name, nrows)
        self._count(split, name, rows, self._is_hot(split.hot, rows)[1], width, itemsize)

    def _count(self, split, name, rows, is_hot, width, itemsize):
        split.window[rows] += 1   # rows are unique (coalesced by the core)
        split.calls += 1
        split.last = {"hot_k": int(split.hot.size), "hot_share": split.hot_share, "hot_rows": int(is_hot.sum()),
                      "cold_rows": int((~is_hot).sum()), "agreements": split.agreements}
        if split.calls % self.every == 0:
            self._agree(split, name, width, itemsize)

    def _agree(self, split, name, width, itemsize):
        """Sum the window's counts over ranks and take the same hot set everywhere."""
        touched = np.flatnonzero(split.window)
        counts = split.window[touched].astype(np.int64).reshape(-1, 1)
        rows, counts = self._backends["sparse_allgather"].allreduce_rows(touched, counts, split.window.size,
                                                                          f"{name}.counts.{split.agreements}")
        counts = counts.reshape(-1)
        order = np.lexsort((rows, -counts))   # most updated first, ties: the lower row
        cumulative = np.cumsum(counts[order])
        total = int(cumulative[-1]) if cumulative.size else 0
        if self.k:
            k = min(self.k, rows.size)
        elif self.rule == "traffic":
            # a row touched by a rank with probability p costs the allgather (N-1) p (index + row bytes)
            # per worker and step, and its slab slot (width + 1) values each way, touched or not
            p = counts[order] / (self.size * self.every)
            row = index_dtype(split.window.size).itemsize + width * itemsize
            k = int(np.count_nonzero((self.size - 1) * p * row > (width + 1) * itemsize))
        else:
            k = int(np.searchsorted(cumulative, self.share * total)) + 1 if total else 0
        k = min(k, self.max_k, rows.size)
        split.hot = np.sort(rows[order[:k]])
        split.hot_share = float(cumulative[k - 1] / total) if k else 0.0
        split.counts = coalesce(rows, counts)
        split.window[touched] = 0   # only what was touched: a large table stays untouched (lazily zeroed) memory
        split.agreements += 1

    def row_record(self, name):
        """What commlib.records() shows for a tensor this backend reduced last."""
        split = self._tensors.get(name)
        return dict(split.last) if split is not None else {}

    def counts(self, name):
        """(rows, update counts summed over ranks) of the last finished window of tensor `name`."""
        split = self._tensors.get(name)
        return split.counts if split is not None else None

    def close(self):
        self._pool.shutdown(wait=True)

    def stats(self):
        return {name: dict(split.last, calls=split.calls) for name, split in self._tensors.items()}

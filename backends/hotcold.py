"""Hot/cold split of row-sparse gradients (the IMC'20 study's proposal): a few rows take most updates.

Per tensor, every rank counts how often it touches each row over a window of `hotcold_every`
calls; at the window's end the ranks sum their counts (one allgather of the touched rows' counts,
inside the same negotiated call: no extra round, no pause of other tensors) and all take the same
hot set, the K most updated rows (ties: the lower row). From the next call on, the rows outside
the hot set go through `hotcold_cold` (the sparse allgather, or omnireduce's row blocks) and beside
them the hot rows through `hotcold_hot` (switchml: summed in the network, no indices on the wire;
the ring: before the cold rows, as two collectives at once on one engine could pair differently on
each rank), in one of two ways:
  - one round (the default): ONE dense slab of all K hot rows, each with a presence count (so the
    union survives a zero sum), touched or not;
  - with `hotcold_presence`, two rounds: first every rank's bit-packed count of the hot rows it
    touched (N's bit length a row, several rows to an int32, so the sum never carries: K bits/8
    bytes each way), then a slab of only the hot rows two or more ranks touched (no indices, no
    presence column), while the hot rows only one rank touched join that rank's cold rows. A row
    several ranks touched reaches each worker once, where the allgather carries every copy, and a
    hot row nobody touched costs only its count: within 7-13% of the bytes no exact algorithm goes
    below (commlib.traffic's bound) on bench_sparse's Zipf workloads, against 20-30% in one round.
    The price is the extra round: worth it where the link, not latency or the CPUs, bounds the
    call (benchmarks/RESULTS.md "sparse_100mbit" against "sparse").
The result is the union of the rows, summed, as the plain sparse sum. Before the first window
ends every row is cold: it is short (FIRST_WINDOW calls), a rough hot set early.

Tuning guide
  hotcold_k        hot rows per tensor; 0 picks them from the last window's counts (at most
                   hotcold_max_k): with hotcold_rule=share the fewest rows that carried `hotcold_share`
                   of the updates, with hotcold_rule=traffic every row whose expected saving beats
                   what it costs: a row a rank touches with probability p reaches a worker from
                   m ~ Binomial(N-1, p) other ranks, m copies by the allgather (index + row bytes
                   each); in one round its slab slot costs (width + 1) values whether touched or
                   not (hot when (N-1) p (index + row) is more), with presence counts the slab
                   carries it once when some other rank touched it and its count costs bits/8
                   (hot when ((N-1) p - 1 + (1-p)^(N-1)) (index + row) is more). Worth it where rows
                   are shared (Zipf-like ids): the allgather carries each once per rank touching it.
  hotcold_presence the two-round form above: fewer bytes, one more round.
  hotcold_every    the window, in calls per tensor (the first: at most FIRST_WINDOW): shorter follows
                   a drifting skew, longer costs fewer count exchanges (each: touched rows x 16 bytes
                   per rank).

records() shows per tensor `hot_k`, `hot_share` (of the last window's updates the hot set carried),
this call's `hot_rows` (this rank's rows in the hot set), `slab_rows` (the rows the slab carried)
and `cold_rows` (what this rank sent the cold carrier); `counts(name)` gives
the last window's summed per-row counts (the skew plot of benchmarks/bench_sparse.py).
"""
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from commlib import traffic
from commlib.backends import Backend, carriers, register, registry
from commlib.errors import ConfigError
from commlib.settings import define
from commlib.sparse import coalesce, index_dtype, presence_bits, presence_words, reduce_rows, sketch

define("hotcold_k", 0, "hot/cold split: hot rows per tensor; 0 = chosen from the window's counts by hotcold_rule")
define("hotcold_rule", "share", "hot/cold split with hotcold_k=0: 'share' (the fewest rows carrying hotcold_share of "
       "updates) or 'traffic' (every row whose expected saving over the allgather beats its cost in the slab)")
define("hotcold_share", 0.5, "hot/cold split with hotcold_rule=share: the share of the window's updates the hot set carries")
define("hotcold_max_k", 65536, "hot/cold split: at most this many hot rows per tensor")
define("hotcold_every", 20, "hot/cold split: calls per tensor in a counting window; the hot set is re-agreed after each")
define("hotcold_presence", False, "hot/cold split: a round of bit-packed presence counts first, then a slab of only the "
       "hot rows two or more ranks touched (fewer bytes, one more round: for link-bound calls)")
define("hotcold_hot", "switchml", "hot/cold split: the algorithm summing the slab and any presence counts (switchml or ring)")
define("hotcold_cold", "sparse_allgather", "hot/cold split: the algorithm for cold rows (sparse_allgather or omnireduce)")

F32 = np.dtype("float32")
FIRST_WINDOW = 4   # calls: the first window is short, a hot set early (refined by each full window after)


class _Split:
    """One tensor's state: the agreed hot set and this window's local counts."""

    def __init__(self, nrows):
        self.hot = np.empty(0, dtype=np.int64)     # sorted, the same on every rank
        self.window = np.zeros(nrows, dtype=np.int32)
        self.calls = self.window_calls = self.agreements = 0   # calls: in all, in this window; windows agreed
        self.hot_share = 0.0                       # of the last window's updates, carried by `hot`
        self.counts = (np.empty(0, np.int64), np.empty(0, np.int64))   # last window, summed over ranks
        self.last = {}


@register
class HotColdBackend(Backend):
    name = "hotcold"
    ops = ("sum",)
    dtypes = (F32,)
    carries = {"rows": 30}   # last: before its first window of counts it costs what its cold carrier does

    @classmethod
    def available(cls, ctx):
        if ctx.engine is None:
            return False, "no collective engine (Horovod, MPI or torch.distributed) in this job"
        return True, ""

    def __init__(self, ctx):
        super().__init__(ctx)
        s = ctx.settings
        self.k, self.share, self.max_k = int(s.hotcold_k), float(s.hotcold_share), int(s.hotcold_max_k)
        self.every, self.rule, self.presence = int(s.hotcold_every), s.hotcold_rule, bool(s.hotcold_presence)
        if self.rule not in ("share", "traffic"):
            raise ConfigError(f"hotcold_rule={self.rule!r}: use 'share' or 'traffic'")
        self.hot_name, self.cold_name = s.hotcold_hot, s.hotcold_cold
        if self.k < 0 or self.max_k < 1 or not 0 < self.share <= 1 or self.every < 1:
            raise ConfigError(f"hotcold: k={self.k} (>= 0), max_k={self.max_k} (>= 1), share={self.share} (in (0, 1]) "
                              f"and every={self.every} (>= 1) are out of range")
        cold_carriers = [name for name in carriers("rows") if name != self.name]
        if self.hot_name not in carriers("dense") or self.cold_name not in cold_carriers:
            raise ConfigError(f"hotcold: hot={self.hot_name!r} must be one of {list(carriers('dense'))}, "
                              f"cold={self.cold_name!r} one of {cold_carriers}")
        self._backends = {}
        self._tensors = {}
        # the slab's collective runs beside the cold rows' where their carriers run apart (_slab_sum); the
        # executor calls one backend at a time, so nothing else uses the hot carrier meanwhile
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hotcold-slab")

    def tune(self, values):
        """autotune's hotcold_share (the share of the window's updates the hot set carries: its K, with
        hotcold_rule=share and no fixed hotcold_k), taken at once from the last window's counts, the
        same on every rank; and hotcold_every (the window): a window under way ends when its calls
        reach the new one."""
        share = values.get("hotcold_share", self.share)
        if share != self.share:
            self.share = share
            if not self.k and self.rule == "share":
                for split in self._tensors.values():
                    if split.agreements:
                        self._choose(split)
        self.every = values.get("hotcold_every", self.every)

    def bind(self, backends):
        """The job's running backends (the dispatcher calls this once every backend started)."""
        self._backends = backends

    def enabled(self, meta):
        return False   # row-sparse tensors only

    def _hot(self):
        return self._backends.get(self.hot_name) or self._backends["ring"]   # e.g. no switch in this job

    def _cold(self):
        return self._backends.get(self.cold_name) or self._backends["sparse_allgather"]

    def allreduce(self, array, name):
        return self._hot().allreduce(array, name)

    def learning(self, name, shape):
        """Until its first window ends a tensor has no hot set: every row goes cold (a resized table's
        rows start anew: _split)."""
        split = self._tensors.get(name)
        return split is None or split.window.size != shape[0] or not split.agreements

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

    @classmethod
    def traffic(cls, stats):
        """The slab (and presence counts) through its hot carrier, plus the cold rows through theirs."""
        split = [s[cls.name] for s in stats]
        mine = split[0]
        slab, cold = traffic.hot_slab(split, stats[0])
        hot = registry()[mine["hot"]].dense_traffic(slab, len(stats))
        carrier = registry()[mine["cold_algorithm"]]
        cold_stats = [{**s, "rows": rows, carrier.name: part.get(carrier.name)} for s, part, rows in zip(stats, split, cold)]
        carried = carrier.traffic(cold_stats)
        return {"up": hot + carried["up"], "down": hot + carried["down"], "hot_k": mine["hot_k"]}

    def row_stats(self, name, rows, nrows, width):
        """The agreed hot set's size (0 before the first window ends), the form of the slab, this
        rank's hot rows (their count and sketch: with presence counts, whether others touch them
        too decides slab or cold), its other rows, and the cold carrier's own stats of those."""
        split = self._tensors.get(name)
        hot = split.hot if split is not None and split.window.size == nrows else np.empty(0, np.int64)
        is_hot = self._is_hot(hot, rows)[1]
        cold = self._cold()
        out = {"hot_k": int(hot.size), "presence": self.presence, "hot": self._hot().name,
               "cold_algorithm": cold.name, "cold": int((~is_hot).sum())}
        if self.presence:
            out.update(hot_rows=int(is_hot.sum()), hot_sketch=sketch(rows[is_hot]))
        own = cold.row_stats(name, rows[~is_hot], nrows, width)
        if own is not None:
            out[cold.name] = own
        return out

    def _slab_sum(self, carrier, cold_carrier, slab, name):
        """A Future of the slab's sum: beside the cold rows where the two carriers run apart, else done
        first, here. Gloo and MPI pair an engine's collectives by call order, so two threads must never
        call it at once: the ring goes beside only a cold carrier off the engine, and a carrier off it
        beside one on it runs apart (Backend.allreduce_apart: a None result is summed after the cold rows)."""
        if carrier is cold_carrier or (carrier.on_engine and cold_carrier.on_engine):
            done = Future()
            done.set_result(carrier.allreduce(slab, name))
            return done
        return self._pool.submit(carrier.allreduce if carrier.on_engine else carrier.allreduce_apart, slab, name)

    def allreduce_rows(self, rows, values, nrows, name, counts=None):
        split = self._split(name, nrows)
        hot = split.hot
        at, is_hot = self._is_hot(hot, rows)
        carrier, cold_carrier = self._hot(), self._cold()
        cold, pending, slab_rows = ~is_hot, None, 0
        if hot.size:
            slab, finish = (self._shared_slab(carrier, at, is_hot, cold, values, hot, name) if self.presence
                            else self._full_slab(at, is_hot, values, hot))
            slab_rows = slab.shape[0]
            if slab_rows:   # beside the cold rows where the two run apart (their own sockets), else first
                pending = self._slab_sum(carrier, cold_carrier, slab.reshape(-1), f"{name}.hot")
        # no hot rows yet: the cold rows are all rows, whose counts the negotiation carried
        try:
            out_rows, out_values = reduce_rows(cold_carrier, rows[cold], values[cold], nrows, f"{name}.cold",
                                               None if hot.size else counts)
        except BaseException:   # the slab's collective ends before the error goes on (its carrier is used next)
            if pending is not None:
                pending.exception()
            raise
        if pending is not None:
            summed = pending.result()
            if summed is None:   # it needs the engine after all (switchml's range fallback): free now
                summed = carrier.allreduce_on_engine(slab.reshape(-1), f"{name}.hot")
            hot_rows, hot_values = finish(summed)
            out_rows = np.concatenate([out_rows, hot_rows])
            out_values = np.concatenate([out_values, hot_values.astype(values.dtype, copy=False)])
            order = np.argsort(out_rows, kind="stable")
            out_rows, out_values = out_rows[order], out_values[order]
        self._count(split, name, rows, is_hot, values.shape[1], values.dtype.itemsize, slab_rows, int(cold.sum()))
        return out_rows, out_values

    @staticmethod
    def _full_slab(at, is_hot, values, hot):
        """(slab, finish): every hot row with its presence count (width + 1 values), touched or not;
        finish(summed) gives the (rows, values) some rank touched."""
        slab = np.zeros((hot.size, values.shape[1] + 1), dtype=values.dtype)
        slab[at[is_hot], :-1] = values[is_hot]
        slab[at[is_hot], -1] = 1

        def finish(summed):
            summed = summed.reshape(hot.size, -1)
            present = summed[:, -1] > 0.5
            return hot[present], summed[present, :-1]
        return slab, finish

    def _shared_slab(self, carrier, at, is_hot, cold, values, hot, name):
        """(slab, finish) after a round of presence counts: the hot rows two or more ranks touched, in
        hot-set order (the same everywhere); the hot rows only this rank touched are marked `cold`."""
        touched = self._presence(carrier, at[is_hot], hot.size, f"{name}.presence")
        shared = np.flatnonzero(touched >= 2)
        cold[is_hot] = touched[at[is_hot]] == 1
        mine = is_hot & ~cold
        slab = np.zeros((shared.size, values.shape[1]), dtype=values.dtype)
        slab[np.searchsorted(shared, at[mine])] = values[mine]
        return slab, lambda summed: (hot[shared], summed.reshape(shared.size, -1))

    def _presence(self, carrier, positions, k, name):
        """How many ranks touched each of the k hot rows (this rank: those at `positions`, unique),
        from one int32 sum of bit-packed counts: presence_bits(N) bits a row, so none carries."""
        bits = presence_bits(self.size)
        per = 32 // bits
        words = np.zeros(presence_words(k, self.size), dtype=np.uint32)
        np.bitwise_or.at(words, positions // per, np.left_shift(1, bits * (positions % per)).astype(np.uint32))
        summed = carrier.allreduce(words.view(np.int32), name).view(np.uint32)
        every = np.arange(k)
        return (summed[every // per] >> (bits * (every % per)).astype(np.uint32)) & np.uint32((1 << bits) - 1)

    def observe(self, rows, nrows, name, width, itemsize):
        """Count a tensor another algorithm reduced (auto weighs the split, and chose otherwise this
        time): the window goes on, and ends with the same agreement on every rank, so auto knows
        the hot set when it weighs the split again. Collective at the window's end, like the call."""
        split = self._split(name, nrows)
        self._count(split, name, rows, self._is_hot(split.hot, rows)[1], width, itemsize)

    def _count(self, split, name, rows, is_hot, width, itemsize, slab_rows=0, cold_rows=None):
        split.window[rows] += 1   # rows are unique (coalesced by the core)
        split.calls += 1
        split.window_calls += 1
        split.last = {"hot_k": int(split.hot.size), "hot_share": split.hot_share, "hot_rows": int(is_hot.sum()),
                      "slab_rows": int(slab_rows), "cold_rows": int((~is_hot).sum()) if cold_rows is None else cold_rows,
                      "agreements": split.agreements}
        window = self.every if split.agreements else min(self.every, FIRST_WINDOW)
        if split.window_calls >= window:   # >=: autotune may shorten the window under way (tune)
            self._agree(split, name, width, itemsize)

    def _agree(self, split, name, width, itemsize):
        """Sum the window's counts over ranks and take the same hot set everywhere."""
        touched = np.flatnonzero(split.window)
        counts = split.window[touched].astype(np.int64).reshape(-1, 1)
        rows, counts = self._backends["sparse_allgather"].allreduce_rows(touched, counts, split.window.size,
                                                                          f"{name}.counts.{split.agreements}")
        split.counts = coalesce(rows, counts.reshape(-1))
        k = self.k or None
        if k is None and self.rule == "traffic":
            # a row a rank touches with probability p reaches a worker from m ~ Binomial(N-1, p) other
            # ranks, m copies by the allgather; in one round its slab slot costs (width + 1) values,
            # touched or not; with presence counts the slab carries it once (E[m - 1; m >= 1] copies
            # saved) and its count costs bits/8 bytes, each way
            p = split.counts[1] / (self.size * split.window_calls)
            row = index_dtype(split.window.size).itemsize + width * itemsize
            if self.presence:
                saved = ((self.size - 1) * p - 1 + (1 - p) ** (self.size - 1)) * row
                k = int(np.count_nonzero(saved > presence_bits(self.size) / 8))
            else:
                k = int(np.count_nonzero((self.size - 1) * p * row > (width + 1) * itemsize))
        self._choose(split, k)
        split.window[touched] = 0   # only what was touched: a large table stays untouched (lazily zeroed) memory
        split.window_calls, split.agreements = 0, split.agreements + 1

    def _choose(self, split, k=None):
        """The hot set: the k rows the last window updated most (split.counts, summed over ranks; ties:
        the lower row), by default the fewest that carry `share` of its updates."""
        rows, counts = split.counts
        order = np.lexsort((rows, -counts))
        cumulative = np.cumsum(counts[order])
        total = int(cumulative[-1]) if cumulative.size else 0
        if k is None:
            k = int(np.searchsorted(cumulative, self.share * total)) + 1 if total else 0
        k = min(k, self.max_k, rows.size)
        split.hot = np.sort(rows[order[:k]])
        split.hot_share = float(cumulative[k - 1] / total) if k else 0.0

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
        # the names copied at once: the executor adds a tensor's split meanwhile (commlib.backend_stats())
        return {name: dict(split.last, calls=split.calls) for name, split in list(self._tensors.items())}

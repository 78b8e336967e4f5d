"""Row-sparse tensors (torch sparse COO gradients) through every algorithm, across real processes
with hard timeouts, against the dense reference; the traffic model behind `auto` for them."""
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from commlib import analyze, dispatch, sparse, timeline, traffic
from commlib.backends.hotcold import FIRST_WINDOW, HotColdBackend
from commlib.backends.omnireduce import block_mask
from launch import spawn

# switchml quantizes (its bound, relative to the largest value); the others sum in float32
TOLERANCE = {"switchml": 1e-4}


@pytest.mark.multiprocess
@pytest.mark.parametrize("nprocs", [2, pytest.param(4, marks=pytest.mark.long)])
def test_every_algorithm_returns_the_coalesced_union_equal_to_the_dense_sum(nprocs):
    """Random and Zipf ids, repeated ids within a rank, empty gradients on some ranks and on all,
    rows touched by one rank only, dense trailing dims, sparse_dim 2: each algorithm's result is a
    coalesced sparse tensor holding exactly the union of the rows sent, equal to the dense sum."""
    reports = spawn(nprocs, "sparse_allreduce.py", timeout=300).check().results()
    for result in reports:
        assert result["size"] == nprocs
        assert len(result["cases"]) == 8 * 5, sorted(result["cases"])
        for name, got in result["cases"].items():
            requested = name.rsplit(".", 1)[1]
            assert got["sparse"] and got["coalesced"] and got["union"], (result["rank"], name, got)
            assert got["union_rows"] == got["expected_union_rows"], (result["rank"], name, got)
            bound = TOLERANCE.get(got["algorithm"], 1e-6) * max(1.0, got["scale"])
            assert got["max_diff"] <= bound, (result["rank"], name, got)
            assert requested == "auto" or got["algorithm"] == requested, (name, got)
        assert result["average_diff"] <= 1e-6, result


# -- the traffic model: constructed cases where each algorithm is the cheapest ----------------------
def stats(rank_rows, nrows=100_000, width=32, block=256, rows_per_block=1, columns=512, hot=None, presence=False):
    """What each rank's dispatcher would submit for these row sets (commlib.dispatch._row_stats);
    `hot`: the agreed hot set, for hotcold's (a slab through switchml, the cold rows gathered;
    `presence`: with its round of presence counts)."""
    slots = sparse.RowSlots(nrows, width, block, rows_per_block)
    out = []
    for rows in rank_rows:
        rows = np.unique(np.asarray(rows, dtype=np.int64))
        out.append({"rows": int(rows.size), "sketch": sparse.sketch(rows), "nrows": nrows, "width": width,
                    "itemsize": 4, "omnireduce": traffic.omnireduce_stats(slots, rows, columns)})
        if hot is not None:
            mine = np.intersect1d(rows, hot)
            out[-1]["hotcold"] = {"hot_k": len(hot), "presence": presence, "hot": "switchml",
                                  "cold_algorithm": "sparse_allgather",
                                  "cold": int(rows.size - mine.size), "hot_rows": int(mine.size),
                                  "hot_sketch": sparse.sketch(mine)}
    return out


CANDIDATES = ["sparse_allgather", "omnireduce", "switchml"]


def test_few_scattered_rows_go_to_the_allgather():
    g = np.random.default_rng(0)
    est = dispatch.estimate_traffic(stats([g.choice(100_000, 200, replace=False) for _ in range(4)]), CANDIDATES)
    assert est["choice"] == "sparse_allgather", est
    assert est["sparse_allgather"]["up"] == 3 * (8 + 200 * (4 + 128))   # (N-1) P_max, int32 indices
    assert 780 <= est["union_rows"] <= 820, est   # 800 disjoint-ish rows, from the sketches


def test_rows_shared_by_every_rank_in_whole_blocks_go_to_omnireduce():
    """8 ranks touch the same 7000 consecutive rows: the allgather carries them 7 times to each."""
    rows = np.arange(7000)
    est = dispatch.estimate_traffic(stats([rows] * 8), CANDIDATES)
    assert est["choice"] == "omnireduce", est
    assert est["omnireduce"]["up"] < est["sparse_allgather"]["up"], est


def test_most_rows_touched_go_dense():
    g = np.random.default_rng(1)
    est = dispatch.estimate_traffic(stats([g.choice(100_000, 90_000, replace=False) for _ in range(4)]), CANDIDATES)
    assert est["choice"] == "switchml", est
    assert est["switchml"]["up"] == 100_000 * 33 * 4


def test_one_touched_row_costs_one_row_in_omnireduce():
    """Scattered rows of 32 values: omnireduce's row blocks move a row and a header (MAC and, in a
    result, stamp) per touched row
    (the job's 256-element blocks moved 7 rows per touched row). A worker receives the union's
    rows and, for the quarter of columns its colocated aggregator serves, the others' rows; a
    quarter of each stays on the host (its own aggregator's)."""
    g = np.random.default_rng(2)
    ranks = [g.choice(100_000, 2000, replace=False) for _ in range(4)]
    one = dispatch.estimate_traffic(stats(ranks), ["omnireduce"])["omnireduce"]
    whole = dispatch.estimate_traffic(stats(ranks, rows_per_block=0), ["omnireduce"])["omnireduce"]
    # a result's bytes besides the row, as switch/csrc/omnireduce.h lays a packet out: the 40-byte
    # header, the MAC (8-byte nonce counter, 16-byte tag), the 12-byte stamp
    overhead = 40 + 24 + 12
    rows = (8000 + 2000) * 3 / 4 * (33 * 4 + overhead)   # ~disjoint: union 8000
    assert rows < one["down"] < 1.1 * rows, one
    assert whole["down"] > 3 * one["down"], (one, whole)   # 7 rows a block: 8000 rows touch ~5300 blocks


def hot_and_cold(case, ranks=4, hot_rows=1000, seed=0):
    """Each rank's rows: 'skewed', the same 1000 hot rows and 50 scattered ones; 'uniform', 1000
    scattered rows; and the hot set the window agreed on (skewed: the hot rows; uniform: what
    the share rule takes from counts of about 1 each, half the window's rows)."""
    g = np.random.default_rng(seed)
    if case == "skewed":
        hot = np.sort(g.choice(100_000, hot_rows, replace=False))
        return [np.union1d(hot, g.choice(100_000, 50, replace=False)) for _ in range(ranks)], hot
    window = np.unique(g.choice(100_000, 2 * ranks * 1000))
    return [g.choice(100_000, 1000, replace=False) for _ in range(ranks)], np.sort(window[:window.size // 2])


def hot_cold_bytes(ranks, hot, width=32):
    """The split's bytes each way per worker, counted from the row sets themselves: the presence
    counts, the hot rows two or more ranks touched (the slab), and the padded allgather of each
    rank's other rows (outside the hot set, or hot and its own alone)."""
    touched = np.bincount(np.concatenate([np.intersect1d(r, hot) for r in ranks]).astype(np.int64), minlength=100_000)
    presence = sparse.presence_words(len(hot), len(ranks)) * 4
    cold = max(np.count_nonzero(~np.isin(r, hot) | (touched[r] == 1)) for r in ranks)
    return presence + np.count_nonzero(touched >= 2) * width * 4 + (len(ranks) - 1) * sparse.payload_bytes(
        cold, width * 4, 100_000)


def test_hot_cold_is_chosen_where_a_few_rows_take_most_updates_only():
    """Skewed: the slab carries the shared rows once, the allgather only the few cold ones, far
    cheaper than the allgather or omnireduce; uniform: the slab of last window's rows is wasted
    (fresh rows are cold again), so the allgather stays the choice; no hot set yet: a tie that
    the allgather wins by order."""
    algorithms = ["sparse_allgather", "omnireduce", "hotcold", "switchml"]
    ranks, hot = hot_and_cold("skewed")
    est = dispatch.estimate_traffic(stats(ranks, hot=hot), algorithms)
    assert est["choice"] == "hotcold", est
    slab, cold = 1000 * 33 * 4, max(np.setdiff1d(r, hot).size for r in ranks)
    gathered = 3 * (8 + -(-cold * 4 // 8) * 8 + cold * 128)   # int32 indices padded to 8 bytes
    assert est["hotcold"] == {"hot_k": 1000, "up": slab + gathered, "down": slab + gathered}
    ranks, hot = hot_and_cold("uniform")
    est = dispatch.estimate_traffic(stats(ranks, hot=hot), algorithms)
    assert est["choice"] == "sparse_allgather", est
    assert est["hotcold"]["up"] > 2 * est["sparse_allgather"]["up"], est
    est = dispatch.estimate_traffic(stats(ranks, hot=[]), algorithms)
    assert est["choice"] == "sparse_allgather" and est["hotcold"]["up"] == est["sparse_allgather"]["up"], est


def test_presence_counts_bring_hot_cold_to_the_bytes_the_rows_need():
    """With hotcold_presence. Skewed: the slab carries the shared rows once (no presence column: 4
    ranks' counts take 3 bits, 10 rows an int32), the allgather only the few cold ones, within 1%
    of the bound; uniform: last window's hot rows are fresh rows that mostly one rank touches, so
    they go cold and the split costs about the allgather plus the presence counts: the allgather
    stays the choice. The model, from sketches, is within 1% of the bytes counted from the rows
    themselves."""
    algorithms = ["sparse_allgather", "omnireduce", "hotcold", "switchml"]
    ranks, hot = hot_and_cold("skewed")
    est = dispatch.estimate_traffic(stats(ranks, hot=hot, presence=True), algorithms)
    assert est["choice"] == "hotcold", est
    exact = hot_cold_bytes(ranks, hot)
    assert exact < est["sparse_allgather"]["up"] / 2.5 and exact < 1.01 * est["bound"], (exact, est)
    assert est["hotcold"]["up"] == est["hotcold"]["down"] and abs(est["hotcold"]["up"] - exact) < 0.01 * exact, (exact, est)
    ranks, hot = hot_and_cold("uniform")
    est = dispatch.estimate_traffic(stats(ranks, hot=hot, presence=True), algorithms)
    assert est["choice"] == "sparse_allgather", est
    exact = hot_cold_bytes(ranks, hot)
    assert est["sparse_allgather"]["up"] < exact < est["sparse_allgather"]["up"] * 1.01, (exact, est)
    assert abs(est["hotcold"]["up"] - exact) < 0.01 * exact, (exact, est)


def test_union_estimate_is_within_a_few_percent():
    sets = [np.arange(r * 500, r * 500 + 1000) for r in range(4)]   # union: 2500
    got = sparse.union_size([sparse.sketch(s) for s in sets], [1000] * 4)
    assert abs(got - 2500) < 0.05 * 2500, got
    others = sparse.others_union_sizes([sparse.sketch(s) for s in sets], [1000] * 4)
    exact = [np.unique(np.concatenate(sets[:r] + sets[r + 1:])).size for r in range(4)]   # 2000, 2500, 2500, 2000
    assert all(abs(g - e) < 0.05 * e for g, e in zip(others, exact)), (others, exact)
    assert sparse.others_union_sizes([sparse.sketch(sets[0])], [1000]) == [0.0]   # one rank needs nothing


def test_the_bound_is_the_rows_the_busiest_worker_cannot_do_without():
    """Disjoint rows: a worker needs every other rank's rows, so the allgather is within its index
    bytes of the bound; the same rows everywhere: each needs them once, where the allgather sends
    them N - 1 times; every model of a Zipf workload stays above it."""
    g = np.random.default_rng(3)
    disjoint = np.array_split(g.permutation(100_000)[:4000], 4)
    est = dispatch.estimate_traffic(stats(disjoint), CANDIDATES)
    assert abs(est["bound"] - 3000 * 128) < 0.05 * 3000 * 128, est
    assert est["sparse_allgather"]["down"] / est["bound"] < 1.1, est
    same = dispatch.estimate_traffic(stats([np.arange(0, 70_000, 10)] * 8), CANDIDATES)
    assert abs(same["bound"] - 7000 * 128) < 0.05 * 7000 * 128, same
    assert same["sparse_allgather"]["down"] / same["bound"] > 6.5, same
    weights = 1.0 / np.arange(1, 100_001) ** 1.1
    ranks = [np.unique(g.choice(100_000, 4096, p=weights / weights.sum())) for _ in range(8)]
    hot = np.sort(np.argsort(-np.bincount(np.concatenate(ranks), minlength=100_000))[:1500])
    zipf = dispatch.estimate_traffic(stats(ranks, hot=hot, presence=True), CANDIDATES + ["hotcold"])
    assert all(zipf[a]["down"] > zipf["bound"] for a in CANDIDATES + ["hotcold"]), zipf


@pytest.mark.parametrize("block, rows_per_block, tensor_block", [
    (None, 1, None), (5, 1, 4), (9, 1, 7), (64, 1, 7), (64, 3, 21), (64, 0, 63), (64, 100, 63), (20, 2, 14)])
def test_row_slots_round_trip_and_block_mask(block, rows_per_block, tensor_block):
    """The tensor's own block: rows_per_block whole rows (0 or too many: as many as fit the job's
    block), or one long row cut into the fewest equal blocks that hold it (7 = 4 + 4 - 1 pad); a
    presence count per row, and a block mask that marks exactly the blocks holding touched rows."""
    rows = np.array([0, 3, 4, 99], dtype=np.int64)
    values = np.arange(4 * 6, dtype=np.float32).reshape(4, 6) - 5   # a zero row sum stays present
    slots = sparse.RowSlots(100, 6, block, rows_per_block)
    assert slots.block == tensor_block
    flat, mask = slots.scatter(rows, values, np.float32)
    got_rows, got_values = slots.gather(flat)
    assert got_rows.tolist() == rows.tolist() and np.array_equal(got_values, values)
    if block is not None:
        touched = np.flatnonzero(block_mask(flat, slots.block))
        assert np.flatnonzero(mask).tolist() == touched.tolist()
        assert mask.sum() == (slots.group // slots.block) * np.unique(rows // slots.per_group).size


def test_coalesce_sums_repeats_in_order():
    rows, values = sparse.coalesce(np.array([5, 1, 5, 5]), np.array([[1.0], [2.0], [3.0], [4.0]]))
    assert rows.tolist() == [1, 5] and values.reshape(-1).tolist() == [2.0, 8.0]


# -- through commlib.torch.DistributedOptimizer, against plain Horovod in the same horovodrun job ----
@pytest.mark.multiprocess
@pytest.mark.parametrize("nprocs", [2, pytest.param(4, marks=pytest.mark.long)])
def test_distributed_optimizer_sparse_gradients_match_horovod(nprocs):
    """SGD (sparse and dense gradients) and SparseAdam (sparse only) through commlib.torch's optimizer
    equal plain Horovod's; the optimizer gets a sparse gradient; with sparse_as_dense the embedding
    travels dense (no row counts in its record), as Horovod densifies it."""
    import horovod.torch  # noqa: F401  built by `make install`: without it the suite fails, never skips
    from commlib.testing import results
    from launch import horovodrun
    out = horovodrun(nprocs, "sparse_optimizer.py", timeout=420)
    assert out.returncode == 0, out.stdout
    for result in results(out.stdout, nprocs):
        assert len(result["results"]) == 11, sorted(result["results"])
        for label, got in result["results"].items():
            kind, sparse_as_dense, policy = label.split("|")
            assert "error" not in got, (label, got)
            assert got["same_on_all_ranks"] and got["grad_sparse"], (label, got)
            assert got["max_diff_vs_horovod"] <= 1e-5, (label, got)
            algorithm, union_rows = got["embedding"]
            assert (union_rows is None) == (sparse_as_dense == "sparse_as_dense=1"), (label, got)
            named = policy.split(";")[0].split("=")[1]
            assert named == "auto" or algorithm == named, (label, got)
        skipped = result["skipped"]   # a rank without the embedding's gradient at a step: no rows, no failure
        assert skipped == {"grad_sparse": True, "same_on_all_ranks": True, "rows_are_rank0s": True}, result


@pytest.mark.multiprocess
def test_auto_picks_the_cheapest_algorithm_in_a_real_job():
    """4 ranks: few scattered rows -> sparse_allgather, the same rows everywhere -> omnireduce, most
    rows -> the dense table through switchml; records() shows the estimate the choice came from. A
    density rule settles on the row density (0.2% of rows: its algorithm; 90%: the next rule's)."""
    expected = {"few_scattered": "sparse_allgather", "shared_block_rows": "omnireduce", "most_rows": "switchml"}
    for result in spawn(4, "sparse_auto.py", timeout=300).check().results():
        for case, algorithm in expected.items():
            got = result["cases"][case]
            assert got["algorithm"] == algorithm == got["estimate"]["choice"], (case, got)
            costs = {a: max(got["estimate"][a]["up"], got["estimate"][a]["down"]) for a in expected.values()}
            assert costs[algorithm] == min(costs.values()), (case, costs)
            assert got["max_diff"] <= 1e-4 * 4, (case, got)   # switchml's quantization on sums of ~4
        assert result["rules"] == {"few_scattered": "sparse_allgather", "most_rows": "ring"}, result


@pytest.mark.multiprocess
def test_auto_weighs_hot_cold_once_a_window_agreed_on_a_hot_set():
    """4 ranks, the hot set agreed every 2 calls. Before the first window ends auto has no hot set
    to weigh (hotcold's estimate has hot_k 0 and loses the tie to the allgather) yet counts every
    call, whichever algorithm carried it; from then on the skewed tensor (1000 rows on every rank)
    goes to hotcold and the uniform one (fresh scattered rows) never does. Every result is the
    union of the rows, equal to the dense sum (switchml's quantization on the hot slab)."""
    env = {"COMMLIB_HOTCOLD_EVERY": "2", "COMMLIB_AUTO_TRIAL_SAMPLES": "0"}   # the model's own choices, no trials
    for result in spawn(4, "sparse_auto_hotcold.py", timeout=300, env=env).check().results():
        for case, steps in result["cases"].items():
            for step, got in enumerate(steps):
                est = got["estimate"]
                assert got["union"] and got["max_diff"] <= 1e-4 * 8, (case, step, got)   # sums of ~4 values
                assert got["algorithm"] == est["choice"] and got["skew"]["agreements"] == step // 2, (case, step, got)
                assert (est["hotcold"]["hot_k"] > 0) == (step >= 2), (case, step, est)
                assert (got["algorithm"] == "hotcold") == (case == "skewed" and step >= 2), (case, step, est)
                if step >= 2 and case == "uniform":
                    assert max(est["hotcold"]["up"], est["hotcold"]["down"]) > est["sparse_allgather"]["up"], est


# -- the hot/cold split ----------------------------------------------------------------------------
@pytest.mark.parametrize("ranks", [1, 2, 7, 8, 64])
def test_presence_counts_survive_the_int32_sum_of_every_rank(ranks):
    """Each rank packs its hot rows' counts presence_bits(N) bits a row; the int32 sum (wrapping, as
    switchml's) unpacks to how many ranks touched each row, also where every rank touched it (N = 8:
    a full nibble, the word's sign bit)."""
    g, k = np.random.default_rng(ranks), 1000
    shared = np.arange(0, k, 7)   # rows every rank touches
    positions = [np.union1d(g.choice(k, g.integers(0, k), replace=False), shared) for _ in range(ranks)]
    sent = []

    class Record:   # what each rank sends
        def allreduce(self, array, name):
            sent.append(array.copy())
            return np.zeros_like(array)

    class Sum:   # what every rank gets back: the int32 sum, wrapping
        def allreduce(self, array, name):
            return np.sum(sent, axis=0, dtype=np.int32)

    one = SimpleNamespace(size=ranks)
    for mine in positions:
        HotColdBackend._presence(one, Record(), mine, k, "t.presence")
    expected = np.bincount(np.concatenate(positions), minlength=k)
    for mine in positions:
        got = HotColdBackend._presence(one, Sum(), mine, k, "t.presence")
        assert np.array_equal(got, expected), np.flatnonzero(got != expected)[:10]
    assert expected.max() == ranks


def test_a_tuned_hot_share_chooses_the_hot_set_again_at_once_from_the_last_windows_counts():
    """autotune's hotcold_share: the new K from the counts every rank summed at the last agreement
    (no collective, the same on every rank), not a window later."""
    from commlib.settings import Settings
    backend = HotColdBackend(SimpleNamespace(rank=0, size=2, settings=Settings(environ={})))
    split = backend._split("t", 10)
    split.counts = (np.array([1, 3, 5, 7]), np.array([50, 30, 15, 5]))   # summed over ranks, by row
    split.agreements = 1
    backend._choose(split)
    assert split.hot.tolist() == [1], "share 0.5: the fewest rows carrying half the updates"
    backend.tune({"hotcold_share": 0.9})
    assert split.hot.tolist() == [1, 3, 5] and split.hot_share == 0.95, (split.hot, split.hot_share)
    backend.tune({"hotcold_share": 0.9, "hotcold_every": 3})
    assert backend.every == 3 and split.hot.tolist() == [1, 3, 5]



@pytest.mark.multiprocess
def test_a_hot_slab_beyond_the_switchs_range_goes_through_the_ring_after_the_cold_rows():
    """Rank 0's hottest row holds 2^127 at step 5 (after the first agreement): switchml flags the slab on
    every rank, which then takes the engine's ring once the cold rows' allgather is done (a ring
    beside that allgather, from two threads, would pair each rank's collectives differently: a hang)."""
    env = {"COMMLIB_HOTCOLD_EVERY": "3", "COMMLIB_HOTCOLD_HOT": "switchml", "COMMLIB_HOTCOLD_COLD": "sparse_allgather",
           "HUGE_STEP": "5"}
    for result in spawn(2, "sparse_hotcold.py", timeout=300, env=env).check().results():
        assert result["range_fallbacks"] == 1, result["range_fallbacks"]
        for step, got in enumerate(result["steps"]):   # the ring's sum is exact: 2^127 stays, the rest sums
            bound = 1e-4 * max(1.0, got["scale"]) if step != 5 else 1e-5
            assert got["union"] and got["max_diff"] <= bound, (step, got)
        assert result["steps"][5]["scale"] >= 2.0 ** 127 and result["steps"][5]["skew"]["slab_rows"] > 0, result["steps"][5]


def test_the_first_window_is_short_and_until_it_ends_auto_counts_no_trial_of_hotcold():
    """A hot set after FIRST_WINDOW calls, then one per full window; Backend.learning says whether the
    tensor has none yet (its calls then go all cold: not what a trial should measure)."""
    from commlib.settings import Settings
    settings = Settings(environ={"COMMLIB_HOTCOLD_EVERY": "10"})
    backend = HotColdBackend(SimpleNamespace(rank=0, size=2, settings=settings))
    agreed = []

    def agree(split, name, width, itemsize):   # the collective's stand-in: a window ends
        agreed.append(split.calls)
        split.agreements += 1
        split.window_calls = 0
    backend._agree = agree
    learning = []
    for _ in range(FIRST_WINDOW + 10):
        learning.append(backend.learning("t", (100, 4)))
        backend.observe(np.array([1, 2]), 100, "t", 4, 4)
    assert agreed == [FIRST_WINDOW, FIRST_WINDOW + 10], agreed
    assert learning == [True] * FIRST_WINDOW + [False] * 10, learning
    assert backend.learning("t", (120, 4)), "a resized table (an embedding grown by 20 rows) has no hot set yet"


class Carrier:
    """A one-rank stand-in for a hot or cold carrier: logs (its name, 'engine' or 'own', the thread) at
    each collective; `beyond_range`: as switchml on values beyond its quantization (allreduce_apart
    refuses them, allreduce_on_engine is the engine's ring)."""
    dtypes = (np.dtype("float32"),)

    def __init__(self, name, on_engine, calls, beyond_range=False):
        self.name, self.on_engine, self.calls, self.beyond_range = name, on_engine, calls, beyond_range
        self.carries = {"rows": 10} if name == "sparse_allgather" else {"dense": 10}

    def _log(self, where):
        self.calls.append((self.name, where, threading.current_thread().name))

    def allreduce(self, array, name):
        self._log("engine" if self.on_engine else "own")
        return array.copy()

    def allreduce_apart(self, array, name):
        if self.beyond_range:
            return None
        self._log("own")
        return array.copy()

    def allreduce_on_engine(self, array, name):
        self._log("engine")
        return array.copy()

    def allreduce_rows(self, rows, values, nrows, name, counts=None):
        self._log("engine" if self.on_engine else "own")
        return rows, values


@pytest.mark.parametrize("hot, beyond_range, slab_on", [("switchml", False, "hotcold-slab_0"),
                                                        ("switchml", True, "MainThread"),
                                                        ("ring", False, "MainThread")])
def test_the_slab_runs_beside_the_cold_rows_only_off_the_engine_they_use(hot, beyond_range, slab_on):
    """Gloo and MPI pair an engine's collectives by call order: the cold rows' allgather (on the engine)
    and the slab's sum never call it from two threads at once. switchml's slab runs beside them (its own
    sockets) unless its values are beyond its quantization: then its ring runs after the cold rows."""
    from commlib.settings import Settings
    calls = []
    backend = HotColdBackend(SimpleNamespace(rank=0, size=1, settings=Settings(environ={"COMMLIB_HOTCOLD_HOT": hot})))
    backend.bind({"switchml": Carrier("switchml", False, calls, beyond_range), "ring": Carrier("ring", True, calls),
                  "sparse_allgather": Carrier("sparse_allgather", True, calls)})
    backend._split("t", 10).hot = np.array([1, 2, 3])
    rows, values = np.array([2, 5, 7]), np.arange(12, dtype=np.float32).reshape(3, 4)
    out_rows, out_values = backend.allreduce_rows(rows, values, 10, "t")
    np.testing.assert_array_equal(out_rows, rows)
    np.testing.assert_array_equal(out_values, values)
    cold = ("sparse_allgather", "engine", "MainThread")
    slab = (hot, "engine" if hot == "ring" or beyond_range else "own", slab_on)
    assert sorted(calls) == sorted([cold, slab]), calls
    engine = [call for call in calls if call[1] == "engine"]
    assert all(thread == "MainThread" for *_, thread in engine), calls
    if beyond_range:
        assert engine == [cold, slab], f"the slab's ring ran before the cold rows' allgather was done: {calls}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("nprocs, hot, cold, presence", [(4, "switchml", "sparse_allgather", "0"),
                                                         (4, "switchml", "sparse_allgather", "1"),
                                                         (2, "ring", "omnireduce", "1"),
                                                         (4, "ring", "sparse_allgather", "0"),
                                                         (2, "ring", "sparse_allgather", "1")])
def test_hot_cold_split_equals_the_plain_sum_across_re_agreements(nprocs, hot, cold, presence, tmp_path):
    """Zipf ids, the hot set re-agreed every 3 calls (the hot rows carrying half the updates): every
    step's result is the union of the rows, equal to the dense sum (switchml: its quantization),
    with a one-round slab or presence counts first. With the timeline on, rank 0's trace holds each
    finished window's update counts (the skew)."""
    trace = tmp_path / "trace.{rank}.json"
    env = {"COMMLIB_HOTCOLD_EVERY": "3", "COMMLIB_HOTCOLD_HOT": hot, "COMMLIB_HOTCOLD_COLD": cold,
           "COMMLIB_HOTCOLD_PRESENCE": presence, "COMMLIB_TIMELINE": str(trace)}
    results = spawn(nprocs, "sparse_hotcold.py", timeout=300, env=env).check().results()
    rank0 = timeline.load(str(trace).replace("{rank}", "0"))
    windows = [e["args"] for e in rank0 if e["name"] == "UPDATE_COUNTS"]
    assert [w["tensor"] for w in windows] == ["embedding"] * 3, windows   # agreements after calls 3, 6, 9
    assert sum(windows[-1]["counts"]) == results[0]["counted_updates"], (windows[-1], results[0])
    assert not [e for e in timeline.load(str(trace).replace("{rank}", "1")) if e["name"] == "UPDATE_COUNTS"]
    assert 0.01 < analyze.skew_summary(rank0)["embedding"] <= 1.0   # the hottest 1% of rows' share
    for result in results:
        steps = result["steps"]
        for step, got in enumerate(steps):
            bound = (1e-4 if hot == "switchml" else 1e-6) * max(1.0, got["scale"])
            assert got["union"] and got["max_diff"] <= bound, (step, got)
            assert got["algorithm"] == "hotcold" and got["skew"]["agreements"] == step // 3, (step, got)
            assert (got["skew"]["hot_k"] > 0) == (step >= 3), (step, got)
            assert step < 3 or got["skew"]["hot_share"] >= 0.5, (step, got)
            assert got["skew"]["slab_rows"] <= got["skew"]["hot_k"], (step, got)
        assert sum(s["skew"]["hot_rows"] for s in steps) > 0 and sum(s["skew"]["slab_rows"] for s in steps) > 0, steps
        assert result["counted_updates"] == result["expected_updates"], result

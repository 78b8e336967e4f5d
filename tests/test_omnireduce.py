"""The omnireduce backend: N ranks as threads of this process (commlib.context.LocalGroup) over
loopback UDP, with colocated aggregator threads or dedicated aggregators (in-process endpoints or
`commlib-aggregator` processes).

Tolerances. int32 results are exact (wrapping like numpy's int32 sum). float32 blocks are added
by the aggregator in arrival order, so per element
    |omnireduce - exact| <= n * 2^-24 * sum_r |x_r|
(n-1 float32 additions, each rounding by at most 2^-24 of a partial sum bounded by sum_r |x_r|,
plus the final rounding). Integer-valued floats are exact in any order: the loss tests use them so
that lossy and lossless runs must agree to the bit.
"""
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from commlib.testing import LocalGroup
from commlib.errors import BackendUnavailable, CommError, CommTimeout, ConfigError, InvalidTensor, PeerFailure
from commlib.settings import Settings

import commlib.backends.omnireduce as om   # noqa: E402

if om.lib is None:   # not built: a failure of the suite, never a quiet skip
    raise ImportError(om.IMPORT_ERROR)
from commlib.switch import aggregator as agg_module, control, net   # noqa: E402
from commlib._native import lib                                   # noqa: E402
from commlib.switch.aggregator import Aggregator                   # noqa: E402
from commlib.switch import omnireduce_model as wire   # noqa: E402
from commlib.switch.omnireduce_model import paper_model, wire_model   # noqa: E402

pytestmark = pytest.mark.timeout(60)

DENSITIES = [0.0, 0.01, 0.1, 0.5, 1.0]


# dedicated keyless aggregators: a trusted fabric, where a job must say it runs without MACs
KEYLESS = {"omnireduce_mode": "dedicated", "authenticate": False}


def settings(**kw):
    return Settings({"timeout_s": 10.0, "omnireduce_retransmit_ms": 5.0, **kw})


def errors_of(fn):
    """fn(ctx) for LocalGroup.run where ranks are meant to fail: each rank's exception, or None."""
    def rank_main(ctx):
        try:
            fn(ctx)
        except Exception as exc:   # the test looks at every rank's
            return exc
        return None
    return rank_main


def started(ctx):
    """A backend as the core makes it on each rank: built (local work), then start() (collective)."""
    backend = om.OmniReduceBackend(ctx)
    backend.start()
    return backend


def run(n, work, join_timeout=45.0, token="local-test-token", **kw):
    """On each of n rank threads: start a backend (set-up is collective), run work(rank, backend),
    close it. Returns the per-rank results and the backends; raises the first error (a CommTimeout
    if a rank hangs: its backend stays open, closing it under that rank would free its state)."""
    group = LocalGroup(n, settings(**kw), job_token=token)
    backends = [None] * n

    def main(ctx):
        backend = backends[ctx.rank] = started(ctx)
        try:
            return work(ctx.rank, backend)
        finally:
            backend.close()                 # waits for every rank: others may need our aggregator

    return group.run(main, 30.0 + join_timeout), backends


def sparse_inputs(n, size, density, placement="independent", dtype=np.float32, block=32, seed=0):
    """Per-rank arrays with exactly round(density * blocks) non-zero blocks each (at least one
    when density > 0): the same blocks on every rank ("overlap") or drawn independently."""
    rng = np.random.default_rng(seed)
    nb = -(-size // block)
    k = 0 if density == 0 or nb == 0 else max(1, round(density * nb))
    shared = rng.choice(nb, k, replace=False)
    out = np.zeros((n, nb * block), dtype=dtype)
    for r in range(n):
        chosen = shared if placement == "overlap" else rng.choice(nb, k, replace=False)
        rows = out[r].reshape(nb, block)
        if dtype == np.int32:
            rows[chosen] = rng.integers(-2**31, 2**31, size=(k, block), dtype=np.int64).astype(np.int32)
        else:
            rows[chosen] = rng.standard_normal((k, block)).astype(np.float32)
        rows[chosen, 0] = 1 if dtype == np.int32 else 1.5      # every chosen block is really non-zero
    return out[:, :size].copy()


def check_sum(out, inputs):
    n = inputs.shape[0]
    if inputs.dtype == np.int32:
        assert out.dtype == np.int32
        np.testing.assert_array_equal(out, inputs.sum(axis=0, dtype=np.int32))
    else:
        assert out.dtype == np.float32
        exact = inputs.astype(np.float64).sum(axis=0)
        bound = n * 2.0 ** -24 * np.abs(inputs.astype(np.float64)).sum(axis=0)
        err = np.abs(out.astype(np.float64) - exact)
        assert (err <= bound).all(), f"max error {err.max()} beyond n*2^-24*sum|x| at {np.argmax(err - bound)}"


def workload():
    """(name, inputs-maker) for every density x placement x dtype."""
    cases = []
    for density in DENSITIES:
        for placement in ("independent", "overlap"):
            for dtype in (np.float32, np.int32):
                cases.append((f"{placement}-{density}-{np.dtype(dtype).name}", density, placement, dtype))
    return cases


# -- sums equal the dense sum ---------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["colocated", "dedicated"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_sums_equal_dense_sum(n, mode):
    """Densities 0/1%/10%/50%/100%, independent and overlapping placement, float32 and int32, one
    backend (and one set of aggregators) for all 20 tensors. 200 blocks in 16 columns: chains of
    up to 13 rounds, longer than the shadow sets (8), so acknowledgements gate the slots."""
    size = 200 * 32 - 5
    cases = [(name, sparse_inputs(n, size, d, p, t, seed=i)) for i, (name, d, p, t) in enumerate(workload())]

    def work(rank, backend):
        return [backend.allreduce(inputs[rank], name) for name, inputs in cases]

    results, backends = run(n, work, omnireduce_mode=mode, omnireduce_block_size=32, omnireduce_columns=16,
                            omnireduce_num_aggregators=3 if mode == "dedicated" else 0)
    for i, (name, inputs) in enumerate(cases):
        for rank in range(n):
            check_sum(results[rank][i], inputs)
            assert results[rank][i].tobytes() == results[0][i].tobytes(), f"{name}: ranks disagree"
        stats = backends[0].stats()["tensors"][name]
        mask_union = np.zeros(-(-size // 32), dtype=bool)
        for rank in range(n):
            mask = om.block_mask(inputs[rank], 32) > 0
            mask_union |= mask
            assert backends[rank].stats()["tensors"][name]["density"] == pytest.approx(mask.mean())
        # the union density counts result blocks with a payload, the bootstrap ones included
        assert stats["union_density"] == pytest.approx(mask_union.mean())
    assert len(backends[0].stats()["aggregators"]) == (3 if mode == "dedicated" else n)


@pytest.mark.parametrize("size,block,columns", [
    (1, 256, 256),            # a single element
    (256, 256, 256),          # a single full block
    (255, 256, 4),            # a single partial block
    (257, 256, 256),          # one element into the second block
    (5 * 256 + 3, 256, 2),    # not a multiple; more blocks than columns
    (7 * 64, 64, 7),          # blocks == columns
    (1000, 64, 1),            # one column: the whole tensor is one chain
    (0, 256, 256),            # empty
    (3 * 1001 + 5, 1001, 2),  # a block not a multiple of the 8-lane vectors
    (2 * 16000 + 7, 16000, 2),   # loopback's path-sized block (OMR_MAX_BLOCK)
])
def test_block_size_edges(size, block, columns):
    n = 3
    cases = [(d, sparse_inputs(n, size, d, "independent", t, block=block, seed=7))
             for d in (0.0, 0.5, 1.0) for t in (np.float32, np.int32)]

    def work(rank, backend):
        return [backend.allreduce(inputs[rank], f"edge{i}") for i, (_, inputs) in enumerate(cases)]

    results, _ = run(n, work, omnireduce_block_size=block, omnireduce_columns=columns)
    for i, (_, inputs) in enumerate(cases):
        for rank in range(n):
            assert results[rank][i].shape == (size,)
            check_sum(results[rank][i], inputs)


def test_threshold_drops_small_blocks_only():
    n, block = 2, 16
    x = np.zeros((n, 8 * block), dtype=np.float32)
    x[0, :block] = 1e-4            # below the threshold on rank 0 only: dropped
    x[1, :block] = 5.0
    x[0, 2 * block:3 * block] = 1e-4   # below on every rank: dropped
    x[1, 5 * block] = -3.0
    results, _ = run(n, lambda rank, b: b.allreduce(x[rank], "t"), omnireduce_block_size=block,
                     omnireduce_threshold=1e-3)
    expected = np.where(np.repeat(om.block_mask(x[0], block, 1e-3), block) > 0, x[0], 0) + \
        np.where(np.repeat(om.block_mask(x[1], block, 1e-3), block) > 0, x[1], 0)
    for out in results:
        np.testing.assert_array_equal(out, expected)


# -- traffic --------------------------------------------------------------------------------------
@pytest.mark.parametrize("placement", ["independent", "overlap"])
def test_bytes_match_traffic_model(placement):
    """Per worker and tensor: measured bytes equal the protocol's exact wire model to the byte
    (recovery traffic, if the loaded host made a timer fire, is counted apart and subtracted),
    and stay within OMNIREDUCE.md's model (own non-zero blocks + 4 bytes each up, the union down)
    plus what a packet carries besides its block, per block and per column: our 40-byte header
    instead of 4 bytes of `next` (3.5% of a 1 KiB block), the 24-byte packet MAC (2.3%), the
    results' 12-byte stamp of the aggregator's share (1.2%, down), silent workers' ACKs (a header
    per 4 silent rounds: at most 4% up at 4 workers), and one header-only bootstrap packet per
    column whose first block is zero."""
    n, block, columns, size = 4, 256, 32, 2048 * 256
    cases = [(d, sparse_inputs(n, size, d, placement, block=block, seed=3)) for d in (0.01, 0.1, 0.5, 1.0)]

    def work(rank, backend):
        return [backend.allreduce(inputs[rank], f"traffic{d}") for d, inputs in cases]

    _, backends = run(n, work, omnireduce_block_size=block, omnireduce_columns=columns,
                      omnireduce_retransmit_ms=200.0)
    for d, inputs in cases:
        masks = [om.block_mask(inputs[r], block) for r in range(n)]
        model = wire_model(masks, size, block, columns)
        union = int(np.any(masks, axis=0).sum())
        for rank in range(n):
            st = backends[rank].stats()["tensors"][f"traffic{d}"]
            sent = st["bytes_sent"] - st["resend_bytes"]
            recv = st["bytes_recv"] - st["extra_recv_bytes"]
            assert (sent, recv) == model[rank], (d, rank, st)
            up, down = paper_model(int(masks[rank].sum()), union, block * 4)
            packet, result = wire.HEADER + wire.MAC, wire.HEADER + wire.MAC + wire.STAMP
            assert up <= sent <= up * (1 + (packet - 4) / (block * 4) + 0.04) + packet * columns, (d, rank, sent, up)
            assert down <= recv <= down * (1 + result / (block * 4)) + result * columns, (d, rank, recv, down)
            assert st["union_blocks"] == union


def test_per_tensor_block_sums_and_moves_its_own_blocks():
    """A tensor's block is its own (row-sparse tensors: whole rows), at most the job's: tensors of
    blocks 64 (the job's), 33, 7 and 1 in one job, in turns, sum exactly and move exactly the wire
    model's bytes for their own block; a block above the job's is refused before anything moves."""
    n, job_block, columns = 3, 64, 16
    cases = [(block, d, sparse_inputs(n, 97 * block + 5, d, "independent", t, block=block, seed=block))
             for block in (64, 33, 7, 1) for d, t in ((0.1, np.float32), (0.5, np.int32))]

    def work(rank, backend):
        out = [backend.allreduce(inputs[rank], f"b{block}.{d}", block=block) for block, d, inputs in cases]
        with pytest.raises(InvalidTensor, match="block=65"):
            backend.allreduce(cases[0][2][rank], "too big", block=65)
        return out

    results, backends = run(n, work, omnireduce_block_size=job_block, omnireduce_columns=columns,
                            omnireduce_retransmit_ms=200.0)
    for i, (block, d, inputs) in enumerate(cases):
        model = wire_model([om.block_mask(inputs[r], block) for r in range(n)], inputs.shape[1], block, columns)
        for rank in range(n):
            check_sum(results[rank][i], inputs)
            st = backends[rank].stats()["tensors"][f"b{block}.{d}"]
            assert (st["bytes_sent"] - st["resend_bytes"], st["bytes_recv"] - st["extra_recv_bytes"]) == model[rank]


# -- loss and duplication ---------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["colocated", "dedicated"])
def test_loss_and_duplication_give_identical_results(mode):
    """5% of all packets (data, ACK, PULL, results, STATUS, replays) dropped and 5% duplicated, on
    workers and aggregators: results are bit-identical to the exact sum; nothing hangs."""
    n, block = 4, 32
    cases = []
    for i, (d, t) in enumerate([(0.01, np.float32), (0.1, np.int32), (0.5, np.float32), (1.0, np.int32),
                                (0.1, np.float32)]):
        x = sparse_inputs(n, 300 * block + 11, d, "independent", t, block=block, seed=11 + i)
        if t == np.float32:
            x = np.round(x * 64) + 0.0       # integer-valued floats (no -0.0): exact in any order
        cases.append(x)

    def work(rank, backend):
        return [backend.allreduce(x[rank], f"lossy{i}") for i, x in enumerate(cases)]

    results, backends = run(n, work, join_timeout=50.0, omnireduce_mode=mode, omnireduce_block_size=block,
                            omnireduce_columns=24, omnireduce_sim_loss=0.05, omnireduce_sim_dup=0.05,
                            omnireduce_retransmit_ms=3.0, omnireduce_num_aggregators=2)
    for i, x in enumerate(cases):
        expected = x.sum(axis=0, dtype=x.dtype)
        for rank in range(n):
            assert results[rank][i].tobytes() == expected.tobytes(), f"tensor {i} rank {rank}"
    totals = [b.stats() for b in backends]
    assert sum(t["sim_dropped"] for t in totals) > 0 and sum(t["sim_duplicated"] for t in totals) > 0
    assert sum(t["resends"] for t in totals) > 0


@pytest.mark.parametrize("mode", ["colocated", "dedicated"])
def test_path_sized_blocks_agreed_and_exact_under_loss(mode):
    """omnireduce_block_size=0: every rank sizes blocks by its paths to the aggregators (loopback:
    the largest block, OMR_MAX_BLOCK) and they agree; a tensor not a multiple of the block, dense
    and sparse, float32 and int32, is bit-identical to the sum with 5% loss and duplication."""
    n, path = 3, agg_module.path_block([("127.0.0.1", 9)])
    assert path == lib.OMR_MAX_BLOCK, path
    cases = [sparse_inputs(n, 12 * path + 333, d, "independent", t, block=path, seed=5 + i)
             for i, (d, t) in enumerate([(1.0, np.float32), (0.4, np.int32), (0.4, np.float32)])]
    cases = [np.round(x * 64) + 0.0 if x.dtype == np.float32 else x for x in cases]   # exact in any order

    def work(rank, backend):
        return [backend.allreduce(x[rank], f"path{i}") for i, x in enumerate(cases)]

    results, backends = run(n, work, omnireduce_mode=mode, omnireduce_block_size=0, omnireduce_sim_loss=0.05,
                            omnireduce_sim_dup=0.05, omnireduce_retransmit_ms=3.0)
    for i, x in enumerate(cases):
        for rank in range(n):
            assert results[rank][i].tobytes() == x.sum(axis=0, dtype=x.dtype).tobytes(), f"tensor {i} rank {rank}"
    stats = [b.stats() for b in backends]
    assert {(st["block_size"], st["columns"]) for st in stats} == {(path, max(1, 512 * 1024 // (4 * path)))}, stats
    assert sum(st["sim_dropped"] for st in stats) > 0


def test_path_block_fits_one_datagram_of_the_path():
    """What a 1500-byte path and a jumbo frame hold: the result (header, block, stamp, MAC) in one
    IPv4 datagram; at least one value, at most OMR_MAX_BLOCK."""
    over = lib.OMR_HDR_BYTES + lib.OMR_STAMP_BYTES + lib.OMR_MAC_BYTES
    for mtu, want in [(1500, 349), (9000, 2224), (65536, lib.OMR_MAX_BLOCK), (100, 1)]:
        block = net.path_values(mtu, over, lib.OMR_MAX_BLOCK)
        assert block == want, (mtu, block)


# -- aggregators: dedicated endpoints, several jobs, no restarts -----------------------------------
def test_dedicated_aggregators_interleave_and_serve_several_jobs():
    """Three aggregators serve two concurrent jobs (different tokens, 4 and 3 ranks) and then a
    third job after the first two closed; columns are interleaved across all three."""
    aggs = [Aggregator("127.0.0.1", 0).start() for _ in range(3)]
    try:
        addresses = ",".join(a.address_str for a in aggs)
        x4 = sparse_inputs(4, 100 * 16, 0.3, block=16, seed=1)
        x3 = sparse_inputs(3, 77 * 16, 0.6, dtype=np.int32, block=16, seed=2)
        out = {}

        def job(name, x, token):
            results, _ = run(x.shape[0], lambda rank, b: [b.allreduce(x[rank], f"{name}{k}") for k in range(3)],
                             token=token, **KEYLESS, omnireduce_aggregators=addresses,
                             omnireduce_block_size=16, omnireduce_columns=9)
            out[name] = results

        jobs = [("a", x4, "token-a"), ("b", x3, "token-b")]
        LocalGroup(len(jobs), settings()).run(lambda ctx: job(*jobs[ctx.rank]), 50)   # a thread per job
        job("c", x4, "token-c")
        for name, x in (("a", x4), ("b", x3), ("c", x4)):
            for per_rank in out[name]:
                for result in per_rank:
                    check_sum(result, x)
        stats = [a.stats() for a in aggs]
        assert all(s["rounds"] > 0 for s in stats), stats          # every aggregator took columns
        assert all(s["jobs"] == 0 for s in stats), stats            # deregistered at close
        assert all(s["refused"] == 0 and s["bad_recv"] == 0 for s in stats), stats
    finally:
        for a in aggs:
            a.close()


def test_live_job_outlasts_idle_collection_and_a_dead_one_does_not():
    """A dedicated aggregator drops jobs silent for job_idle_s: a live job's keepalives hold it through
    a pause in its traffic (an evaluation, a checkpoint), a job whose workers vanished is collected."""
    from commlib.switch import aggregator as agg_module
    agg = Aggregator("127.0.0.1", 0, job_idle_s=0.5).start()
    try:
        x = sparse_inputs(2, 64 * 16, 0.5, block=16, seed=3)

        def work(rank, backend):
            first = backend.allreduce(x[rank], "before")
            time.sleep(2.5)                 # idle collection runs every second: several chances
            return first, backend.allreduce(x[rank], "after")

        results, _ = run(2, work, **KEYLESS, omnireduce_aggregators=agg.address_str,
                         omnireduce_block_size=16)
        for pair in results:
            for result in pair:
                check_sum(result, x)
        assert agg.stats()["jobs"] == 0                     # deregistered at close

        sock = agg_module.make_socket("127.0.0.1")          # a worker that registers, then dies
        try:
            request = {"job": "dead-job", "epoch": 1, "rank": 0, "size": 2, "columns": 4, "aggregators": 1,
                       "block": 16}
            assert agg_module.register(sock, [agg.address], request, 5.0)[0][2] == 0.5
        finally:
            sock.close()
        assert agg.stats()["jobs"] == 1
        deadline = time.monotonic() + 5.0
        while agg.stats()["jobs"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert agg.stats()["jobs"] == 0
    finally:
        agg.close()


def test_registration_rejects_mismatched_settings():
    agg = Aggregator("127.0.0.1", 0).start()
    try:
        group = LocalGroup(2, settings(**KEYLESS, omnireduce_aggregators=agg.address_str))
        ctx0, ctx1 = group.contexts
        # rank 1 claims a different block size: the exchange catches it before registration
        ctx1.settings = settings(**KEYLESS, omnireduce_aggregators=agg.address_str,
                                 omnireduce_block_size=64)
        errors = group.run(errors_of(started), 20)
        assert all(isinstance(e, ConfigError) and "differ across ranks" in str(e) for e in errors), errors
    finally:
        agg.close()


def test_restarted_aggregator_is_a_clear_error():
    agg = Aggregator("127.0.0.1", 0).start()
    port = agg.address[1]
    group = LocalGroup(2, settings(**KEYLESS, omnireduce_aggregators=agg.address_str,
                                   timeout_s=3.0))
    backends = group.run(started, 20)
    agg.close()
    agg = Aggregator("127.0.0.1", port).start()          # same address, no memory of the job
    try:
        errors = group.run(errors_of(lambda ctx: backends[ctx.rank].allreduce(np.ones(100, np.float32), "x")), 20)
        for e in errors:
            assert isinstance(e, PeerFailure) and "does not know this job" in str(e), e
        with pytest.raises(PeerFailure, match="unusable after an earlier failure"):
            backends[0].allreduce(np.ones(100, np.float32), "y")
    finally:
        group.run(lambda ctx: backends[ctx.rank].close(), 20)
        agg.close()


# -- failures -------------------------------------------------------------------------------------
@pytest.mark.long
@pytest.mark.parametrize("mode", ["colocated", "dedicated"])
def test_rank_that_stops_is_named_within_the_timeout(mode):
    """Rank 1 does the first tensor, then never calls again: the others raise PeerFailure naming
    rank 1 within the timeout (its aggregator, if colocated, is still up and says whom it waits for)."""
    n, timeout = 3, 2.0
    group = LocalGroup(n, settings(omnireduce_mode=mode, timeout_s=timeout, omnireduce_num_aggregators=2))
    backends = group.run(started, 20)
    elapsed = [None] * n
    x = np.ones(5000, np.float32)

    def work(rank):
        backends[rank].allreduce(x, "first")
        if rank == 1:
            return
        start = time.monotonic()
        try:
            backends[rank].allreduce(x, "second")
        finally:
            elapsed[rank] = time.monotonic() - start

    errors = group.run(errors_of(lambda ctx: work(ctx.rank)), 20)
    try:
        assert errors[1] is None
        for r in (0, 2):
            assert isinstance(errors[r], PeerFailure), errors[r]
            assert "rank 1" in str(errors[r]) and "'second'" in str(errors[r]), errors[r]
            assert timeout <= elapsed[r] < timeout + 2.0, elapsed[r]
    finally:
        group.run(lambda ctx: backends[ctx.rank].close(), 20)


def test_dead_dedicated_aggregator_is_named_within_the_timeout():
    proc = subprocess.Popen([sys.executable, "-m", "commlib.switch.aggregator_main", "--host", "127.0.0.1",
                             "--port", "0", "--quiet"], stdout=subprocess.PIPE, text=True)
    try:
        address, = control.wait_ready(proc, 30, "commlib-aggregator")
        group = LocalGroup(2, settings(**KEYLESS, omnireduce_aggregators=address, timeout_s=2.0))
        backends = group.run(started, 20)
        x = np.ones(3000, np.float32)
        assert group.run(errors_of(lambda ctx: backends[ctx.rank].allreduce(x, "before")), 20) == [None, None]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        start = time.monotonic()
        errors = group.run(errors_of(lambda ctx: backends[ctx.rank].allreduce(x, "after")), 20)
        assert time.monotonic() - start < 2.0 + 2.0
        for e in errors:
            assert isinstance(e, CommTimeout) and address in str(e) and "commlib-aggregator" in str(e), e
        group.run(lambda ctx: backends[ctx.rank].close(), 20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_unreachable_aggregator_fails_registration_on_every_rank():
    free = Aggregator("127.0.0.1", 0)
    address = free.address_str
    free.close()                                            # nobody listens there now
    group = LocalGroup(2, settings(**KEYLESS, omnireduce_aggregators=address, timeout_s=1.0))
    errors = group.run(errors_of(started), 20)
    for e in errors:
        assert isinstance(e, CommError) and "failed on rank 0" in str(e) and address in str(e) and \
            "did not answer" in str(e), e


# -- inputs, helpers, settings ----------------------------------------------------------------------
@pytest.mark.parametrize("path", ["GIL held", "GIL released"])
def test_block_mask_and_density(path, monkeypatch):
    """Small scans keep the GIL (ctypes), large ones release it (cffi): the same masks."""
    from commlib import kernels
    monkeypatch.setattr(kernels, "HELD_MAX", 1 << 30 if path == "GIL held" else 0)
    x = np.zeros(1000, np.float32)
    x[3] = 1.0                  # block 0
    x[300] = np.nan             # block 1: NaN counts as non-zero
    x[999] = -0.5               # block 3 (partial)
    x[600] = -0.0               # negative zero is zero
    assert om.block_mask(x, 256).tolist() == [1, 1, 0, 1]
    assert om.block_mask(x, 256, threshold=0.75).tolist() == [1, 1, 0, 0]
    assert om.block_density(x, 256) == 0.75
    assert om.block_density(np.zeros(0, np.float32)) == 0.0
    i = np.zeros(513, np.int32)
    i[512] = -7
    assert om.block_mask(i, 256).tolist() == [0, 0, 1]
    assert om.block_mask(np.array([0, 0, 2], np.float64), 2).tolist() == [0, 1]   # numpy fallback


@pytest.mark.parametrize("array, int32, block", [(np.zeros(8, np.float32)[::2], 0, 2), (np.zeros(8, np.float64), 0, 2),
                                                 (np.zeros(8, np.float32), 1, 2), (np.zeros(8, np.float32), 0, 0)])
def test_the_scan_refuses_what_it_would_misread(array, int32, block):
    from commlib import kernels
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.nonzero_blocks(array, block, 0.0, int32)


def test_density_with_the_backends_own_block_and_threshold():
    """What the core's `auto` policy reads: the fraction of blocks this backend would send."""
    x = np.zeros(64, np.float32)
    x[3] = 1.0                  # block 0 of 16
    x[40] = 0.25                # block 2: not above the threshold, so zero
    results, _ = run(1, lambda rank, b: b.density(x), omnireduce_block_size=16, omnireduce_threshold=0.25)
    assert results[0] == 0.25 == om.block_density(x, 16, 0.25)
    assert om.block_density(x) == 1.0                       # a fixed 256-element estimate would say dense


def test_sparse_inputs_torch_coo_and_compressor_output():
    torch = pytest.importorskip("torch")
    n, rows, dim = 3, 20000, 16
    grads, dense = [], []
    for rank in range(n):
        emb = torch.nn.Embedding(rows, dim, sparse=True)
        torch.manual_seed(rank)
        ids = torch.randint(0, rows, (20,)) // (rank + 1)
        emb(ids).sum().backward()
        grads.append(emb.weight.grad)
        dense.append(emb.weight.grad.to_dense().numpy().reshape(-1))
    assert grads[0].is_sparse
    values, idx = [], []
    for rank in range(n):                   # a top-k compressor's output: values at flat indices
        flat = np.arange(4000, dtype=np.float32) * (rank + 1)
        top = np.argsort(-np.abs(flat))[:40]
        values.append(flat[top])
        idx.append(top)

    def work(rank, backend):
        dense_out = backend.allreduce_sparse(grads[rank], "emb")
        sparse_out = backend.allreduce_sparse(grads[rank], "emb2", dense=False)
        topk = backend.allreduce(om.densify(values[rank], idx[rank], 4000), "topk")
        return dense_out, sparse_out, topk

    results, backends = run(n, work)
    exact = np.sum(dense, axis=0)
    topk_exact = sum(om.densify(values[r], idx[r], 4000) for r in range(n))
    for dense_out, sparse_out, topk in results:
        assert dense_out.shape == (rows, dim) and not dense_out.is_sparse
        np.testing.assert_allclose(dense_out.numpy().reshape(-1), exact, rtol=1e-6, atol=1e-6)
        assert sparse_out.is_sparse and sparse_out.sparse_dim() == 1
        np.testing.assert_allclose(sparse_out.to_dense().numpy().reshape(-1), exact, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(topk, topk_exact)
    assert 0 < backends[0].measured_density("emb")[0] <= 20 / 1250      # 20 rows of 16 floats: at most 20 blocks


def test_stats_and_invalid_inputs():
    def work(rank, backend):
        backend.allreduce(np.ones(10, np.float32), "a")
        with pytest.raises(InvalidTensor, match="float32 and int32"):
            backend.allreduce(np.ones(10, np.float64), "b")
        return backend.stats()

    results, _ = run(2, work)
    st = results[0]
    for key in ("bytes_sent", "bytes_recv", "pkts_sent", "pkts_recv", "resends", "density", "union_density",
                "tensors", "aggregators", "aggregator"):
        assert key in st, key
    assert st["tensors"]["a"]["density"] == 1.0 and st["bytes_sent"] > 0 and st["tensors"]["a"]["bytes_recv"] > 0
    # CPU time (the benchmarks' ns per element): the call's, summed; the colocated aggregator's serving thread
    assert 0 < st["tensors"]["a"]["cpu_ns"] <= st["cpu_ns"] and st["aggregator"]["cpu_ns"] > 0, st


def test_out_of_memory_is_reported_as_such():
    """omr_worker_allreduce's failed allocation (OMR_ENOMEM) reads as what it is, not "invalid arguments"."""
    backend = om.OmniReduceBackend(LocalGroup(1, settings(omnireduce_columns=64)).contexts[0])
    try:
        error = backend._error(lib.OMR_ENOMEM, om.ffi.new("omr_wstats *"), "x")
    finally:
        backend.close()
    assert type(error) is CommError and "out of memory for the state of 64 columns" in str(error), error


@pytest.mark.parametrize("overrides,match", [
    ({"omnireduce_block_size": -1}, "omnireduce_block_size"),
    ({"omnireduce_block_size": 20000}, "omnireduce_block_size"),
    ({"omnireduce_threshold": -1.0}, "omnireduce_threshold"),
    ({"omnireduce_sim_loss": 0.9}, "omnireduce_sim_loss"),
])
def test_invalid_settings(overrides, match):
    group = LocalGroup(1, settings(**overrides))
    with pytest.raises(ConfigError, match=match):
        om.OmniReduceBackend(group.contexts[0])


def test_construction_is_local_and_allreduce_needs_start():
    """__init__ exchanges nothing with the other ranks (a lone rank of a 2-rank job builds it at
    once); allreduce never starts the backend by itself."""
    backend = om.OmniReduceBackend(LocalGroup(2, settings(timeout_s=0.5)).contexts[0])
    try:
        with pytest.raises(BackendUnavailable, match="not started"):
            backend.allreduce(np.ones(10, np.float32), "x")
    finally:
        backend._release()


def test_available():
    ok = LocalGroup(2, settings()).contexts[0]
    assert om.OmniReduceBackend.available(ok) == (True, "")
    remote = LocalGroup(2, settings(omnireduce_mode="dedicated")).contexts[0]
    remote.local_size = 1                                   # ranks on several hosts, nothing configured
    good, why = om.OmniReduceBackend.available(remote)
    assert not good and "COMMLIB_OMNIREDUCE_AGGREGATORS" in why and "commlib-aggregator" in why
    bad = LocalGroup(2, settings(omnireduce_mode="nope")).contexts[0]
    assert not om.OmniReduceBackend.available(bad)[0]


def test_env_overrides(monkeypatch):
    monkeypatch.setenv("COMMLIB_OMNIREDUCE_BLOCK_SIZE", "64")
    monkeypatch.setenv("COMMLIB_OMNIREDUCE_MODE", "dedicated")
    s = Settings()
    assert s.omnireduce_block_size == 64 and s.omnireduce_mode == "dedicated"


def test_a_survivor_unregisters_when_the_closing_exchange_fails():
    """A rank whose peer died closes without it (its closing exchange times out) and still ends
    the job on a dedicated aggregator, which would otherwise hold it for job_idle_s."""
    agg = Aggregator("127.0.0.1", 0, job_idle_s=600).start()
    try:
        group = LocalGroup(2, settings(**KEYLESS, omnireduce_aggregators=agg.address_str,
                                       timeout_s=1.0))
        backends = group.run(started, 30)
        assert agg.stats()["jobs"] == 1
        backends[0].close()                 # rank 1 never comes to close: it died
        assert agg.stats()["jobs"] == 0 or _eventually(lambda: agg.stats()["jobs"] == 0), agg.stats()
        backends[1].close()
    finally:
        agg.close()


def _eventually(check, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)
    return check()

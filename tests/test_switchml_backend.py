"""The switchml backend: N ranks as threads of this process (commlib.context.LocalGroup), each
streaming through a real switch over loopback UDP (the C loops release the GIL).

Float32 bound checked here (per element, n ranks, block max exponent e over ranks, max|x| < 2^e):
    |switchml - exact| <= n^2 * 2^(e-1) / (2^31 - 1) + 2^-24 * |exact|
(quantization: each rank's rounding is at most 0.5 / f with f = (2^31 - 1) / (n 2^e); then the
float32 rounding of the result)."""
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from commlib.backends import TensorMeta
from commlib.testing import LocalGroup
from commlib.errors import BackendUnavailable, CommError, CommTimeout, ConfigError, InvalidTensor, PeerFailure
from commlib.settings import Settings

import commlib.backends.switchml as sml   # noqa: E402
from helpers import switch_process

sw = sml.sw
if sw.lib is None:   # not built: a failure of the suite, never a quiet skip
    raise ImportError(sw.IMPORT_ERROR)

pytestmark = pytest.mark.timeout(60)

SIZES = [0, 1, 255, 256, 257, 1000, 5000, 33333]


def settings(**kw):
    return Settings({"timeout_s": 10.0, "switch_retransmit_ms": 2.0, **kw})


def run(n, work, join_timeout=45.0, **kw):
    """Run work(rank, backend) on n rank threads, each starting its backend before (start() is the
    collective set-up, as the core calls it) and closing it after; returns the per-rank results,
    raises the first error (a CommTimeout if a rank hangs: its backend stays open, closing it would
    free the state that rank is still streaming with)."""
    group = LocalGroup(n, settings(**kw))
    backends = [sml.SwitchMLBackend(ctx) for ctx in group.contexts]   # local work only: no exchange

    def main(ctx):
        try:
            backends[ctx.rank].start()
            return work(ctx.rank, backends[ctx.rank])
        finally:
            backends[ctx.rank].close()      # collective: waits for the other ranks' work

    return group.run(main, join_timeout)


def start_error(ctx):
    """The error a rank's backend raised starting (None if it started), the backend closed."""
    backend = sml.SwitchMLBackend(ctx)
    try:
        backend.start()
    except CommError as exc:
        return exc
    finally:
        backend.close()


def float_data(rank, size, seed=0):
    """Values over many magnitudes, whole zero blocks, tiny and negative values."""
    rng = np.random.default_rng(1000 * seed + rank)
    x = rng.standard_normal(size).astype(np.float32)
    scale = np.float32(10.0) ** rng.integers(-8, 8, size=(size + 255) // 256).repeat(256)[:size]
    x *= scale.astype(np.float32)
    x[(np.arange(size) // 256) % 5 == 3] = 0.0          # every fifth block all zero on every rank
    return x


def int_data(rank, size, seed=0):
    return np.random.default_rng(7 + 1000 * seed + rank).integers(-2 ** 26, 2 ** 26, size, dtype=np.int32)


def assert_within_bound(inputs, got, elems):
    n = len(inputs)
    stack = np.stack(inputs).astype(np.float64)
    exact = stack.sum(axis=0)
    size = exact.size
    pad = -size % elems
    blockmax = np.pad(np.abs(stack).max(axis=0), (0, pad)).reshape(-1, elems).max(axis=1)
    e = np.frexp(blockmax)[1].astype(np.float64)                       # blockmax < 2^e
    tol = np.where(blockmax > 0, n * n * np.exp2(e - 1) / (2 ** 31 - 1), 0.0).repeat(elems)[:size]
    tol += np.abs(exact) * 2.0 ** -24
    err = np.abs(got.astype(np.float64) - exact)
    assert np.all(err <= tol), f"max excess {np.max(err - tol)} at {np.argmax(err - tol)}"
    zero = blockmax.repeat(elems)[:size] == 0
    assert np.all(got[zero] == 0.0)                                     # zero blocks stay exact


@pytest.mark.parametrize("n, elems", [(2, 0), (4, 0), (8, 0), (2, 256), (3, 333), (2, 8192)])
def test_int32_exact_and_float_within_bound(n, elems):
    """Back-to-back tensors of different sizes (0, 1, not multiples of the packet, > window) and
    dtypes on one job: the pool shift carries across them. Packets sized by the path (0: 8192 values
    on loopback), Tofino's 256, 333 (not a multiple of any vector width) and the largest."""
    def work(rank, backend):
        out = []
        for i, size in enumerate(SIZES):
            out.append(backend.allreduce(int_data(rank, size, i), f"i{i}"))
            out.append(backend.allreduce(float_data(rank, size, i), f"f{i}"))
        return out, backend.stats()["packet_elems"]

    results = run(n, work, switch_window=16 if n == 8 else 0, switch_packet_elems=elems)
    results, used = [r[0] for r in results], results[0][1]
    assert used == (elems or sml.PATH_MAX_ELEMS), used     # loopback: the largest packets
    for i, size in enumerate(SIZES):
        ints = [int_data(r, size, i) for r in range(n)]
        exact = np.sum(np.stack(ints).astype(np.int64), axis=0).astype(np.int32) if size else np.zeros(0, np.int32)
        floats = [float_data(r, size, i) for r in range(n)]
        for rank in range(n):
            got_i, got_f = results[rank][2 * i], results[rank][2 * i + 1]
            assert got_i.dtype == np.int32 and got_i.shape == (size,)
            np.testing.assert_array_equal(got_i, exact)
            assert got_f.dtype == np.float32 and got_f.shape == (size,)
            np.testing.assert_array_equal(got_f, results[0][2 * i + 1])   # every rank gets the same bits
        if size:
            assert_within_bound(floats, results[0][2 * i + 1], used)


def test_scalar_and_vector_kernels_give_the_same_sums():
    """The whole path (exponents, quantization, the switch's adds, dequantization) with the
    portable scalar kernels and with the AVX2 ones (commlib/csrc/kernels.h): the same bits."""
    def work(rank, backend):
        return [backend.allreduce(data(rank, size, i), f"t{i}") for i, size in enumerate((1, 1000, 33333))
                for data in (float_data, int_data)]

    sums = []
    try:
        for want in (0, 1):
            sw.lib.cl_simd(want)
            sums.append(run(3, work, switch_packet_elems=1001))
    finally:
        sw.lib.cl_simd(1)
    for rank in range(3):
        for scalar, vector in zip(sums[0][rank], sums[1][rank]):
            assert scalar.tobytes() == vector.tobytes()


@pytest.mark.parametrize("n", [1, 2, 8])
def test_full_scale_blocks_cannot_overflow_and_int32_wraps(n):
    """Every rank at the top of its block's range, all of one sign: each quantized value is
    INT32_MAX / n, so the n-way int32 sum on the switch reaches INT32_MAX and no further; int32
    sums wrap like the switch's adders (moved here from the kernels' tests: the real path)."""
    top = np.float32(np.nextafter(np.float32(2.0 ** 10), np.float32(0)))     # max|x| < 2^10: e = 10
    full = np.full(1000, top, np.float32)
    full[256:512] *= -1                                                       # and the negative edge
    full[512:768] = 0.0                                                       # a zero block stays zero
    wrap = np.array([2 ** 31 - 1, -(2 ** 31), 7], np.int32)

    def work(rank, backend):
        return backend.allreduce(full, "full"), backend.allreduce(wrap if rank == 0 else np.array([1, -1, -9], np.int32), "wrap")

    results = run(n, work, switch_packet_elems=256)
    assert_within_bound([full] * n, results[0][0], 256)
    assert np.all(results[0][0][512:768] == 0.0)
    expected = (wrap.astype(np.int64) + (n - 1) * np.array([1, -1, -9])) % 2 ** 32
    np.testing.assert_array_equal(results[0][1], np.where(expected >= 2 ** 31, expected - 2 ** 32, expected).astype(np.int32))


def test_packets_of_64_window_of_one_without_offload():
    def work(rank, backend):
        return [backend.allreduce(float_data(rank, 1000, 1), "f"), backend.allreduce(int_data(rank, 130), "i")]

    results = run(3, work, switch_packet_elems=64, switch_window=1, switch_offload=False)   # no GSO/GRO either
    assert_within_bound([float_data(r, 1000, 1) for r in range(3)], results[0][0], elems=64)
    np.testing.assert_array_equal(results[1][1], sum(int_data(r, 130).astype(np.int64) for r in range(3)))


def _lossy_work(rank, backend):
    out = []
    for i, size in enumerate([1, 3000, 20000, 257, 100000]):
        out.append(backend.allreduce(float_data(rank, size, i), f"f{i}"))
        out.append(backend.allreduce(int_data(rank, size, i), f"i{i}"))
    out.append(backend.stats())
    out.append(backend.switch_counters()["counters"] if rank == 0 else None)
    return out


@pytest.mark.parametrize("loss, elems", [(0.01, 256), (0.1, 256), (0.1, 0), (0.1, 1001)])
def test_loss_and_duplication_give_bit_identical_results(loss, elems):
    """Loss recovery, the shadow copies and the timers at Tofino's size, the path's (loopback: the
    largest) and an odd one."""
    clean = run(4, _lossy_work, switch_window=32, switch_packet_elems=elems)
    lossy = run(4, _lossy_work, switch_window=32, switch_packet_elems=elems, switch_drop_probability=loss,
                switch_duplicate_probability=loss, switch_retransmit_ms=1.0, switch_retransmit_max_ms=20.0)
    for rank in range(4):
        for a, b in zip(clean[rank][:-2], lossy[rank][:-2]):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    switch = lossy[0][-1]
    # over every rank: one rank alone sees no loss now and then (~250 packets at 1%: e^-5)
    assert sum(r[-2]["resends"] for r in lossy) > 0 and switch["drop_sim_ingress"] > 0 and switch["drop_sim_egress"] > 0
    assert switch["dup_sim"] > 0 and switch["replays"] > 0
    assert sum(r[-2]["duplicates"] for r in lossy) > 0
    assert clean[0][-1]["drop_sim_ingress"] == clean[0][-1]["drop_sim_egress"] == 0


def test_a_late_rank_costs_the_others_one_probe_per_timer_not_their_window():
    """Rank 1 starts the tensor 300 ms late: the switch holds rank 0's window meanwhile, so rank 0's
    expiries resend one probe each and hold the rest (`held`), where resending the window would
    have sent it again on every expiry; the result is still exact."""
    x = [np.arange(64 * 256, dtype=np.int32) * (r + 1) for r in range(2)]

    def work(rank, backend):
        before = backend.stats()
        if rank == 1:
            time.sleep(0.3)
        out = backend.allreduce(x[rank], "late")
        after = backend.stats()
        return out, {k: after[k] - before[k] for k in ("resends", "held", "received")}

    (out0, rank0), (out1, _) = run(2, work, switch_window=64, switch_packet_elems=256, switch_retransmit_ms=5.0,
                                   switch_retransmit_max_ms=40.0, switch_streams=1)   # one stream's timer
    assert np.array_equal(out0, x[0] + x[1]) and np.array_equal(out1, x[0] + x[1])
    # 300 ms of timers from 5 ms doubling to 40: about 10 expiries, one probe each
    assert rank0["held"] >= 63, f"rank 0 held only {rank0['held']} expired packets while rank 1 was late"
    assert 1 <= rank0["resends"] <= 16, f"rank 0 resent {rank0['resends']} packets waiting for a late rank (window 64)"


def test_a_job_on_a_keyless_switch_outlives_its_expiry_by_its_keepalives():
    """On a keyless switch a keepalive carries the job's token (a stranger's, without it, is refused): the
    job's own keep it registered across several expiries."""
    with sw.SwitchServer("127.0.0.1", 0, slots=512, job_expiry_s=1.0) as server:
        def work(rank, backend):
            end, sums = time.monotonic() + 3.0, 0
            while time.monotonic() < end:
                sums += int(backend.allreduce(np.ones(1000, np.float32), "x")[0])
                time.sleep(0.05)
            return sums, backend.job

        (sums, job), _ = run(2, work, switch_addr=server.address, authenticate=False)
        assert sums > 0 and sums % 2 == 0
        drops = server.drops.snapshot()
        assert "bad_token" not in drops and "jobs_expired" not in drops, drops


def test_two_jobs_share_one_switch():
    with sw.SwitchServer("127.0.0.1", 0, slots=512) as server:
        outs = {}

        def job(tag, n, seed):
            def work(rank, backend):
                return [backend.allreduce(float_data(rank, 7000, seed), "f"),
                        backend.allreduce(int_data(rank, 9000, seed), "i"), backend.job, backend.elems]
            outs[tag] = run(n, work, switch_addr=server.address, switch_window=64, authenticate=False)

        jobs = [("a", 2, 1), ("b", 3, 2)]
        LocalGroup(len(jobs), settings()).run(lambda ctx: job(*jobs[ctx.rank]), 50)   # a thread per job
        assert set(outs) == {"a", "b"}
        assert outs["a"][0][2] != outs["b"][0][2]
        for tag, n, seed in (("a", 2, 1), ("b", 3, 2)):
            assert_within_bound([float_data(r, 7000, seed) for r in range(n)], outs[tag][0][0], outs[tag][0][3])
            np.testing.assert_array_equal(outs[tag][n - 1][1], sum(int_data(r, 9000, seed) for r in range(n)))
        assert server.status()["jobs"] == {} and server.status()["free_slots"] == 512   # both ended cleanly


def test_nonfinite_propagates_elementwise():
    base = [float_data(r, 600) for r in range(2)]
    base[0][[10, 20, 30, 300]] = [np.nan, np.inf, np.inf, -np.inf]
    base[1][[20, 30, 301]] = [1.0, -np.inf, np.inf]
    results = run(2, lambda rank, b: b.allreduce(base[rank], "x"))
    got = results[0]
    assert np.isnan(got[10]) and got[20] == np.inf and np.isnan(got[30])
    assert got[300] == -np.inf and got[301] == np.inf
    mask = np.ones(600, bool)
    mask[[10, 20, 30, 300, 301]] = False
    clean = [np.where(mask, x, 0).astype(np.float32) for x in base]
    # finite neighbours in the same blocks keep full accuracy
    assert np.all(np.isfinite(got[mask]))
    assert_within_bound([c for c in clean], np.where(mask, got, 0).astype(np.float32), sml.PATH_MAX_ELEMS)


def test_nonfinite_in_otherwise_zero_blocks_and_all_nan():
    x = [np.zeros(300, np.float32) for _ in range(2)]
    x[0][3], x[1][280] = np.nan, -np.inf
    nan = [np.full(70, np.nan, np.float32)] * 2
    results = run(2, lambda rank, b: [b.allreduce(x[rank], "z"), b.allreduce(nan[rank], "nan")])
    got, all_nan = results[1]
    assert np.isnan(got[3]) and got[280] == -np.inf
    rest = np.delete(got, [3, 280])
    assert np.all(rest == 0.0) and np.all(np.isnan(all_nan))


def test_nonfinite_error_mode_raises_on_every_rank():
    errors = []

    def work(rank, backend):
        x = float_data(rank, 1000)
        if rank == 1:
            x[700] = np.nan
        try:
            backend.allreduce(x, "grad")
        except InvalidTensor as exc:
            errors.append(str(exc))
        return backend.allreduce(int_data(rank, 10), "after")   # the job goes on afterwards

    results = run(3, work, switch_nonfinite="error")
    assert len(errors) == 3 and all("'grad'" in e and "NaN" in e for e in errors)
    np.testing.assert_array_equal(results[0], sum(int_data(r, 10) for r in range(3)))


def huge(rank):
    x = np.ones(100, np.float32)
    x[5] = 3e38 if rank == 0 else 1.0
    return x


def test_out_of_range_values_rejected_on_every_rank_without_a_ring():
    errors = []

    def work(rank, backend):
        try:
            backend.allreduce(huge(rank), "huge")
        except InvalidTensor as exc:
            errors.append(str(exc))

    run(2, work)
    assert len(errors) == 2 and all("2^127" in e and "ring" in e for e in errors), errors


class GroupRing:
    """A ring engine for LocalGroup ranks: the group's own collectives."""
    name = "local-group"

    def __init__(self, channel):
        self.channel = channel

    def allreduce(self, array, name, op="sum"):
        assert op == "sum", op
        return self.channel.allreduce(array)


def test_out_of_range_tensor_goes_through_the_ring_on_every_rank():
    """As under Horovod, a diverging step does not stop the run: that tensor takes the ring, the
    next ones the switch again."""
    group = LocalGroup(2, settings())

    def main(ctx):
        ctx.engine = GroupRing(group.channel(ctx.rank))
        backend = sml.SwitchMLBackend(ctx)
        backend.start()
        try:
            got = backend.allreduce(huge(ctx.rank), "huge")
            after = backend.allreduce(int_data(ctx.rank, 300), "after")
            return got, after, backend.stats()["range_fallbacks"]
        finally:
            backend.close()

    for got, after, fallbacks in group.run(main, 45.0):
        np.testing.assert_array_equal(got, huge(0) + huge(1))   # the ring's float32 sum, not a quantized one
        np.testing.assert_array_equal(after, int_data(0, 300) + int_data(1, 300))
        assert fallbacks == 1, fallbacks


def test_dtypes_converted_or_rejected():
    def work(rank, backend):
        half = backend.allreduce(np.full(300, 1.5, np.float16), "h")
        with pytest.raises(InvalidTensor, match="float64.*ring"):
            backend.allreduce(np.ones(3), "d")
        with pytest.raises(InvalidTensor, match="int64"):
            backend.allreduce(np.ones(3, np.int64), "l")
        return half

    half = run(2, work)[0]
    assert half.dtype == np.float32 and np.all(half == 3.0)   # widened: the core averages, then rounds
    backend = sml.SwitchMLBackend(LocalGroup(1, settings()).contexts[0])
    assert backend.enabled(TensorMeta("x", (3,), "float32", 12))
    assert backend.enabled(TensorMeta("x", (3,), "int32", 12))
    assert backend.enabled(TensorMeta("x", (3,), "float16", 6))       # the core may send it: widened here
    assert not backend.enabled(TensorMeta("x", (3,), "float64", 24))


def test_settings_validated():
    for elems in (-1, sw.MAX_ELEMS + 1):
        ctx = LocalGroup(1, settings(switch_packet_elems=elems)).contexts[0]
        with pytest.raises(ConfigError, match=f"1..{sw.MAX_ELEMS} values per packet"):
            sml.SwitchMLBackend(ctx)
    sml.SwitchMLBackend(LocalGroup(1, settings(switch_window=sw.MAX_SLOTS)).contexts[0])   # the header's limit
    ctx = LocalGroup(1, settings(switch_window=sw.MAX_SLOTS + 1)).contexts[0]
    with pytest.raises(ConfigError, match="switch_window"):
        sml.SwitchMLBackend(ctx)
    ctx = LocalGroup(1, settings(switch_nonfinite="ignore")).contexts[0]
    with pytest.raises(ConfigError, match="propagate"):
        sml.SwitchMLBackend(ctx)


def test_construction_is_local_and_allreduce_needs_start():
    """__init__ exchanges nothing with the other ranks; allreduce never starts the backend by itself."""
    backend = sml.SwitchMLBackend(LocalGroup(2, settings(timeout_s=0.5)).contexts[0])
    with pytest.raises(BackendUnavailable, match="not started"):
        backend.allreduce(np.ones(10, np.float32), "x")
    backend.close()


def test_available_needs_a_switch_or_one_host():
    ctx = LocalGroup(2, settings()).contexts[0]
    assert sml.SwitchMLBackend.available(ctx) == (True, "")
    ctx.local_size = 1                      # ranks on several hosts, no switch configured
    ok, why = sml.SwitchMLBackend.available(ctx)
    assert not ok and "COMMLIB_SWITCH_ADDR" in why
    ctx.settings = settings(switch_addr="10.0.0.5:9099")
    assert sml.SwitchMLBackend.available(ctx) == (True, "")


def test_missing_rank_times_out_clearly():
    def work(rank, backend):
        backend.allreduce(np.ones(10, np.int32), "warmup")
        if rank == 1:
            return None                      # rank 1 never sends the second tensor
        start = time.monotonic()
        with pytest.raises(CommTimeout, match="another rank"):
            backend.allreduce(np.ones(5000, np.float32), "stuck")
        assert time.monotonic() - start < 5
        with pytest.raises(PeerFailure, match="out of step"):
            backend.allreduce(np.ones(5, np.float32), "next")

    run(2, work, timeout_s=1.5)


def test_switch_daemon_restart_and_death_are_clear_errors():
    proc, address = switch_process()
    try:
        port = int(address.rsplit(":", 1)[1])

        def work(rank, backend):
            first = backend.allreduce(np.arange(300, dtype=np.int32), "before")
            barrier.wait(10)
            if rank == 0:                                            # restart the switch under the job
                proc.send_signal(signal.SIGTERM)
                proc.wait(10)
                holder.append(switch_process(port))
            barrier.wait(20)
            start = time.monotonic()
            with pytest.raises(PeerFailure, match="restarted"):
                backend.allreduce(np.ones(1000, np.float32), "after")
            assert time.monotonic() - start < 2.0                      # a clear error, not a hang
            return first

        barrier, holder = threading.Barrier(2), []
        results = run(2, work, switch_addr=address, authenticate=False)
        np.testing.assert_array_equal(results[0], 2 * np.arange(300))
        restarted, _ = holder[0]
        # now the switch dies for good: the next job fails fast, with what to do
        restarted.kill()
        restarted.wait(10)

        start = time.monotonic()
        errors = LocalGroup(2, settings(switch_addr=address, authenticate=False)).run(start_error, 20)
        assert time.monotonic() - start < 8
        for e in errors:                                   # every rank raises rank 0's error
            assert e is not None and "failed on rank 0" in str(e) and address in str(e), e
    finally:
        proc.kill()
        for p, _ in locals().get("holder", []):
            p.kill()


def test_switch_killed_mid_job_is_refused_quickly():
    proc, address = switch_process()
    try:
        def work(rank, backend):
            backend.allreduce(np.ones(10, np.float32), "warm")
            barrier.wait(10)
            if rank == 0:
                proc.kill()
                proc.wait(10)
            barrier.wait(10)
            start = time.monotonic()
            with pytest.raises(PeerFailure, match="not running"):
                backend.allreduce(np.ones(100000, np.float32), "x")
            assert time.monotonic() - start < 2.0

        barrier = threading.Barrier(2)
        run(2, work, switch_addr=address, authenticate=False)
    finally:
        proc.kill()


def test_cli_counters_and_simulate():
    proc, address = switch_process(extra=["--slots", "1000", "--testing"])
    try:
        def work(rank, backend):
            return backend.allreduce(np.ones(2000, np.float32), "x"), backend.job

        results = run(2, work, switch_addr=address, authenticate=False)
        np.testing.assert_array_equal(results[0][0], np.full(2000, 2.0, np.float32))
        cli = [sys.executable, "-m", "commlib.switch"]
        out = subprocess.run(cli + ["simulate", address, "--ingress", "0.02"], capture_output=True, text=True,
                             timeout=20)
        assert out.returncode == 0, out.stderr
        out = subprocess.run(cli + ["status", address], capture_output=True, text=True, timeout=20)
        assert '"ingress": 0.02' in out.stdout and '"free_slots": 1000' in out.stdout
        out = subprocess.run(cli + ["counters", address], capture_output=True, text=True, timeout=20)
        assert '"pkts_recv"' in out.stdout and '"drop_unknown_job"' in out.stdout
        out = subprocess.run(cli + ["counters", address, "--job", "999"], capture_output=True, text=True, timeout=20)
        assert out.returncode == 1 and "not registered" in out.stderr
    finally:
        proc.kill()


# -- streams: several data-plane threads of one switch, several switches ------------------------------
def _streamed_work(rank, backend):
    out = []
    for i, size in enumerate([33333, 1, 5000, 70001]):   # none a multiple of the packet (333)
        out.append(backend.allreduce(float_data(rank, size, i), f"f{i}"))
        out.append(backend.allreduce(int_data(rank, size, i), f"i{i}"))
    return out, backend.stats()["streams"], backend.switch_counters() if rank == 0 else None


@pytest.mark.parametrize("threads, switches", [(2, 1), (1, 2), (2, 2)])
def test_streams_over_switch_threads_and_switches_are_bit_identical(tmp_path, threads, switches):
    """A job through 2 threads of one switch, through 2 switches, and through 2 x 2, authenticated
    (each stream MACs under its own key), gives the same bits as through one switch of one thread;
    every thread aggregates its share and the job's counters are the threads' summed."""
    from commlib.switch import auth
    key_file = tmp_path / "daemon.key"
    key = auth.write_key(str(key_file))
    common = dict(switch_key_file=str(key_file), switch_packet_elems=333, switch_window=8)
    servers = [sw.SwitchServer("127.0.0.1", 0, slots=64, key=key, threads=threads).start()
               for _ in range(switches + 1)]
    try:
        reference = run(3, _streamed_work, switch_addr=servers[0].address, switch_streams=1, **common)
        address = ",".join(server.address for server in servers[1:])
        streamed = run(3, _streamed_work, switch_addr=address, switch_streams=2, **common)
        assert reference[0][1] == 1 and streamed[0][1] == threads * switches, streamed[0][1]
        for rank in range(3):
            for i, (a, b) in enumerate(zip(reference[rank][0], streamed[rank][0])):
                assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), \
                    f"rank {rank}, tensor {i}: {np.count_nonzero(a != b)} values differ from one switch's"
        counters = streamed[0][2]
        per_switch = counters["switches"].values() if switches > 1 else [counters]
        for c in per_switch:
            shards = c["shards"]
            assert len(shards) == threads and all(s["aggregated"] > 0 for s in shards), shards
            assert c["counters"]["aggregated"] == sum(s["aggregated"] for s in shards)
        assert counters["counters"]["aggregated"] == reference[0][2]["counters"]["aggregated"]
        for server in servers[1:]:
            wide = server.counters()
            assert wide["switch"]["pkts_recv"] == sum(s["pkts_recv"] for s in wide["shards"]) > 0
            assert server.status()["jobs"] == {}   # the job ended on every switch
    finally:
        for server in servers:
            server.stop()


def test_default_streams_follow_the_hosts_cores_on_loopback_only(monkeypatch):
    """switch_streams=0 (the default): a job whose ranks all share this host (the embedded switch) asks for
    its cores per rank (the switch's threads cap them); one that crosses links, or names a switch, one."""
    from types import SimpleNamespace
    monkeypatch.setattr(sml, "_cores", lambda: 16)

    def streams(size, local_size, **given):
        ctx = SimpleNamespace(settings=settings(**given), size=size, local_size=local_size,
                              all_local=local_size == size)
        return sml.SwitchMLBackend._streams_per_switch(SimpleNamespace(ctx=ctx))

    assert (streams(4, 4), streams(2, 2), streams(1, 1)) == (4, 8, sml.MAX_STREAMS)
    assert streams(4, 1) == 1, "ranks on other hosts: one stream over a link"
    assert streams(4, 4, switch_addr="10.0.0.1:9099") == 1, "a named switch is reached over a link"
    assert streams(4, 4, switch_streams=3) == 3, "a stream count set is kept"


def test_stream_counts_and_addresses_validated():
    with pytest.raises(ConfigError, match="switch_streams"):
        sml.SwitchMLBackend(LocalGroup(1, settings(switch_streams=99)).contexts[0])
    with sw.SwitchServer("127.0.0.1", 0, slots=64, threads=2) as server:
        errors = LocalGroup(2, settings(switch_addr=f"{server.address},{server.address}", authenticate=False)).run(
            start_error, 20)
        assert all(isinstance(e, CommError) and "names a switch twice" in str(e) for e in errors), errors
        with pytest.raises(ConfigError, match="1..2 threads"):
            server.register(1, [[["127.0.0.1", 1000]]] * 3, 8, 256, streams=True)
        with sw.SwitchServer("127.0.0.1", 0, slots=4) as small:   # the second switch refuses the job's share:
            errors = LocalGroup(2, settings(switch_addr=f"{server.address},{small.address}", switch_window=16,
                                            authenticate=False)).run(start_error, 20)
            assert all(isinstance(e, CommError) and small.address in str(e) and "free slots" in str(e)
                       for e in errors), errors
        assert server.status()["jobs"] == {} and server.status()["free_slots"] == 64   # the first one's is undone


@pytest.mark.parametrize("how", ["kill", pytest.param("stop", marks=pytest.mark.long)])
def test_one_of_two_switches_dying_fails_every_rank_naming_it(how):
    """Killed (its port closes: refused at once) or stopped (silent: the timeout), the second switch of a
    job fails every rank with an error that names it, within the timeout."""
    procs = [switch_process(extra=["--threads", "2"]) for _ in range(2)]
    (_, first), (victim, second) = procs
    try:
        def work(rank, backend):
            np.testing.assert_array_equal(backend.allreduce(np.arange(30000, dtype=np.int32), "warm"),
                                          2 * np.arange(30000))
            barrier.wait(10)
            if rank == 0:
                victim.send_signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            barrier.wait(10)
            start = time.monotonic()
            with pytest.raises(CommError) as error:   # a window per stream and more: every stream takes a share
                backend.allreduce(np.ones(1 << 20, np.float32), "x")
            return str(error.value), time.monotonic() - start, backend.stats()["streams"]

        barrier = threading.Barrier(2)
        results = run(2, work, switch_addr=f"{first},{second}", switch_streams=2, authenticate=False, timeout_s=2.0)
        for message, took, streams in results:
            assert streams == 4
            assert f"on switch {second}" in message and first not in message, message
            assert took < 6.0, f"{took:.1f}s to fail with a timeout of 2s (and 2s to ask the control port why)"
            assert ("not running" if how == "kill" else "no result for 2.0s") in message, message
    finally:
        for proc, _ in procs:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait(10)

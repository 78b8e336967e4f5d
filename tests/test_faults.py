"""Faults on the wire (switch/relay.py): loss, duplication, reordering, delay and jitter between the
workers and the switch / a dedicated aggregator, in both directions. Results must be bit-identical
to a fault-free run and nothing may stall.

The ranks are threads of this process (commlib.testing.LocalGroup) over loopback UDP; the relay is
a thread too. Only the workers' data sockets go through the relay (the switch sees the relay's
per-worker address, which is what the rank registers); the switch's TCP control passes through."""
import numpy as np
import pytest

import commlib.backends.omnireduce as om
import commlib.backends.switchml as sml
from commlib.switch.relay import Faults, FaultRelay, relayed
from helpers import run_backends

sw = sml.sw
if sw.lib is None or om.lib is None:   # not built: a failure of the suite, never a quiet skip
    raise ImportError(sw.IMPORT_ERROR or om.IMPORT_ERROR)

pytestmark = pytest.mark.timeout(120)

# the profile: 25% reordering by 5 ms, 2 +- 1 ms jitter, 5% loss, 5% duplication
NASTY = Faults(loss=0.05, duplicate=0.05, reorder=0.25, reorder_ms=5.0, delay_ms=2.0, jitter_ms=1.0)
REORDER = Faults(reorder=0.25, reorder_ms=5.0)
NONE = Faults()


def switchml_inputs(n):
    """Floats over magnitudes (quantized, so exact only as bits of a deterministic run) and ints."""
    out = []
    for i, size in enumerate((1000, 33333, 70001)):
        rng = np.random.default_rng(i)
        floats = (rng.standard_normal((n, size)) * 10.0 ** rng.integers(-4, 4, (n, 1))).astype(np.float32)
        ints = rng.integers(-2 ** 26, 2 ** 26, (n, size), dtype=np.int32)
        out += [floats, ints]
    return out


def run_switchml(n, faults, seed=1, elems=0, **extra):
    """Every tensor of switchml_inputs through the embedded switch behind a relay with `faults`
    both ways: (results by rank, relay counters, the job's switch counters). elems: values per
    packet (0: the path's, on loopback the largest; then a window of 2, so that slots are reused
    within these tensors as with Tofino's 256 and a window of 32). extra: more settings (switch_addr:
    switches of their own, each behind its relay); the relay counters are summed over the relays."""
    inputs = switchml_inputs(n)
    backend_cls, relays = relayed(sml.SwitchMLBackend, faults, seed)
    seen = {}

    def work(rank, backend):
        out = [backend.allreduce(x[rank], f"t{i}") for i, x in enumerate(inputs)]
        if rank == 0:
            seen.update(backend.switch_counters()["counters"])
        return out

    try:
        results = run_backends(n, backend_cls, work, switch_window=32 if elems == 256 else 2, switch_packet_elems=elems,
                            switch_retransmit_ms=2.0, switch_retransmit_max_ms=40.0, **extra)
    finally:
        for relay in relays:
            relay.stop()
    counters = {d: {k: sum(relay.counters[d][k] for relay in relays) for k in relays[0].counters[d]}
                for d in relays[0].counters}
    return results, counters, seen


def assert_identical(results, reference, n):
    for rank in range(n):
        for i, (got, want) in enumerate(zip(results[rank], reference[0])):
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), f"tensor {i} rank {rank} differs"


@pytest.mark.parametrize("n, elems", [(2, 0), (4, 0), (2, 256)])
def test_switchml_bit_identical_under_reordering_jitter_loss_duplication(n, elems):
    clean, _, _ = run_switchml(n, NONE, elems=elems)
    inputs = switchml_inputs(n)
    ints = [x for x in inputs if x.dtype == np.int32]
    for got, x in zip([r for r in clean[0] if r.dtype == np.int32], ints):
        np.testing.assert_array_equal(got, x.sum(axis=0, dtype=np.int32))   # the reference is right
    faulty, relayed, switch = run_switchml(n, NASTY, elems=elems)
    assert_identical(faulty, clean, n)
    for direction in ("up", "down"):
        c = relayed[direction]
        assert c["lost"] > 0 and c["duplicated"] > 0 and c["reordered"] > 0, relayed
    assert switch["replays"] + switch["drop_incomplete"] > 0, switch   # retransmissions reached it


@pytest.mark.parametrize("elems", [0, 256])
def test_switchml_reordering_alone(elems):
    """Reordering without loss: the late packets are the originals, held back past their timer, so
    the late copy of a packet reaches its slot after its resend (SwitchML's failure mode without
    per-slot versions; a clean run counts neither late drops nor replays)."""
    clean, _, _ = run_switchml(2, NONE, elems=elems)
    faulty, relayed, switch = run_switchml(2, REORDER, seed=5, elems=elems)
    assert_identical(faulty, clean, 2)
    assert relayed["up"]["reordered"] > 0
    # the late copies met their slot either reused (refused as late) or still holding their finished
    # round (answered with its result again): which one depends on the host's timing, both keep the bits
    assert switch["drop_late"] + switch["replays"] > 0, switch


def test_switchml_through_two_switches_bit_identical_under_faults(tmp_path):
    """A job over two keyed switches, each behind its own faulty relay, gives the bits of the fault-free
    job through one switch: loss recovery and timers work per switch."""
    from commlib.switch import auth
    key_file = tmp_path / "daemon.key"
    key = auth.write_key(str(key_file))
    clean, _, _ = run_switchml(2, NONE)
    servers = [sw.SwitchServer("127.0.0.1", 0, slots=64, key=key).start() for _ in range(2)]
    try:
        faulty, relayed, switch = run_switchml(2, NASTY, seed=3, switch_addr=",".join(s.address for s in servers),
                                               switch_key_file=str(key_file))
        assert all(server.counters()["switch"]["pkts_recv"] > 0 for server in servers)   # both carried a share
    finally:
        for server in servers:
            server.stop()
    assert_identical(faulty, clean, 2)
    assert relayed["up"]["lost"] > 0 and relayed["down"]["reordered"] > 0, relayed
    assert switch["replays"] + switch["drop_incomplete"] > 0, switch


# -- omnireduce: a dedicated aggregator behind the relay ------------------------------------------
def omnireduce_inputs(n, block=32):
    out = []
    for i, (density, dtype) in enumerate([(0.05, np.float32), (0.3, np.int32), (1.0, np.float32)]):
        rng = np.random.default_rng(100 + i)
        nb = 300
        x = np.zeros((n, nb * block), dtype)
        for r in range(n):
            rows = x[r].reshape(nb, block)
            chosen = rng.choice(nb, max(1, int(density * nb)), replace=False)
            rows[chosen] = rng.integers(-1000, 1000, (len(chosen), block)).astype(dtype)
        out.append(x[:, : nb * block - 7].copy())
    return out


def run_omnireduce(n, faults, seed=2, block=32):
    """omnireduce_inputs through one spawned (dedicated) aggregator behind a relay; block 0: sized by
    the path (the inputs' blocks of 1001)."""
    inputs = omnireduce_inputs(n, block or 1001)
    backend_cls, relays = relayed(om.OmniReduceBackend, faults, seed)

    def work(rank, backend):
        return [backend.allreduce(x[rank], f"o{i}") for i, x in enumerate(inputs)]

    try:
        results = run_backends(n, backend_cls, work, omnireduce_mode="dedicated", omnireduce_num_aggregators=1,
                            omnireduce_block_size=block, omnireduce_columns=24, omnireduce_retransmit_ms=3.0)
    finally:
        for relay in relays:
            relay.stop()
    return results, relays[0].counters


@pytest.mark.parametrize("n, block", [(2, 32), (4, 32), (2, 1001), (2, 0)])   # 1001: not a multiple of the vectors
def test_omnireduce_bit_identical_under_reordering_jitter_loss_duplication(n, block):
    inputs = omnireduce_inputs(n, block or 1001)
    faulty, relayed = run_omnireduce(n, NASTY, block=block)
    for rank in range(n):
        for i, x in enumerate(inputs):   # integer-valued: exact in any order of addition
            assert faulty[rank][i].tobytes() == x.sum(axis=0, dtype=x.dtype).tobytes(), f"tensor {i} rank {rank}"
    assert relayed["up"]["lost"] > 0 and relayed["down"]["reordered"] > 0, relayed


def test_relay_applies_each_fault():
    """The relay itself: loss, duplication and reordering at about the asked rates, echo target."""
    import socket
    import threading
    import time
    echo = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    echo.bind(("127.0.0.1", 0))
    echo.settimeout(0.5)
    faults = Faults(loss=0.2, duplicate=0.2, reorder=0.3, reorder_ms=20.0)
    with FaultRelay(echo.getsockname(), up=faults, seed=3) as relay:
        client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        client.bind(("127.0.0.1", 0))
        seen_by_target = relay.link(client.getsockname())
        got, sources = [], set()

        def receive():   # while sending: a full receive buffer would be a loss of its own
            try:
                while True:
                    data, source = echo.recvfrom(64)
                    sources.add(source)
                    got.append(int.from_bytes(data, "big"))
            except socket.timeout:
                pass
        reader = threading.Thread(target=receive)
        reader.start()
        for i in range(500):
            client.sendto(i.to_bytes(4, "big"), relay.address)
            time.sleep(0.0005)
        reader.join(10.0)
        client.close()
    echo.close()
    c = relay.counters["up"]
    assert c["received"] == 500 and 60 < c["lost"] < 140 and 50 < c["duplicated"] < 130
    assert len(got) == 500 - c["lost"] + c["duplicated"]
    assert sources == {seen_by_target}
    assert any(b < a for a, b in zip(got, got[1:])), "nothing was reordered"


def test_a_flood_of_sources_leaves_the_relay_forwarding_for_its_own_workers(monkeypatch):
    """A socket per source address: a flood of sources took every file descriptor and one EMFILE ended
    the relay's UDP thread, so nothing was forwarded for anyone. Now beyond MAX_PEERS they are lost and
    counted, and the workers linked before still get through."""
    import socket
    monkeypatch.setattr(FaultRelay, "MAX_PEERS", 4)
    target = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    target.bind(("127.0.0.1", 0))
    target.settimeout(2.0)
    with target, FaultRelay(target.getsockname()) as relay:
        worker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        worker.bind(("127.0.0.1", 0))
        relay.link(worker.getsockname())
        strangers = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(10)]
        for stranger in strangers:
            stranger.sendto(b"flood", relay.address)
        got = [target.recv(64) for _ in range(3)]          # 3 strangers fill the 4 links
        worker.sendto(b"mine", relay.address)
        assert target.recv(64) == b"mine" and got == [b"flood"] * 3
        assert relay.counters["up"]["unlinked"] == 7 and all(t.is_alive() for t in relay._threads)
        for sock in (worker, *strangers):
            sock.close()

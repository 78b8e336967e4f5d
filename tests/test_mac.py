"""The packet MAC's two algorithms (switch/csrc/transport.h, switch/packet_mac.py): AES-256-GCM (GMAC)
and ChaCha20-Poly1305 from OpenSSL, chosen per job by rank 0 and bound into the key's derivation.

Each is checked against the `cryptography` package's; a packet MACed under one is refused by a job of
the other (no downgrade); both give bit-identical sums end to end (switchml and omnireduce, under
simulated loss), the portable one forced on a CPU with AES-NI; the fuzz targets run with each."""
import socket
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

import commlib.backends.omnireduce as om
import commlib.backends.switchml as sml
from commlib.errors import ConfigError
from commlib.settings import Settings
from commlib.switch import auth, packet_mac
from commlib.testing import LocalGroup
from helpers import fuzz, run_backends

sw = sml.sw
if sw.lib is None:   # not built: a failure of the suite, never a quiet skip
    raise ImportError(sw.IMPORT_ERROR)
lib, ffi = sw.lib, sw.ffi

pytestmark = pytest.mark.timeout(120)

AES, CHACHA = "aes-256-gcm", "chacha20-poly1305"
LABEL = b"commlib switchml packets"


def reference_tag(algorithm, job_key, label, nonce, message):
    """transport.h's MAC with the `cryptography` package: the AEAD's tag over an empty plaintext with
    `message` as associated data, under HKDF-SHA256(job key, info), the info naming AES-256-GCM."""
    if algorithm == AES:
        return AESGCM(HKDF(hashes.SHA256(), 32, None, label + b" aes-256-gcm").derive(job_key)).encrypt(
            nonce, b"", message)
    return ChaCha20Poly1305(HKDF(hashes.SHA256(), 32, None, label).derive(job_key)).encrypt(nonce, b"", message)


def new_mac(key, algorithm, label=LABEL):
    m = lib.tp_mac_new(key, label, packet_mac.code(algorithm))
    assert m != ffi.NULL, f"tp_mac_new refused {algorithm}"
    return ffi.gc(m, lib.tp_mac_free)


@pytest.mark.parametrize("algorithm", [AES, CHACHA])
def test_each_algorithm_is_the_standard_one_and_refuses_the_others_tags(algorithm):
    """Tags equal the reference's for packets of 0 B to 40 KiB given as two pieces; a context reused
    for many nonces keeps giving them (no state leaks between calls); the other algorithm, under the
    same job key, label and nonce, refuses every one of them."""
    key = bytes(range(9, 25))
    mine, other = new_mac(key, algorithm), new_mac(key, CHACHA if algorithm == AES else AES)
    rng, tag = np.random.default_rng(5), ffi.new("uint8_t[]", lib.TP_TAG_LEN)
    for length in (0, 1, 20, 1044, 4117, 32808, 41004):
        raw, head, nonce = rng.bytes(length), rng.bytes(8), rng.bytes(lib.TP_NONCE_LEN)
        assert lib.tp_mac_tag(mine, nonce, head, 8, raw, length, tag) == 0
        assert bytes(tag) == reference_tag(algorithm, key, LABEL, nonce, head + raw), (algorithm, length)
        assert lib.tp_mac_check(mine, nonce, head, 8, raw, length, tag) == 1
        assert lib.tp_mac_check(other, nonce, head, 8, raw, length, tag) == 0, f"{algorithm}'s tag passed the other"


def test_the_choice_unknown_names_and_auto(monkeypatch):
    """tp_mac_fast reads this CPU's flags (AES-NI and PCLMULQDQ); auto is one of the two where it has them
    (the faster, timed), ChaCha20-Poly1305 where it lacks them; a name is taken as given; an unknown name
    is a ConfigError naming the valid ones (on every rank: the backends check it first), and C refuses an
    unknown algorithm."""
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    assert packet_mac.cpu_has_aes() == ("aes" in flags and "pclmulqdq" in flags)
    for size in (1064, 32788):
        assert packet_mac.resolve("auto", size) in ((AES, CHACHA) if packet_mac.cpu_has_aes() else (CHACHA,))
    monkeypatch.setattr(packet_mac, "cpu_has_aes", lambda: False)
    assert packet_mac.resolve("auto", 1064) == CHACHA
    assert packet_mac.resolve(CHACHA, 1064) == CHACHA and packet_mac.resolve(AES, 1064) == AES
    with pytest.raises(ConfigError, match="aes-256-gcm, chacha20-poly1305 or auto"):
        packet_mac.resolve("siphash", 1064)
    for backend in (sml.SwitchMLBackend, om.OmniReduceBackend):
        errors = LocalGroup(2, Settings({"packet_mac": "siphash"})).run(lambda ctx: _error(backend, ctx), 20)
        assert all(isinstance(e, ConfigError) and "siphash" in str(e) for e in errors), errors
    assert lib.tp_mac_new(bytes(16), LABEL, 0) == ffi.NULL and lib.tp_mac_new(bytes(16), LABEL, 99) == ffi.NULL


@pytest.mark.parametrize("job_mac, worker_mac", [(AES, CHACHA), (CHACHA, AES)])
def test_a_worker_of_the_other_algorithm_is_refused(job_mac, worker_mac):
    """A job registered (signed) with one algorithm; a C worker holding the right job key but MACing with
    the other: the switch drops every packet (drop_bad_mac) and aggregates none, the worker times out.
    The same worker with the job's algorithm then gets its sum."""
    daemon_key = bytes(range(32))
    server = sw.SwitchServer(key=daemon_key).start()
    socks = []
    try:
        nonce = auth.new_nonce()
        job_key = auth.job_key(daemon_key, nonce)
        client = sw.SwitchClient(server.address, key=job_key, rank=0)
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        socks.append(sock)
        sock.connect(("127.0.0.1", server.port))
        reply = client.register(sw.token32("t"), [list(sock.getsockname())], 1, 64, nonce=nonce,
                                authenticate=True, mac=job_mac)
        assert reply["packet_mac"] == job_mac
        x = np.arange(64, dtype=np.int32)
        for mac, expect_ok in ((worker_mac, False), (job_mac, True)):
            worker = ffi.gc(lib.sml_worker_new(sock.fileno(), reply["job"], 0, sw.token32("t"), 1, 1, 64, 5.0, 20.0,
                                               0, job_key, packet_mac.code(mac)), lib.sml_worker_free)
            out = np.zeros_like(x)
            rc = lib.sml_worker_allreduce(worker, 1, ffi.from_buffer(x), ffi.from_buffer(out), x.size, ffi.NULL,
                                          ffi.NULL, ffi.NULL, 300 if not expect_ok else 5000)
            counters = client.counters(reply["job"])["counters"]
            if expect_ok:
                assert rc >= 0 and out.tobytes() == x.tobytes(), (rc, counters)
            else:
                assert rc == lib.SML_E_TIMEOUT, f"a {mac} worker got rc {rc} from a {job_mac} job"
                assert counters["drop_bad_mac"] > 0 and counters["aggregated"] == 0, counters
                del worker   # its packets stay in flight no more
    finally:
        for s in socks:
            s.close()
        server.stop()


def _error(backend_class, ctx):
    try:
        backend_class(ctx).close()
    except ConfigError as exc:
        return exc
    return None


# -- end to end: the sums are bit-identical under either algorithm -------------------------------
def _inputs(rank, i, size):
    rng = np.random.default_rng(100 * i + rank)
    if i % 2:
        return rng.integers(-1000, 1000, size, dtype=np.int32)
    return np.round(rng.standard_normal(size).astype(np.float32) * 64) + 0.0


def _work(rank, backend):
    sums = [backend.allreduce(_inputs(rank, i, size), f"t{i}") for i, size in enumerate([1, 3000, 20000, 1001, 70001])]
    return sums, backend.stats()["packet_mac"]


def test_switchml_sums_are_bit_identical_under_both_algorithms_and_loss():
    """switchml with AES-256-GCM and with ChaCha20-Poly1305 forced (this host has AES-NI or not: the
    setting decides), 5% loss and duplication on the embedded switch: the same bytes on every rank."""
    outs = {}
    for mac in (AES, CHACHA):
        outs[mac] = run_backends(3, sml.SwitchMLBackend, _work, packet_mac=mac, switch_window=16, switch_packet_elems=1001,
                         switch_drop_probability=0.05, switch_duplicate_probability=0.05,
                         switch_retransmit_ms=1.0, switch_retransmit_max_ms=20.0)
        assert {used for _, used in outs[mac]} == {mac}, f"the job ran {[u for _, u in outs[mac]]}, not {mac}"
    for rank in range(3):
        for i, (a, b) in enumerate(zip(outs[AES][rank][0], outs[CHACHA][rank][0])):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), f"tensor {i} of rank {rank} differs"


@pytest.mark.parametrize("mode", ["colocated", "dedicated"])
def test_omnireduce_sums_are_bit_identical_under_both_algorithms_and_loss(mode):
    """omnireduce likewise (its own loss and duplication simulator), exact: integer-valued inputs."""
    outs = {}
    for mac in (AES, CHACHA):
        outs[mac] = run_backends(3, om.OmniReduceBackend, _work, packet_mac=mac, omnireduce_mode=mode,
                         omnireduce_block_size=256, omnireduce_columns=8, omnireduce_sim_loss=0.05,
                         omnireduce_sim_dup=0.05, omnireduce_retransmit_ms=3.0, omnireduce_num_aggregators=2)
        assert {used for _, used in outs[mac]} == {mac}
    for rank in range(3):
        for i, (a, b) in enumerate(zip(outs[AES][rank][0], outs[CHACHA][rank][0])):
            expected = sum(_inputs(r, i, a.size) for r in range(3))
            assert a.tobytes() == b.tobytes() == expected.astype(a.dtype).tobytes(), f"tensor {i} of rank {rank}"


def test_a_two_level_job_macs_its_partial_sums_with_the_jobs_algorithm(tmp_path):
    """Leaves and a spine (one daemon key), each algorithm: the leaves MAC their partial sums upward under the
    spine job's key with the job's algorithm (the spine drops none), and the sums are the same bits."""
    daemon_key = auth.new_key()
    key_file = str(tmp_path / "switch.key")
    auth.write_key(key_file, daemon_key)
    *leaves, spine = [sw.SwitchServer("127.0.0.1", 0, slots=64, key=daemon_key).start() for _ in range(3)]
    try:
        def work(rank, backend):
            sums = [backend.allreduce(_inputs(rank, i, size), f"t{i}") for i, size in enumerate([3000, 257])]
            switches = backend.switch_counters()["switches"].values()   # its leaf's and the spine's
            return sums, backend.stats()["packet_mac"], [c["counters"] for c in switches]
        outs = {mac: run_backends(4, sml.SwitchMLBackend, work, packet_mac=mac, switch_key_file=key_file,
                          switch_addr=",".join(s.address for s in leaves), switch_spine=spine.address,
                          switch_placement="0,1,1,0", switch_packet_elems=256, switch_window=8)
                for mac in (AES, CHACHA)}
        for mac, out in outs.items():
            assert {used for _, used, _ in out} == {mac}
            counters = out[0][2]
            assert sum(c["drop_bad_mac"] for c in counters) == 0 and all(c["aggregated"] for c in counters), counters
        for rank in range(4):
            for i, (a, b) in enumerate(zip(outs[AES][rank][0], outs[CHACHA][rank][0])):
                assert a.tobytes() == b.tobytes(), f"tensor {i} of rank {rank} differs"
    finally:
        for server in leaves + [spine]:
            server.stop()


# -- the fuzz targets with each algorithm (tests/fuzz/targets.py: COMMLIB_FUZZ_MAC) ---------------

@pytest.mark.long   # the ASan + UBSan build, as test_fuzz's packet targets
@pytest.mark.timeout(300)
@pytest.mark.parametrize("algorithm", [AES, CHACHA])
@pytest.mark.parametrize("target", ["switch_packets", "switch_leaf_packets", "aggregator_packets"])
def test_packet_fuzz_targets_under_asan_with_each_algorithm(tmp_path, target, algorithm):
    rc, log = fuzz(tmp_path, target, "--sanitized", "-runs=800", "-max_total_time=30", env={"COMMLIB_FUZZ_MAC": algorithm})
    assert rc == 0 and "Done 800 runs" in log, log[-3000:]

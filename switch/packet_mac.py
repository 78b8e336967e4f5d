"""The packet MAC's algorithm, a job parameter (switch/csrc/transport.h): AES-256-GCM (GMAC) or
ChaCha20-Poly1305, both from OpenSSL.

The job's rank 0 resolves the `packet_mac` setting (auto: ChaCha20-Poly1305 where its CPU lacks AES-NI
or PCLMULQDQ, else the faster of the two on the job's packets, timed there) and every rank takes its
choice; rank 0 sends the name in its signed registration (switch/switchml.py, switch/aggregator.py),
so every rank, switch and aggregator keys the packets' MAC with one algorithm, and the name is in
the key's HKDF label: a packet MACed under one algorithm is refused by a job of the other, and a
network attacker cannot change the choice (the registration's MAC covers it).
"""
from commlib.errors import ConfigError
from commlib.settings import define

try:
    from commlib._native import ffi, lib
except ImportError:   # not built: the backends say how (switch/switchml.py's IMPORT_ERROR)
    ffi = lib = None

define("packet_mac", "auto", "the MAC algorithm of switchml's and omnireduce's packets, chosen by rank 0: "
       "'aes-256-gcm' (GMAC: needs AES-NI and PCLMULQDQ to be fast), 'chacha20-poly1305' (portable), or 'auto' "
       "(the faster of the two on the job's packets, timed on rank 0; the portable one without those instructions)")

AUTO = "auto"
PORTABLE = "chacha20-poly1305"   # a registration that names none (a client that predates the choice)


def algorithms():
    """{name: TP_MAC_* code} of the algorithms the C data path has (names from transport.h)."""
    return {ffi.string(lib.tp_mac_name(code)).decode(): code
            for code in (lib.TP_MAC_AES_256_GCM, lib.TP_MAC_CHACHA20_POLY1305)}


def cpu_has_aes():
    """Whether this CPU has AES-NI and PCLMULQDQ (without them OpenSSL's AES-GCM is slow)."""
    return bool(lib.tp_mac_fast())


def resolve(setting, packet_bytes):
    """The algorithm `packet_mac` names for a job of packets of about packet_bytes, on this host (rank 0's
    verdict for its job). auto measures: AES-256-GCM costs less per call, but ChaCha20-Poly1305 may cost
    less per byte (OpenSSL 3.0 on an AVX-512 CPU: AES-256-GCM ahead at 1 KiB, ChaCha20-Poly1305 at
    32 KiB; bench_kernels.py), so the packets' own size decides, where the CPU lets AES-GCM compete."""
    if setting != AUTO:
        code(setting)
        return setting
    if not cpu_has_aes():
        return PORTABLE
    return fastest(packet_bytes)


def fastest(packet_bytes, calls=24, rounds=5):
    """The algorithm whose MAC of a packet_bytes packet takes the least CPU time of this thread: the
    least of `rounds` batches of `calls` each, the algorithms interleaved (a millisecond or two; a busy
    host slows a batch, rarely every one)."""
    import os
    import time
    packet, nonce = ffi.from_buffer(os.urandom(packet_bytes)), os.urandom(lib.TP_NONCE_LEN)
    tag = ffi.new("uint8_t[]", lib.TP_TAG_LEN)
    macs = {name: ffi.gc(lib.tp_mac_new(os.urandom(lib.TP_KEY_LEN), b"commlib packet_mac timing", c), lib.tp_mac_free)
            for name, c in algorithms().items()}
    best = dict.fromkeys(macs, float("inf"))
    for _ in range(rounds):
        for name, mac in macs.items():
            start = time.thread_time_ns()
            for _ in range(calls):
                lib.tp_mac_tag(mac, nonce, b"", 0, packet, packet_bytes, tag)
            best[name] = min(best[name], time.thread_time_ns() - start)
    return min(best, key=best.get)


def code(name):
    """The TP_MAC_* code of an algorithm's name (from a setting or a registration)."""
    known = algorithms()
    if name not in known:
        raise ConfigError(f"packet_mac={str(name)[:40]!r} is not a packet MAC algorithm: use one of "
                          f"{', '.join(sorted(known))} or {AUTO}")
    return known[name]

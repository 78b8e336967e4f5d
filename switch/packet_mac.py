"""The packet MAC's algorithm, a job parameter (switch/csrc/transport.h): AES-256-GCM (GMAC) on CPUs
with AES-NI and PCLMULQDQ, ChaCha20-Poly1305 elsewhere, both from OpenSSL.

The job's rank 0 resolves the `packet_mac` setting (auto: its own CPU) and every rank takes its
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
       "'aes-256-gcm' (GMAC: fast with AES-NI and PCLMULQDQ), 'chacha20-poly1305' (portable), or 'auto' (the "
       "first where rank 0's CPU has those instructions, else the second)")

AUTO = "auto"
PORTABLE = "chacha20-poly1305"   # a registration that names none (a client that predates the choice)


def algorithms():
    """{name: TP_MAC_* code} of the algorithms the C data path has (names from transport.h)."""
    return {ffi.string(lib.tp_mac_name(code)).decode(): code
            for code in (lib.TP_MAC_AES_256_GCM, lib.TP_MAC_CHACHA20_POLY1305)}


def resolve(setting):
    """The algorithm `packet_mac` names on this host (rank 0's verdict for its job)."""
    if setting == AUTO:
        return "aes-256-gcm" if lib.tp_mac_fast() else PORTABLE
    code(setting)
    return setting


def code(name):
    """The TP_MAC_* code of an algorithm's name (from a setting or a registration)."""
    known = algorithms()
    if name not in known:
        raise ConfigError(f"packet_mac={str(name)[:40]!r} is not a packet MAC algorithm: use one of "
                          f"{', '.join(sorted(known))} or {AUTO}")
    return known[name]

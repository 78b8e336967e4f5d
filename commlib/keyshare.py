"""Rank 0's secret to every rank over the launcher's channel, sealed: nothing on that wire derives it.

Every rank draws an ephemeral X25519 key pair and the ranks allgather their public keys. Rank 0
then seals the secret for each rank r with ChaCha20-Poly1305 under

    HKDF-SHA256(X25519(rank 0, rank r), salt=anchor, info=LABEL | public 0 | public r | r)

and broadcasts the sealed copies, with rank 0's public value (the controller's address) bound to
each as associated data, so that value cannot be altered either. What holds:

- a passive observer of the launcher's channel sees public keys and ciphertexts only: the secret
  needs a private key that never leaves its process (and the ephemeral keys die with it, so a
  key file stolen later opens no captured job);
- an active attacker on that channel, without an anchor, can put its own public keys in the
  exchange and learn the secret: X25519 alone says nothing of who holds a key;
- with an anchor (a key file every rank reads, COMMLIB_ANCHOR_KEY_FILE), the sealing key needs
  it too: an attacker who swaps or alters anything learns nothing and every rank gets a clear error.
"""
import json
import secrets

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from commlib.errors import ConfigError

LABEL = b"commlib job secret v1"
PUBLIC_BYTES = 32
NONCE_BYTES = 12


def _public_bytes(private):
    return private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _sealing_key(private, theirs, public0, public_r, rank, anchor):
    shared = private.exchange(X25519PublicKey.from_public_bytes(theirs))
    info = LABEL + public0 + public_r + rank.to_bytes(4, "big")
    return HKDF(hashes.SHA256(), 32, salt=anchor or None, info=info).derive(shared)


def share(rank, allgather, broadcast, secret, public=None, anchor=None):
    """Rank 0's `secret` (bytes; None on other ranks) and `public` (any picklable value of rank 0's, such
    as an address, riding in the same broadcast) on every rank: returns (secret, public).
    allgather(bytes) -> every rank's bytes (index = rank); broadcast(obj) -> rank 0's obj on every rank:
    the launcher's channel, which others may read (and, without an `anchor`, alter).
    anchor: bytes every rank holds and no attacker does (a key file's), or None.
    The secret is None on a rank whose sealed copy did not open (the exchange was altered, or the
    ranks hold different anchors): the caller tells every rank (`unopened`)."""
    private = X25519PrivateKey.generate()
    mine = _public_bytes(private)
    publics = [bytes(p) for p in allgather(mine)]
    if len(publics) <= rank or publics[rank] != mine or any(len(p) != PUBLIC_BYTES for p in publics):
        raise ConfigError(f"rank {rank}: the launcher's allgather of the ranks' public keys came back malformed "
                          f"({[len(p) for p in publics]} bytes); the launcher's channel was altered")
    sealed = None
    if rank == 0:
        sealed = []
        for r, theirs in enumerate(publics):
            nonce = secrets.token_bytes(NONCE_BYTES)
            key = _sealing_key(private, theirs, publics[0], theirs, r, anchor)
            sealed.append((nonce + ChaCha20Poly1305(key).encrypt(nonce, secret, _bound(public))).hex())   # JSON travels
    sealed, public = broadcast((sealed, public))
    try:
        mine_sealed = bytes.fromhex(sealed[rank])
        nonce, box = mine_sealed[:NONCE_BYTES], mine_sealed[NONCE_BYTES:]
        key = _sealing_key(private, publics[0], publics[0], mine, rank, anchor)
        return ChaCha20Poly1305(key).decrypt(nonce, box, _bound(public)), public
    except (InvalidTag, IndexError, TypeError, ValueError):   # ValueError: not hex
        return None, public


def _bound(public):
    """The associated data of a sealed copy: the label and rank 0's public value as JSON (a tuple and the
    list a launcher may hand back for it read alike)."""
    return LABEL + json.dumps(public, separators=(",", ":"), sort_keys=True).encode()


def unopened(ranks):
    return ConfigError(f"the job's secret from rank 0 did not open on ranks {ranks}: the launcher's traffic was "
                       f"altered on the way, or the ranks read different COMMLIB_ANCHOR_KEY_FILE keys; give every "
                       f"rank the same key file")


def allgather_bytes(engine):
    """allgather(bytes) over a ring engine's array allgather."""
    return lambda data: [part.tobytes() for part in engine.allgather(np.frombuffer(data, np.uint8).copy(),
                                                                     "commlib.keyshare")]


def broadcast_json(allgather, rank):
    """broadcast(value) -> rank 0's value on every rank, as JSON in the bytes `allgather` carries: the
    engines' own broadcast_object unpickles what the launcher's channel brings (MPI's bcast, torch's and
    Horovod's broadcast_object), which an attacker on that channel could make run code."""
    def broadcast(value):
        return json.loads(allgather(json.dumps(value).encode() if rank == 0 else b"")[0])
    return broadcast

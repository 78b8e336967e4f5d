"""Issue 24, item 1: rank 0's secret reaches every rank sealed (commlib.keyshare), over a launcher's
channel that an attacker reads or rewrites. Ranks are threads; the channel is `Wire`, which hands
each rank what the attacker (if any) wants it to see. What the tests show is what the README's
Security section says: a passive observer learns nothing; an active one, without an anchor, takes the
secret; with an anchor (a key file every rank reads) it takes nothing and every rank gets an error."""
import json
import pickle
import secrets
import threading

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from commlib import bootstrap, keyshare
from commlib.context import Context
from commlib.errors import ConfigError
from commlib.settings import Settings

pytestmark = pytest.mark.timeout(60)


class Wire:
    """The launcher's allgather and broadcast between `size` threads. Everything that crosses it is
    kept in `seen`; `attacker`, if given, rewrites what each rank receives."""

    def __init__(self, size, attacker=None):
        self.size, self.attacker, self.seen = size, attacker, []
        self._barrier = threading.Barrier(size, timeout=20)
        self._slots = [None] * size

    def allgather(self, rank):
        def call(data):
            self._meet(rank, data)
            everyone = list(self._slots)
            self._barrier.wait()   # the slots are free again only when all have read them
            return self.attacker.allgather(rank, everyone) if self.attacker else everyone
        return call

    def broadcast(self, rank):
        def call(value):
            self._meet(rank, value)
            root = self._slots[0]
            self._barrier.wait()
            return self.attacker.broadcast(rank, root) if self.attacker else root
        return call

    def _meet(self, rank, value):
        self._slots[rank] = value
        if rank == 0:
            self.seen.append(pickle.dumps(value))
        self._barrier.wait()


def run_ranks(size, fn):
    """fn(rank) on `size` threads; [result or exception] by rank."""
    out = [None] * size

    def main(rank):
        try:
            out[rank] = fn(rank)
        except Exception as exc:   # compared by the test
            out[rank] = exc
    threads = [threading.Thread(target=main, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out


def share_over(wire, secret, anchors):
    return run_ranks(wire.size, lambda rank: keyshare.share(rank, wire.allgather(rank), wire.broadcast(rank),
                                                             secret if rank == 0 else None, ("10.0.0.1", 99),
                                                             anchors[rank]))


class ManInTheMiddle:
    """Puts a public key of its own in place of every rank's, towards the others, opens what rank 0
    seals for it and seals it again for the real rank: X25519's textbook attack."""

    def __init__(self, size):
        self.keys = [X25519PrivateKey.generate() for _ in range(size)]
        self.public = [keyshare._public_bytes(k) for k in self.keys]
        self.real, self.taken, self.failed = None, None, []

    def allgather(self, rank, everyone):
        self.real = everyone
        if rank == 0:   # rank 0 sees the attacker's keys for the other ranks
            return [everyone[0]] + self.public[1:]
        return [self.public[0]] + everyone[1:]   # the others see the attacker's key for rank 0

    def broadcast(self, rank, root):
        if rank == 0:
            return root
        sealed, public = root
        theirs = bytes.fromhex(sealed[rank])
        nonce, box = theirs[:keyshare.NONCE_BYTES], theirs[keyshare.NONCE_BYTES:]
        real0, real_r = self.real[0], self.real[rank]
        try:   # the attacker holds no anchor: it derives as if there were none
            opening = keyshare._sealing_key(self.keys[rank], real0, real0, self.public[rank], rank, None)
            self.taken = ChaCha20Poly1305(opening).decrypt(nonce, box, keyshare._bound(public))
        except Exception:   # the anchor kept it out: it forwards what it has
            self.failed.append(rank)
            return root
        resealing = keyshare._sealing_key(self.keys[0], real_r, self.public[0], real_r, rank, None)
        forged = list(sealed)
        forged[rank] = (nonce + ChaCha20Poly1305(resealing).encrypt(nonce, self.taken, keyshare._bound(public))).hex()
        return forged, public


@pytest.mark.parametrize("size", [1, 2, 5])
def test_every_rank_gets_the_secret_and_the_wire_holds_nothing_that_opens_it(size):
    secret, wire = secrets.token_bytes(32), Wire(size)
    out = share_over(wire, secret, [None] * size)
    assert out == [(secret, ("10.0.0.1", 99))] * size
    wire_bytes = b"".join(wire.seen)
    assert secret not in wire_bytes
    assert len(wire_bytes) > size * keyshare.PUBLIC_BYTES   # what a passive observer has: public keys, sealed copies


def test_an_anchor_changes_nothing_for_honest_ranks():
    secret, anchor = secrets.token_bytes(32), secrets.token_bytes(32)
    assert share_over(Wire(3), secret, [anchor] * 3) == [(secret, ("10.0.0.1", 99))] * 3


def test_without_an_anchor_an_active_attacker_takes_the_secret():
    """What does NOT hold, and the README says so: no anchor, no defence against a man in the middle."""
    secret, attacker = secrets.token_bytes(32), ManInTheMiddle(3)
    out = share_over(Wire(3, attacker), secret, [None] * 3)
    assert attacker.taken == secret
    assert [o[0] for o in out] == [secret] * 3   # and no rank can tell


def test_with_an_anchor_the_attacker_takes_nothing_and_no_rank_opens_a_forgery():
    secret, anchor, attacker = secrets.token_bytes(32), secrets.token_bytes(32), ManInTheMiddle(3)
    out = share_over(Wire(3, attacker), secret, [anchor] * 3)
    assert attacker.taken is None and sorted(attacker.failed) == [1, 2]
    assert out[0][0] == secret and [o[0] for o in out[1:]] == [None, None], out


def test_ranks_with_different_anchors_do_not_open():
    anchors = [b"a" * 32, b"a" * 32, b"b" * 32]
    out = share_over(Wire(3), secrets.token_bytes(32), anchors)
    assert [o[0] is None for o in out] == [False, False, True]


def test_an_altered_sealed_copy_fails_on_every_rank_with_what_to_do(tmp_path):
    """Through bootstrap.start_controller (the real controller on loopback): one rank's copy flipped on
    the wire, and every rank, not only that one, raises the error that says what to do."""

    class Flipper:
        def allgather(self, rank, everyone):
            return everyone

        def broadcast(self, rank, root):
            sealed, public = root
            if rank == 2:
                sealed = list(sealed)
                sealed[2] = sealed[2][:-1] + ("0" if sealed[2][-1] != "0" else "1")
            return sealed, public

    wire = Wire(3, Flipper())
    settings = Settings({"timeout_s": 10})

    def rank_main(rank):
        placement = Context(rank, 3, rank, 3, "threads")
        return bootstrap.start_controller(settings, placement, wire.broadcast(rank), allgather=wire.allgather(rank))

    out = run_ranks(3, rank_main)
    for rank, result in enumerate(out):
        assert isinstance(result, ConfigError), (rank, result)
        assert "did not open on ranks [2]" in str(result) and "COMMLIB_ANCHOR_KEY_FILE" in str(result), result


def test_an_altered_controller_address_fails_on_every_rank_with_what_to_do():
    """Rank 0's public value (the controller's address) is bound to each sealed copy: redirected on
    its way to ranks 1 and 2 (to a controller of the attacker's), their copies do not open, and every
    rank, rank 0 too, raises the error that says what to do, told over the launcher's channel."""

    class Redirect:
        def allgather(self, rank, everyone):
            return everyone

        def broadcast(self, rank, root):
            sealed, public = root
            return (sealed, ("127.0.0.1", 1)) if rank else root

    wire = Wire(3, Redirect())
    settings = Settings({"timeout_s": 10})
    out = run_ranks(3, lambda rank: bootstrap.start_controller(settings, Context(rank, 3, rank, 3, "threads"),
                                                                wire.broadcast(rank), allgather=wire.allgather(rank)))
    for rank, result in enumerate(out):
        assert isinstance(result, ConfigError), (rank, result)
        assert "did not open on ranks [1, 2]" in str(result), result


def test_the_anchor_key_file_is_read_on_every_rank(tmp_path):
    from commlib.switch import auth
    key_file = tmp_path / "anchor.key"
    auth.write_key(str(key_file))
    wire, settings = Wire(2), Settings({"timeout_s": 10, "anchor_key_file": str(key_file)})

    def rank_main(rank):
        server, client, secret = bootstrap.start_controller(settings, Context(rank, 2, rank, 2, "threads"),
                                                            wire.broadcast(rank), allgather=wire.allgather(rank))
        client.close()
        return secret
    first, second = run_ranks(2, rank_main)
    assert isinstance(first, bytes) and first == second


def test_a_job_across_hosts_without_an_anchor_is_warned_of(caplog):
    """horovodrun's and torchrun's stores take a write from any host that reaches them: across hosts, a
    job without an anchor is told that its secret is there for such a host to take (rank 0, once)."""
    wire, settings = Wire(2), Settings({"timeout_s": 10, "controller_host": "127.0.0.1"})

    def rank_main(rank):   # one rank per host
        server, client, secret = bootstrap.start_controller(settings, Context(rank, 2, 0, 1, "threads"),
                                                            wire.broadcast(rank), allgather=wire.allgather(rank))
        client.close()
        return secret
    with caplog.at_level("WARNING", logger="commlib"):
        first, second = run_ranks(2, rank_main)
    assert isinstance(first, bytes) and first == second
    warned = [r.message for r in caplog.records if "without COMMLIB_ANCHOR_KEY_FILE" in r.message]
    assert len(warned) == 1 and "can take the job's secret" in warned[0], caplog.text


class _Ran:
    """A pickle that records having been loaded: what an attacker on the launcher's channel would send."""
    ran = False

    def __reduce__(self):
        return (_Ran._mark, ())

    @staticmethod
    def _mark():
        _Ran.ran = True


def test_the_bootstraps_broadcast_is_json_and_never_unpickles_what_the_channel_brings():
    """The engines' broadcast_object unpickled (MPI's bcast, torch's and Horovod's broadcast_object): an
    attacker on the launcher's channel could have run code on every rank. commlib's is JSON in raw bytes."""
    values = {0: ["127.0.0.1", 4242], 1: None}
    sent = {}

    def allgather(rank):
        def gather(data):
            sent[rank] = data
            return [json.dumps(values[0]).encode() if r == 0 else b"" for r in range(2)]
        return gather

    assert [keyshare.broadcast_json(allgather(r), r)(values[r]) for r in range(2)] == [["127.0.0.1", 4242]] * 2
    assert sent == {0: b'["127.0.0.1", 4242]', 1: b""}
    forged = pickle.dumps(_Ran())
    with pytest.raises(ValueError):
        keyshare.broadcast_json(lambda data: [forged, b""], 1)(None)
    assert not _Ran.ran

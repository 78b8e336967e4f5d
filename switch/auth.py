"""Keys of the switch, the aggregators and the jobs they serve: one word per concept.

- daemon key: 32 secret bytes a daemon (commlib-switch, commlib-aggregator) and the jobs allowed to
  use it share. It never crosses the network: a daemon reads it from a file (`--key-file`); an
  embedded daemon gets it from the rank that starts it (in process, or on the child's stdin); the
  ranks of a job get it from rank 0 through the job's own rendezvous (the launcher's broadcast).
  Holding it is the admission to register a job.
- job key: 16 bytes derived from the daemon key and a job nonce (random, public, sent with the
  registration), so each job's packets are keyed apart and a key learnt from one job opens no other
  (the daemon key does open them all: the jobs that share a daemon trust each other).
  The C data path keys its per-packet MAC with it (the job's `mac` algorithm, AES-256-GCM or
  ChaCha20-Poly1305: switch/csrc/transport.h; `packet_mac` resolves it).
- control MAC: every control request carries `mac`, a keyed BLAKE2b over its other fields and a
  per-sender sequence number `seq` (the signer's clock in ns), each accepted once within a window,
  so a sniffed request cannot be replayed.
"""
import hashlib
import hmac
import json
import os
import secrets
import stat
import threading
import time
from collections import OrderedDict

from commlib.errors import ConfigError

DAEMON_KEY_BYTES = 32
JOB_KEY_BYTES = 16
NONCE_BYTES = 16
MAC_BYTES = 16


def new_key():
    return secrets.token_bytes(DAEMON_KEY_BYTES)


def new_nonce():
    return secrets.token_hex(NONCE_BYTES)


def read_key(path):
    """The daemon key in `path` (hex text, as `write_key` writes it)."""
    try:
        with open(path) as f:
            mode = os.fstat(f.fileno()).st_mode
            if mode & 0o077 and stat.S_ISREG(mode):   # as ssh: a key others may read is no secret
                raise ConfigError(f"the key file {path!r} is readable by others (mode {mode & 0o777:o}): "
                                  f"`chmod 600 {path}`")
            key = bytes.fromhex(f.read().strip())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the key file {path!r} ({exc}); create one with "
                          f"`python -m commlib.switch.auth {path}`") from exc
    if len(key) < 16:
        raise ConfigError(f"the key in {path!r} has {len(key)} bytes; use at least 16 "
                          f"(`python -m commlib.switch.auth {path}` writes 32)")
    return key


def write_key(path, key=None):
    """Write a new (or the given) daemon key to `path`, readable by its owner only."""
    key = key or new_key()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)                      # O_CREAT's mode applies to a new file only
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
    return key


def job_key(daemon_key, nonce):
    """The job's data-plane key: keyed BLAKE2b of the job's public nonce."""
    return hashlib.blake2b(b"commlib job " + nonce.encode(), key=daemon_key, digest_size=JOB_KEY_BYTES).digest()


def key_check(job_key):
    """A public check of a job key (a leaf switch compares it with the key it derives for the spine's job,
    switch/switchml.py): a keyed BLAKE2b of a constant, which tells nothing of the key."""
    return hashlib.blake2b(b"commlib key check", key=job_key, digest_size=8).hexdigest()


def stream_key(job_key, stream):
    """The data-plane key of a job's stream `stream` on one switch (one shard, switchml.py): the job key
    for stream 0, a keyed BLAKE2b of the stream's number for the others, so that streams whose packet ids
    and ranks coincide never MAC under one key with one nonce."""
    if stream == 0:
        return job_key
    return hashlib.blake2b(b"commlib stream %d" % stream, key=job_key, digest_size=JOB_KEY_BYTES).digest()


def _mac(key, fields):
    body = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(body, key=key, digest_size=MAC_BYTES).hexdigest()


def sign(key, request, seq):
    """`request` (a control message) with its sequence number and MAC added."""
    fields = {k: v for k, v in request.items() if k != "mac"}
    fields["seq"] = seq
    return {**fields, "mac": _mac(key, fields)}


def verify(key, request):
    """True when `request` carries a valid MAC under `key` (the caller checks that seq is fresh: Replays)."""
    mac = request.get("mac")
    if not isinstance(mac, str) or not isinstance(request.get("seq"), int):
        return False
    fields = {k: v for k, v in request.items() if k != "mac"}
    return hmac.compare_digest(mac, _mac(key, fields))


class Signer:
    """A client's side: signs its requests under one key, each with a larger seq than the last (the
    clock in ns, so a restarted client's seqs are new to the daemon)."""

    def __init__(self, key):
        self.key, self._seq, self._lock = key, 0, threading.Lock()

    def __call__(self, request):
        with self._lock:
            self._seq = max(time.time_ns(), self._seq + 1)
            seq = self._seq
        return sign(self.key, request, seq)


class Replays:
    """A daemon's side, an anti-replay window per sender (as IPsec's): a request is fresh when its
    seq was not seen from its sender and lies within WINDOW_NS of the daemon's clock (Signer's seq
    is the signer's wall clock in ns, so the ranks' and the daemon's clocks must agree within that,
    as NTP keeps them). Several clients signing as one sender (an operator's concurrent requests)
    may arrive out of order within the window; a replayed request carries a seen seq, or an old one:
    also after its sender was forgotten (an ended job), so a sniffed register cannot revive a job.
    Bounded: `limit` senders (least recent forgotten first), `per_sender` seqs each (a sender
    sending more within the window loses its oldest, which then count as seen)."""

    WINDOW_NS = 30 * 10**9

    def __init__(self, limit=65536, per_sender=256):
        self._seen, self.limit, self.per_sender = OrderedDict(), limit, per_sender

    def admit(self, key, request, sender, what, hint):
        """Refuse `request` (control.Refused, counted by reason) unless it is signed with `key` and
        its seq is fresh for `sender`; `hint` says which key file the job should be given."""
        from commlib.switch import control
        if not verify(key, request):
            raise control.Refused("bad_mac", f"{what} refused: the request is not signed with {hint}")
        self.check(sender, request["seq"], what)

    def check(self, sender, seq, what):
        """Refuse (control.Refused "replay") a seq that is not fresh for `sender`."""
        from commlib.switch import control
        if not self.fresh(sender, seq):
            raise control.Refused("replay", f"{what} refused: its seq was seen before or is more than "
                                            f"{self.WINDOW_NS // 10**9} s from the daemon's clock (a replayed "
                                            f"request, or this host's clock is far from the daemon's)")

    def fresh(self, sender, seq, now=None):
        """True (and remembered) when `sender` has not used `seq` and it is within the window."""
        now = time.time_ns() if now is None else now
        floor = now - self.WINDOW_NS
        seen = self._seen.setdefault(sender, set())
        # from further ahead than the window: it would fill the sender's seqs with ones its real
        # requests never reach (those then fall below them once full)
        if seq <= floor or seq > now + self.WINDOW_NS or seq in seen or \
                (len(seen) >= self.per_sender and seq < min(seen)):
            return False
        seen.add(seq)
        seen.difference_update([s for s in seen if s <= floor])
        while len(seen) > self.per_sender:
            seen.discard(min(seen))
        self._seen.move_to_end(sender)
        while len(self._seen) > self.limit:
            self._seen.popitem(last=False)
        return True

    def forget(self, prefix):
        """Drop the senders whose key starts with `prefix` (a tuple): an ended job's ranks."""
        for sender in [s for s in self._seen if s[:len(prefix)] == prefix]:
            del self._seen[sender]


def unauthenticated(daemon, why):
    """Why a job with `authenticate` on refuses `daemon`, and the two ways to go on."""
    return (f"COMMLIB_AUTHENTICATE is on (the default) but {why}, so the job's packets to the {daemon} would "
            f"carry no MACs: start it with --key-file FILE and give the job the same file, or set "
            f"COMMLIB_AUTHENTICATE=0 to run without MACs (a trusted fabric only)")


def check_nonce(nonce):
    """A job nonce from a request: a short string (new_nonce() gives 32 hex digits)."""
    if not isinstance(nonce, str) or not 8 <= len(nonce) <= 64:
        raise ValueError("the job nonce must be a string of 8..64 characters (auth.new_nonce())")
    return nonce


if __name__ == "__main__":   # python -m commlib.switch.auth PATH: write a new daemon key file
    import sys
    if len(sys.argv) != 2:
        sys.exit("usage: python -m commlib.switch.auth KEY_FILE")
    write_key(sys.argv[1])
    print(f"wrote a new daemon key to {sys.argv[1]}")

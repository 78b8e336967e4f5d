"""Negotiation: every rank agrees on each tensor before any data moves (Horovod's coordinator).

Rank 0 runs a `ControllerServer` thread; every rank (rank 0 included) holds a `ControllerClient`.
Ranks submit the metadata of tensors as they become ready; once all ranks submitted a name
and agree on it, the server releases it in a `go` batch, once per cycle. Every client receives
the same batches in the same order, so all ranks run the same tensors in the same order (and
fuse them identically). Disagreement is a `Mismatch` (names too: every rank waits for tensors the
others never submitted), a tensor some ranks never submit is a `CommTimeout` (after a stall
warning), a rank that vanishes or leaves after an error is a `PeerFailure`: all raised on every
rank. An error that arrives while a collective is running takes effect when that collective
returns or hits its own timeout (the backends' `timeout_s`).

Steady state (Horovod's response cache): a release whose algorithm no rank's measurement decides
gets a bit, the same on every rank. A rank that submits that name again with the very metadata it
submitted then sends only the bit ("hits"); rank 0 ANDs the ranks' bits and releases the cached
releases whose bit every rank sent, with no per-tensor work. A rank whose metadata changed (shape,
dtype, op, policy result, ...) submits in full: that evicts the bit on every rank and the others'
hits turn back into their full metadata, so the round is negotiated, and checked, as without a
cache. Hits left waiting for HIT_WAIT_S turn back the same way, so the stall warnings, timeouts
and the name-pairing Mismatch see every tensor. A process set and a job formed anew (an elastic
reset) have controllers, and caches, of their own.

Join (Horovod's hvd.join): a rank out of data joins; until every rank has, the others' tensors
are released without it, and it runs each with a stand-in (zeros, or the op's identity) built from
the release's metadata. Releases are not cached while a rank is joined (the joined rank sends no
hits). Once every rank joined, a `joined` event names the last one.

The same channel carries `exchange` (an allgather of small JSON values) for backends' set-up.
Messages are length-prefixed JSON: the channel never unpickles what a peer sends. Only the job's
ranks take part: each connection answers a fresh challenge with a proof that it holds the job's
secret (commlib.keyshare hands it out before anyone connects), under a key of that connection's own,
and every message after it carries a tag under that key (`Link`), so nobody without the secret can
take a rank's place, pose as the controller, or inject, alter or replay a message; a stranger's
connection costs the others nothing while it waits (HELLO_S, HELLO_BYTES).
"""
import collections
import dataclasses
import errno
import hashlib
import hmac
import json
import logging
import queue
import secrets
import selectors
import socket
import struct
import threading
import time

from commlib.errors import KINDS, CommError, CommTimeout, PeerFailure, error_from
from commlib.release import Release
from commlib.tensors import nbytes as tensor_bytes

log = logging.getLogger("commlib")
_HEADER = struct.Struct("!I")
# Fields all ranks must agree on for a tensor (besides its name).
AGREED_FIELDS = ("shape", "dtype", "op", "choices", "compression", "prescale", "postscale")
# Every rank waiting for tensors no other rank submitted, with no submission for this long: the
# ranks' names differ (a Mismatch) rather than a rank being slow.
PAIRING_GRACE_S = 5.0
# Hits that wait this long for the other ranks' turn back into full negotiation (bounded by the
# negotiation timeout); bits at most (Horovod: HOROVOD_CACHE_CAPACITY), an evicted one free again once
# every rank has dropped it (ControllerServer._reclaim).
HIT_WAIT_S = 1.0
CACHE_CAPACITY = 4096
# With nothing waiting (no tensor, hit, exchange or join), the loop sleeps until a message comes, or
# this long: no cycle runs while a job computes (a 1 ms cycle cost rank 0 3% of a core, idle)
IDLE_WAIT_S = 1.0
# A connection says hello within HELLO_S, in at most HELLO_BYTES; a message is at most MAX_MESSAGE
# bytes (a step's metadata is far less): a length beyond is garbage, never buffered
HELLO_S = 5.0
HELLO_BYTES = 1024
GREETING_MAX = 64   # connections waiting to say hello at once (at least twice the ranks)
MAX_MESSAGE = 64 << 20
# A rank's sender holds what its caller submits back to back (each submission within QUIET cycles of
# the one before: no compute between them), for HOLD cycles at most: a send in the middle of such a
# burst splits it into buckets run beside the submitting thread (2 ranks, 400 tensors, `auto`: 26.4 ->
# 23.4 ms a step); a backward's gradients come with compute between them, and go once per cycle as before
QUIET = 0.25
HOLD = 8
WELCOME_BYTES = 1 << 20   # its first message to a rank: the welcome, or why the job did not form
NONCE_BYTES = 16
TAG_BYTES = 16


def _body(msg):
    return json.dumps(msg, separators=(",", ":")).encode()


def send_msg(sock, msg):
    """A handshake message (no tag: before a connection has its key)."""
    data = _body(msg)
    sock.sendall(_HEADER.pack(len(data)) + data)


class Forged(ValueError):
    """A message whose tag is not its sender's: injected or altered on the way."""


def recv_msg(sock, limit=HELLO_BYTES, deadline=None):
    """One handshake message, or None when the peer closed the connection."""
    body = _recv_frame(sock, limit, deadline=deadline)
    return None if body is None else json.loads(body)


def _recv_frame(sock, limit, extra=0, deadline=None):
    """A message's body (and `extra` bytes after it), or None when the peer closed; ValueError for a
    length over `limit`; socket.timeout past `deadline` (time.monotonic()), however the bytes trickle."""
    header = _recv_exact(sock, _HEADER.size, deadline)
    return None if header is None else _recv_exact(sock, _length(header, limit) + extra, deadline)


def _length(header, limit):
    """The body length a frame's header announces; ValueError past `limit` (never buffered)."""
    length = _HEADER.unpack(header)[0]
    if length > limit:
        raise ValueError(f"a message of {length} bytes (at most {limit})")
    return length


def _recv_exact(sock, n, deadline=None):
    chunks = bytearray()
    while len(chunks) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("past the deadline")
            sock.settimeout(left)
        chunk = sock.recv(n - len(chunks))
        if not chunk:
            return None
        chunks += chunk
    return bytes(chunks)


def session_key(secret, server_nonce, client_nonce, rank):
    """A connection's own key: the job's secret over both ends' fresh nonces and the rank it serves."""
    return hashlib.blake2b(b"commlib controller v1" + server_nonce + client_nonce + rank.to_bytes(4, "big"),
                           key=secret, digest_size=32).digest()


def set_secret(secret, name):
    """A process set's controller's own secret: the job's over the set's name, so that neither the
    job's controller nor another set's can stand in for it (they all hold the job's secret)."""
    return hashlib.blake2b(b"commlib controller of " + name.encode(), key=secret, digest_size=32).digest()


def proof(key):
    """A hello's proof that the rank holds the job's secret (the key it derives from it)."""
    return hashlib.blake2b(b"hello", key=key, digest_size=TAG_BYTES).hexdigest()


class Link:
    """A connection after its handshake: each message is followed by a keyed BLAKE2b tag of its
    direction, its number on the connection and its body, so a message altered, injected, replayed
    or reordered on the way fails (Forged), and the connection with it. One sender at a time."""

    def __init__(self, sock, key, server):
        self.sock, self._key = sock, key
        self._out, self._in = (b"s", b"c") if server else (b"c", b"s")
        self._sent = self._received = 0

    def send(self, msg, body=None):
        """body: msg already encoded (_body), where one message goes to every rank (encoded once)."""
        body = _body(msg) if body is None else body
        tag = self._tag(self._out, self._sent, body)
        self._sent += 1
        try:
            self.sock.sendall(_HEADER.pack(len(body)) + body + tag)
        except OSError:   # maybe half sent: nothing may follow it, the peer reads the end instead
            _quietly(self.sock.shutdown, socket.SHUT_RDWR)
            raise

    def recv(self, limit=MAX_MESSAGE, deadline=None):
        """One message, or None when the peer closed the connection; Forged for a message that is not the
        peer's, ValueError for one it garbled; socket.timeout when it is not whole by `deadline`."""
        timeout = self.sock.gettimeout()
        try:
            frame = _recv_frame(self.sock, limit, TAG_BYTES, deadline)
        finally:   # the deadline's leftover must not bound the sends that follow
            self.sock.settimeout(timeout)
        if frame is None:
            return None
        body, tag = frame[:-TAG_BYTES], frame[-TAG_BYTES:]
        if not hmac.compare_digest(tag, self._tag(self._in, self._received, body)):
            raise Forged("a message failed its tag: it is not the peer's (altered or injected on the way)")
        self._received += 1
        return json.loads(body)

    def _tag(self, direction, number, body):
        digest = hashlib.blake2b(direction + number.to_bytes(8, "big"), key=self._key, digest_size=TAG_BYTES)
        digest.update(body)
        return digest.digest()


def _ranks_text(ranks):
    return "rank " + str(ranks[0]) if len(ranks) == 1 else "ranks " + ",".join(map(str, ranks))


def _names_text(names, most=5):
    shown = ", ".join(map(repr, sorted(names)[:most]))
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def check_agreement(name, metas):
    """metas: {rank: meta}. Returns None, or a message naming the tensor, field and ranks."""
    first = next(iter(metas.values()))
    if all(meta.get(field) == first.get(field) for meta in metas.values() for field in AGREED_FIELDS):
        return None   # the common case, on every tensor: no text built (it was rank 0's largest cost)
    for field in AGREED_FIELDS:
        groups = {}
        for rank, meta in sorted(metas.items()):
            groups.setdefault(json.dumps(meta.get(field)), []).append(rank)
        if len(groups) > 1:
            sides = "; ".join(f"{_ranks_text(ranks)} gave {value}" for value, ranks in groups.items())
            return (f"tensor {name!r}: ranks disagree on {field}: {sides}. Every rank must reduce the same "
                    f"tensors with the same {field}.")
    return None


class ControllerServer:
    """Rank 0's coordinator. Single thread: accept all ranks, then a select loop per cycle."""

    def __init__(self, size, host, port, settle, timeout_s, cycle_time_ms, *, secret, negotiation_timeout_s=None,
                 stall_warning_s=None, tuner=None):
        """settle(name, metas in rank order) -> the Release of a tensor every rank agreed on.
        secret: the job's (bytes), which every rank proves it holds.
        tuner: a commlib.autotune.Tuner, which then sets the cycle time and every go's tuned values."""
        self.size = size
        self._secret = secret
        self._tuner = tuner
        self._released_bytes = 0   # since the last go (the tuner's score)
        self._settle = settle
        self.timeout_s = timeout_s
        self.negotiation_timeout_s = negotiation_timeout_s or timeout_s
        self.stall_warning_s = stall_warning_s or self.negotiation_timeout_s
        self.cycle_s = (tuner.cycle_ms if tuner else cycle_time_ms) / 1000.0
        self.token = secrets.token_hex(16)
        self._listener = socket.create_server((host, port))
        self.address = self._listener.getsockname()[:2]
        self._clients = {}        # rank -> Link
        self._pending = {}        # tensor name -> its rounds, oldest first: {"metas": {rank: meta}, "since": t, "warned": bool}
        self._gathers = {}        # key -> {"values": {rank: value}, "since": t}
        self._ready = []          # [Release] released at the next cycle
        self._done = set()        # ranks that said bye
        self._left = set()        # ranks shutting down (they said leave): they submit nothing more
        self._last_submit = time.monotonic()
        self._last_go = 0.0       # when the last batch went
        self._burst = 0.0         # when submissions came again after a cycle without any
        self._hurried = False     # a rank waits for what it submitted since the last batch went
        self._failed = False
        self._cache = []          # bit -> {"name", "release", "metas": {rank: meta}}, evicted ones until reused
        self._bit_of = {}         # tensor name -> its live bit
        self._live = 0            # the live bits
        self._hits = [0] * size   # per rank: the bits it sent, not yet released
        self._hit_times = collections.deque()   # (when, rank, bits) per message with hits, oldest first
        self._ready_bits = 0      # released at the next cycle
        self._evicted = []        # bits evicted since the last cycle
        self._gos = 0             # go messages sent: a rank's submission says how many it had read (`seen`)
        self._seen = [0] * size   # per rank: the most gos it had read when it last submitted
        self._freeing = collections.deque()   # (the go that evicted it, bit), until every rank has read that go
        self._free = []           # evicted bits no rank will send again: the next cached releases take them
        self._joined = []         # ranks that called join, in order; reset once every rank has
        self._stopped = False
        self._thread = threading.Thread(target=self._serve, name="commlib-controller", daemon=True)
        self._thread.start()

    def join(self, timeout):
        self._thread.join(timeout)

    def close(self):
        """Stop admitting ranks (a job that failed to form): the listener's port is free at once."""
        self._stopped = True
        _quietly(self._listener.shutdown, socket.SHUT_RDWR)   # wakes the accept loop's select

    def _serve(self):
        try:
            if self._accept_all():
                self._loop()
        finally:
            for link in self._clients.values():
                link.sock.close()
            self._listener.close()

    def _accept_all(self):
        """Admit every rank: each connection gets a fresh challenge and has HELLO_S to answer it, all
        at once, so a silent or slow stranger holds nobody up."""
        deadline = time.monotonic() + self.timeout_s
        selector = selectors.DefaultSelector()
        self._listener.setblocking(False)
        selector.register(self._listener, selectors.EVENT_READ)
        greeting = {}   # socket -> [its challenge, when it must have answered, what it sent so far], oldest first
        try:
            while len(self._clients) < self.size:
                if self._stopped:
                    return False
                now = time.monotonic()
                for sock in [sock for sock, (_, due, _) in greeting.items() if due <= now]:
                    self._refuse(selector, greeting, sock, "said no hello in time")
                if now >= deadline:
                    missing = sorted(set(range(self.size)) - set(self._clients))
                    self._broadcast_error("CommTimeout", f"{_ranks_text(missing)} did not connect to the controller "
                                          f"within {self.timeout_s}s; check that every rank calls commlib.init()")
                    return False
                wake = min([deadline] + [due for _, due, _ in greeting.values()])
                for key, _ in selector.select(wake - now):
                    if key.fileobj is self._listener:
                        self._greet(selector, greeting)
                    elif key.fileobj in greeting:   # not refused earlier in this batch (_greet made way for one)
                        self._hear(selector, greeting, key.fileobj)
        finally:
            selector.close()
            for sock in greeting:
                sock.close()
        for link in self._clients.values():   # a rank gone meanwhile: the loop reads its end and names it
            _quietly(link.send, {"t": "welcome", "token": self.token})
        return True

    def _greet(self, selector, greeting):
        """A new connection gets its challenge. Those waiting to answer are bounded (a rank answers at
        once): past GREETING_MAX the oldest is dropped, so a flood of connections cannot use up the
        process's descriptors and keep the ranks out."""
        try:
            sock, _ = self._listener.accept()
        except OSError as exc:   # gone before it was accepted; or out of descriptors: make way, do not spin
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                if greeting:
                    self._refuse(selector, greeting, next(iter(greeting)), "made way for a newer one")
                else:
                    time.sleep(0.01)
            return
        if len(greeting) >= max(GREETING_MAX, 2 * self.size):
            self._refuse(selector, greeting, next(iter(greeting)), "made way for a newer one")
        challenge = secrets.token_bytes(NONCE_BYTES)
        try:
            sock.settimeout(1.0)
            send_msg(sock, {"t": "challenge", "nonce": challenge.hex()})
            sock.setblocking(False)
        except OSError:
            sock.close()
            return
        selector.register(sock, selectors.EVENT_READ)
        greeting[sock] = [challenge, time.monotonic() + HELLO_S, bytearray()]

    def _hear(self, selector, greeting, sock):
        """What a connection sent of its hello; once it is whole, the rank is admitted or refused."""
        challenge, _, received = greeting[sock]
        try:
            data = sock.recv(_HEADER.size + HELLO_BYTES - len(received))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        received += data
        if not data:
            return self._refuse(selector, greeting, sock, "closed before its hello")
        try:
            length = _length(received[:_HEADER.size], HELLO_BYTES) if len(received) >= _HEADER.size else None
        except ValueError as exc:
            return self._refuse(selector, greeting, sock, f"announced {exc}")
        if length is None or len(received) < _HEADER.size + length:
            return   # the rest comes later (until HELLO_S)
        selector.unregister(sock)
        del greeting[sock]
        try:
            hello = json.loads(bytes(received[_HEADER.size:_HEADER.size + length]))
            rank = hello["rank"]
            if hello["t"] != "hello" or type(rank) is not int or not 0 <= rank < self.size:   # (JSON's true: no rank)
                raise ValueError(f"not a hello from a rank of this job: {hello!r:.200}")
            if rank in self._clients:
                raise ValueError(f"rank {rank} is connected already")
            nonce = bytes.fromhex(hello["nonce"])
            if len(nonce) != NONCE_BYTES:
                raise ValueError(f"a hello with a nonce of {len(nonce)} bytes")
            key = session_key(self._secret, challenge, nonce, rank)
            if not hmac.compare_digest(str(hello["proof"]), proof(key)):
                raise ValueError(f"a connection as rank {rank} without the job's secret")
        except Exception as exc:   # whatever a stranger sends (RecursionError: deep JSON) ends only its connection
            log.warning("commlib controller: refused a connection: %s", exc)
            sock.close()
            return
        sock.setblocking(True)
        sock.settimeout(self.timeout_s)   # a rank that stops reading cannot stall the others forever
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._clients[rank] = Link(sock, key, server=True)

    def _refuse(self, selector, greeting, sock, why):
        log.warning("commlib controller: refused a connection that %s", why)
        selector.unregister(sock)
        del greeting[sock]
        sock.close()

    def _loop(self):
        selector = selectors.DefaultSelector()
        for rank, link in self._clients.items():
            selector.register(link.sock, selectors.EVENT_READ, rank)
        next_cycle = time.monotonic() + self.cycle_s
        while len(self._done) < self.size and not self._failed:
            idle = not self._waiting()
            for key, _ in selector.select(IDLE_WAIT_S if idle else max(0.0, next_cycle - time.monotonic())):
                rank, why = key.data, None
                try:   # a whole message within timeout_s, however its bytes trickle: this thread serves every rank
                    msg = self._clients[rank].recv(deadline=time.monotonic() + self.timeout_s)
                except Forged as exc:
                    msg, why = None, f"carried a message that is not rank {rank}'s ({exc})"
                except socket.timeout:
                    msg, why = None, f"sent part of a message and not the rest within {self.timeout_s}s"
                except OSError:   # reset: that rank is gone
                    msg = None
                except Exception as exc:   # garbled by that rank, or its length altered (the tag follows it)
                    msg, why = None, f"carried a message the controller cannot read ({type(exc).__name__}: {exc})"
                if msg is None:
                    selector.unregister(key.fileobj)
                    if why is not None:
                        self._broadcast_error("PeerFailure", f"rank {rank}'s connection to the controller {why}; "
                                              f"the job stops")
                    elif rank not in self._done:
                        self._broadcast_error("PeerFailure", f"rank {rank} exited or lost its connection "
                                              f"to the controller; see that rank's output for the cause")
                    continue
                try:
                    self._handle(rank, msg)
                except Exception as exc:   # never the loop's end: every rank hears why (a bug of ours: logged)
                    log.exception("commlib controller: handling rank %d's message failed", rank)
                    self._broadcast_error("PeerFailure", f"the controller failed handling rank {rank}'s message "
                                          f"({type(exc).__name__}: {exc}); the job stops")
            now = time.monotonic()
            if idle and now >= next_cycle:   # a quiet spell ended: a cycle starts (a burst's first goes at once)
                next_cycle = now + self.cycle_s
            # a batch goes when the cycle ends, or at once when it is the first of a burst of submissions
            # (a lone bucket, DDP's first of a backward, does not wait for the cycle; a stream still goes in
            # batches) or when a rank waits for what it submitted (ControllerClient.hurry, or a submission
            # hurried: a synchronous call, DDP's last bucket)
            at_once = (self._ready or self._ready_bits) and (self._last_go < self._burst or self._hurried)
            if (now >= next_cycle or at_once) and not self._failed:
                try:
                    self._release()
                    self._expire()
                except Exception as exc:   # a bug of ours: every rank hears it, rather than of rank 0's death
                    log.exception("commlib controller: a cycle failed")
                    self._broadcast_error("PeerFailure", f"the controller failed ({type(exc).__name__}: {exc}); "
                                          f"the job stops")
                next_cycle = time.monotonic() + self.cycle_s

    def _waiting(self):
        """Whether anything waits for a cycle: a release, a hit, a round, an exchange or a join."""
        return bool(self._ready or self._ready_bits or self._evicted or self._pending or self._hit_times
                    or self._gathers or self._joined)

    def _handle(self, rank, msg):
        kind = msg["t"]
        if kind == "submit":
            if rank in self._left:   # (another of its threads, after shutdown began): nobody waits for it
                return
            self._hurried = self._hurried or msg.get("hurry") is True
            seen = msg.get("seen")
            if type(seen) is int and seen > self._seen[rank]:
                self._seen[rank] = min(seen, self._gos)
                if self._freeing:
                    self._reclaim()
            if not msg["metas"] and not msg.get("hits"):   # a hurry alone: no submission to count
                return
            now = time.monotonic()
            if now - self._last_submit >= self.cycle_s:
                self._burst = now
            self._last_submit = now
            for meta in msg["metas"]:
                bit = self._bit_of.get(meta["name"])
                if bit is not None:   # this rank's metadata changed: every rank negotiates it anew
                    self._evict(bit)
                self._submit(rank, meta)
            if msg.get("hits"):
                self._hit(rank, int(msg["hits"], 16))
        elif kind == "gather":   # among every rank, or among msg["ranks"] only (a process set forming)
            among = msg.get("ranks") or list(range(self.size))
            if type(among) is not list or any(type(r) is not int for r in among) or among != sorted(set(among)) \
                    or not 0 <= among[0] <= among[-1] < self.size or rank not in among:
                raise ValueError(f"rank {rank} asked for an exchange among {str(among)[:80]}: not ranks of this job "
                                 f"in order, with its own")
            entry = self._gathers.setdefault(msg["key"], {"values": {}, "since": time.monotonic(), "among": among})
            if entry["among"] != among:   # the values go back in the order of `among`: one order for all
                raise ValueError(f"rank {rank} asked for exchange {str(msg['key'])[:80]!r} among {among}, the others "
                                 f"among {entry['among']}")
            entry["values"][rank] = msg["value"]
            if len(entry["values"]) == len(entry["among"]):
                values = self._gathers.pop(msg["key"])["values"]
                self._send_to(entry["among"], {"t": "gathered", "key": msg["key"],
                                               "values": [values.get(r) for r in entry["among"]]})
        elif kind == "leave":   # a rank shutting down: it submits nothing more
            self._left.add(rank)
            if msg.get("error"):   # it failed: the others get its error now, not a timeout naming someone else
                self._broadcast_error("PeerFailure", f"rank {rank} failed and left the job: {msg['error']}")
                return
        elif kind == "join":
            self._join(rank)
        elif kind == "bye":
            self._done.add(rank)
        if self._left:
            self._expire_hits(time.monotonic(), everything=True)
            self._fail_abandoned()

    def _submit(self, rank, meta):
        name = meta["name"]
        rounds = self._pending.setdefault(name, [])
        # a rank may submit a name again before the others' metas of its refused round arrived:
        # its submissions fill the rounds in order
        entry = next((e for e in rounds if rank not in e["metas"]), None)
        if entry is None:
            entry = {"metas": {}, "since": time.monotonic(), "warned": False}
            rounds.append(entry)
        entry["metas"][rank] = meta
        self._complete_ready(name)

    def _complete_ready(self, name):
        """Release the oldest round of `name` if every rank submitted it or joined."""
        rounds = self._pending[name]
        if len(rounds[0]["metas"]) + len(set(self._joined) - set(rounds[0]["metas"])) == self.size:
            self._complete(name, rounds.pop(0)["metas"])
            if not rounds and self._pending.get(name) is rounds:   # (_complete's evictions may submit again)
                del self._pending[name]

    def _join(self, rank):
        """A rank out of data: the rounds that waited only for it are released now, and the ranks'
        hits turn into full submissions until every rank joined (the joined rank sends no bits)."""
        if rank not in self._joined:
            self._joined.append(rank)
        for other, pending in enumerate(self._hits):   # hits that waited for its bit: in full
            self._hits[other] = 0
            for bit in _bits(pending):
                self._submit(other, self._cache[bit]["metas"][other])
        for name in list(self._pending):
            self._complete_ready(name)

    def _hit(self, rank, bits):
        """A rank submitted the tensors of these bits with the metadata they were cached with."""
        # evicted meanwhile, or a rank joined (it sends no bits): negotiated in full, the bits kept
        stale = bits if self._joined else bits & ~self._live
        bits &= ~stale
        # the live ones first: a stale one's round may complete a revisit's first release, whose
        # eviction of its `auto` group (_evict_auto) then turns them into full submissions as any
        # other's waiting hits; counted after it, they were dropped (this rank's tensor never came)
        self._hits[rank] |= bits
        self._hit_times.append((time.monotonic(), rank, bits))
        for bit in _bits(stale):
            self._submit(rank, self._cache[bit]["metas"][rank])
        ready = self._hits[0]
        for pending in self._hits[1:]:
            ready &= pending
        if ready:
            self._ready_bits |= ready
            self._hits = [pending & ~ready for pending in self._hits]
            if self._tuner:
                for bit in _bits(ready):
                    self._released_bytes += self._cache[bit]["nbytes"]
                    self._tuner.ran(self._cache[bit]["release"].algorithm)

    def _evict(self, bit):
        """Drop a cached release on every rank; the hits waiting for it turn into full submissions."""
        cached = self._cache[bit]
        del self._bit_of[cached["name"]]
        self._live &= ~(1 << bit)
        self._evicted.append(bit)
        for rank, pending in enumerate(self._hits):
            if pending >> bit & 1:
                self._hits[rank] &= ~(1 << bit)
                self._submit(rank, cached["metas"][rank])

    def _reclaim(self):
        """Evicted bits become free once every rank still in the job has read the go that evicted them:
        a rank's messages are in order, and it makes hits of its own cache, which that go emptied of
        them, so no hit of the old tensor can come after (reused at once, a stale hit would be read as
        the new tensor's). Never reused, a long job's `auto` revisits (every group evicted each
        `auto_revisit` steps) used up the cache for good, and every tensor went back to full negotiation."""
        ranks = [self._seen[rank] for rank in range(self.size) if rank not in self._left and rank not in self._done]
        read = min(ranks, default=self._gos)
        while self._freeing and self._freeing[0][0] <= read:
            self._free.append(self._freeing.popleft()[1])

    def _expire_hits(self, now, everything=False):
        """Hits that waited HIT_WAIT_S (or all, when a rank left): negotiated in full."""
        wait = min(HIT_WAIT_S, self.negotiation_timeout_s / 4)
        while self._hit_times:
            when, rank, bits = self._hit_times[0]
            waiting = bits & self._hits[rank]
            if waiting and not everything and now - when < wait:
                return
            self._hit_times.popleft()
            for bit in _bits(waiting):
                if self._live >> bit & 1:
                    self._evict(bit)

    def _fail_abandoned(self):
        """Rounds that wait for a rank that shut down can never complete: fail them at once."""
        for name, rounds in list(self._pending.items()):
            for entry in list(rounds):
                gone = sorted(self._left - set(entry["metas"]))
                if gone:
                    rounds.remove(entry)
                    self._broadcast({"t": "error", "kind": "PeerFailure", "names": [name], "message": (
                        f"tensor {name!r} was submitted by {_ranks_text(sorted(entry['metas']))}, but "
                        f"{_ranks_text(gone)} shut commlib down without it; see that rank's output")})
            if not rounds:
                del self._pending[name]

    def _complete(self, name, metas):
        failed = sorted((rank, meta["error"]) for rank, meta in metas.items() if "error" in meta)
        if failed:   # a rank refused the tensor before any data moved: every rank raises its error
            rank, error = failed[0]
            kind = error.get("kind") if error.get("kind") in KINDS else "CommError"
            # refused_by: those ranks raised already and track nothing of this round; an entry of
            # theirs under this name is a later submission, which this error must not fail
            self._broadcast({"t": "error", "kind": kind, "names": [name], "refused_by": [r for r, _ in failed],
                             "message": f"tensor {name!r} failed on rank {rank}: {error.get('message')}"})
            return
        problem = check_agreement(name, metas)
        joined = sorted(set(range(self.size)) - set(metas))
        if joined and any(meta.get("rows") for meta in metas.values()):
            problem = (f"tensor {name!r} is row-sparse, and {_ranks_text(joined)} joined (commlib.join): sparse "
                       f"tensors cannot be reduced with a joined rank, as in Horovod; reduce it dense, or join later")
        if problem:
            self._broadcast({"t": "error", "kind": "Mismatch", "names": [name], "message": problem})
        else:
            release = self._settle(name, [metas[r] for r in sorted(metas)])
            agreed = next(iter(metas.values()))
            nbytes = 0
            if self._tuner:
                nbytes = _bytes_of(agreed)
                self._tuner.ran(release.algorithm)
            self._released_bytes += nbytes
            if joined:
                release = dataclasses.replace(release, joined={"ranks": joined, **{
                    field: agreed.get(field) for field in ("shape", "dtype", "op", "compression", "prescale",
                                                           "postscale")}})
            elif not self._joined and self._cacheable(release, metas):   # no new bit while a rank is joined
                bit = self._free.pop() if self._free else len(self._cache)
                release = dataclasses.replace(release, bit=bit)
                cached = {"name": name, "release": release, "metas": metas, "nbytes": nbytes}
                if bit < len(self._cache):
                    self._cache[bit] = cached
                else:
                    self._cache.append(cached)
                self._bit_of[name] = bit
                self._live |= 1 << bit
            self._ready.append(release)
            if (release.auto or {}).get("restart"):
                self._evict_auto(release.auto["group"])

    def _evict_auto(self, group):
        """`auto` tries a group's candidates anew (a revisit): the group's releases are dropped from the
        cache, so that its tensors the cache held come in full and run the same trials (kept, they ran
        the old choice beside the others' trials: a step ran two collectives, bench_training's sparse
        model 0.56-0.66x)."""
        for bit in [bit for bit in self._bit_of.values() if (self._cache[bit]["release"].auto or {}).get("group") == group]:
            if self._live >> bit & 1:
                self._evict(bit)

    def _cacheable(self, release, metas):
        """Only a release the ranks' metadata alone decides, the same step after step: no row counts,
        no report of a run, no trial of `auto` under way (rank 0's schedule picks those). A density's
        side of the bounds (dispatch.side_of) is metadata."""
        return (self._free or len(self._cache) < CACHE_CAPACITY) and release.counts is None \
            and "trial" not in (release.auto or ()) \
            and all(not meta.get("rows") and not meta.get("report") and not meta.get("once") for meta in metas.values())

    def _release(self):
        if self._ready or self._ready_bits or self._evicted:
            tuned = {}
            if self._tuner:   # every rank runs this batch with the values it carries (fusion, algorithms' knobs)
                if self._tuner.released(self._released_bytes):
                    self.cycle_s = self._tuner.cycle_ms / 1000.0
                tuned = {"tuned": self._tuner.values}
            self._released_bytes = 0
            self._gos += 1
            self._freeing.extend((self._gos, bit) for bit in self._evicted)
            # the clients expand the hits before they drop the evicted bits
            self._broadcast({"t": "go", "batch": [release.wire() for release in self._ready], "hits": format(self._ready_bits, "x"),
                             "evict": self._evicted, **tuned})
            self._ready, self._ready_bits, self._evicted = [], 0, []
            self._last_go, self._hurried = time.monotonic(), False
        if len(self._joined) == self.size:   # after the last go: every joined rank ran its stand-ins
            self._broadcast({"t": "joined", "last": self._joined[-1]})
            self._joined = []

    def _expire(self):
        now = time.monotonic()
        self._expire_hits(now)
        for name, rounds in list(self._pending.items()):
            entry = rounds[0]   # the oldest round of this name
            waited = now - entry["since"]
            missing = sorted(set(range(self.size)) - set(entry["metas"]) - set(self._joined))
            if waited > self.negotiation_timeout_s:
                rounds.pop(0)
                if not rounds:
                    del self._pending[name]
                self._broadcast({"t": "error", "kind": "CommTimeout", "names": [name], "message": (
                    f"tensor {name!r} was submitted by {_ranks_text(sorted(entry['metas']))} but not by "
                    f"{_ranks_text(missing)} within {self.negotiation_timeout_s}s; every rank must reduce the same "
                    f"tensors (raise COMMLIB_NEGOTIATION_TIMEOUT_S if a rank is just slow)")})
            elif waited > self.stall_warning_s and not entry["warned"]:
                entry["warned"] = True
                self._broadcast({"t": "stall", "message": (
                    f"tensor {name!r} has waited {waited:.0f}s for {_ranks_text(missing)}; it fails after "
                    f"{self.negotiation_timeout_s:.0f}s (COMMLIB_NEGOTIATION_TIMEOUT_S)")})
        self._check_pairing(now)
        for key, entry in list(self._gathers.items()):
            if now - entry["since"] > self.timeout_s:
                del self._gathers[key]
                missing = sorted(set(entry["among"]) - set(entry["values"]))
                message = f"exchange {key!r}: {_ranks_text(missing)} did not take part within {self.timeout_s}s"
                if len(entry["among"]) == self.size:
                    self._broadcast_error("CommTimeout", message)
                else:   # a process set that did not form: its ranks fail, the job goes on
                    self._send_to(entry["among"], {"t": "gathered", "key": key, "error": message})

    def _check_pairing(self, now):
        """Every rank waits for tensors another rank has not submitted, and no rank submitted
        anything for PAIRING_GRACE_S: their names differ (ranks that merely submit in other orders,
        or a slow rank with nothing pending, keep submitting). A Mismatch at once, not a timeout."""
        grace = min(PAIRING_GRACE_S, self.negotiation_timeout_s)
        if not self._pending or now - self._last_submit < grace:
            return
        by_ranks = {}   # the ranks that submitted a waiting tensor -> its names
        for name, rounds in self._pending.items():
            by_ranks.setdefault(tuple(sorted(rounds[0]["metas"])), []).append(name)
        waiting = {rank for ranks in by_ranks for rank in ranks}
        if not set(range(self.size)) - self._left - set(self._joined) <= waiting:
            return   # a rank with nothing pending is still on its way
        sides = "; ".join(f"{_ranks_text(list(ranks))} submitted {_names_text(names)} "
                          f"(not {_ranks_text(sorted(set(range(self.size)) - set(ranks)))})"
                          for ranks, names in sorted(by_ranks.items()))
        names = list(self._pending)
        self._pending.clear()
        self._broadcast({"t": "error", "kind": "Mismatch", "names": names, "message": (
            f"the ranks' tensor names do not pair up: {sides}; every rank waits and none submitted anything for "
            f"{grace:g}s. Every rank must reduce the same tensors under the same names (DDP: the same "
            f"model, with the same parameter names, on every rank)")})

    def _broadcast_error(self, kind, message):
        """An error that breaks the job (names=None): every rank fails everything in flight."""
        self._broadcast({"t": "error", "kind": kind, "names": None, "message": message})
        self._failed = True

    def _broadcast(self, msg):
        self._send_to(self._clients, msg)

    def _send_to(self, ranks, msg):
        body = _body(msg)
        for rank in ranks:
            link = self._clients.get(rank)
            if link is not None and rank not in self._done:
                try:
                    link.send(msg, body)
                except OSError:   # a lost rank is reported when its socket reads EOF
                    pass


def _quietly(call, arg):
    """call(arg), where an OSError means only that the peer is gone (it is reported where its end is read)."""
    try:
        call(arg)
    except OSError:
        pass


def _bytes_of(meta):
    """A tensor's bytes from its metadata (autotune's score); 0 for a dtype numpy cannot size."""
    try:
        return tensor_bytes(meta["shape"], meta["dtype"])
    except CommError:
        return 0


def _bits(mask):
    """The set bits of an int, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class ControllerClient:
    """A rank's end: submit metadata, receive go/error events, exchange small values."""

    def __init__(self, address, rank, timeout_s, cycle_time_ms=1.0, *, secret):
        """secret: the job's (bytes), which this rank proves it holds."""
        self.rank = rank
        self.timeout_s = timeout_s
        self.cycle_s = cycle_time_ms / 1000.0
        # "go" and "error" messages, in server order (SimpleQueue: the background thread's wake-up after
        # a go is on every step's path, and Queue's Condition made it a Python-level hand-off)
        self.events = queue.SimpleQueue()
        self._gathered = {}
        self._cond = threading.Condition()
        self._closed = False
        self._lost = None
        self._send_lock = threading.Lock()
        self._cache = {}      # the response cache: name -> (bit, the meta it was agreed with)
        self._by_bit = {}     # bit -> its release
        self._asked = {}      # name -> the meta submitted in full, until released
        self._cache_lock = threading.Lock()
        self._gos = 0         # go messages read (their evictions applied): sent as `seen` (ControllerServer._reclaim)
        # submissions within a cycle travel as one message (Horovod: one request list per cycle). The
        # caller only appends to the outbox: a lock there, which the reader and the sender also take, cost a
        # step's submitting thread a GIL hand-off whenever another thread held it (17% of its samples, 2 ranks
        # x 400 tensors); a meta becomes a cache hit or a full submission when the outbox goes (_flush)
        self._outbox = collections.deque()
        self._wake = threading.Lock()   # released when the outbox has something for the sender
        self._wake.acquire()
        self._hurried = False   # what was submitted so far went hurried (hurry, or submit's hurry)
        self._last_send = 0.0
        self._last_submit = self._held_since = 0.0   # the last submission; the first the outbox holds
        self._link, welcome = self._handshake(tuple(address), rank, secret, timeout_s)
        self.token = welcome["token"]
        self._reader = threading.Thread(target=self._read, name="commlib-controller-client", daemon=True)
        self._reader.start()
        self._sender = threading.Thread(target=self._send_batches, name="commlib-controller-sender", daemon=True)
        self._sender.start()

    def _handshake(self, address, rank, secret, timeout_s):
        """(Link, welcome): this rank proves it holds the job's secret, and the controller proves it
        too with its first tagged message."""
        sock = self._connect(address, timeout_s)
        deadline = time.monotonic() + timeout_s + 5   # the others may connect up to timeout_s later
        try:
            challenge = recv_msg(sock, deadline=deadline)
            if challenge is None:
                raise OSError("closed")
            server_nonce = bytes.fromhex(challenge["nonce"])
            if challenge["t"] != "challenge" or len(server_nonce) != NONCE_BYTES:
                raise ValueError(f"not a challenge: {challenge!r:.200}")
            nonce = secrets.token_bytes(NONCE_BYTES)
            key = session_key(secret, server_nonce, nonce, rank)
            send_msg(sock, {"t": "hello", "rank": rank, "nonce": nonce.hex(), "proof": proof(key)})
            link = Link(sock, key, server=False)
            welcome = link.recv(WELCOME_BYTES, deadline)   # bounded before the peer proved anything
        except socket.timeout:
            sock.close()
            raise CommTimeout(f"rank {rank}: the controller at {address} did not admit this rank within "
                              f"{timeout_s}s (are all ranks started?)") from None
        except OSError:   # reset: as a close, below
            welcome = None
        except Exception as exc:   # a peer that is not the job's controller
            sock.close()
            raise PeerFailure(f"rank {rank}: the controller at {address} did not prove that it holds the job's "
                              f"secret ({type(exc).__name__}: {exc}): it is another job's or a stranger's, or the "
                              f"traffic was altered; check COMMLIB_CONTROLLER_ADDR and the network") from None
        if welcome is None or welcome.get("t") != "welcome":
            sock.close()
            raise error_from(welcome) if welcome and welcome.get("t") == "error" else PeerFailure(
                f"rank {rank}: the controller at {address} closed the connection during set-up (it refuses a "
                f"connection that does not prove it holds the job's secret, and a rank that connected twice)")
        sock.settimeout(None)
        return link, welcome

    @staticmethod
    def _connect(address, timeout_s):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                sock = socket.create_connection(address, timeout=max(0.1, deadline - time.monotonic()))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise CommTimeout(f"could not reach the commlib controller at {address[0]}:{address[1]} "
                                      f"within {timeout_s}s ({exc}); is rank 0 running?") from None
                time.sleep(0.05)

    def _read(self):
        while True:
            why = "lost the commlib controller on rank 0 (rank 0 exited or crashed); see its output"
            try:
                msg = self._link.recv()
                if msg is not None and msg["t"] == "go":
                    msg = self._expand(msg)
            except Forged as exc:
                msg, why = None, f"the connection to the commlib controller carried a message that is not the " \
                                 f"controller's ({exc}); the job stops"
            except OSError:
                msg = None
            except Exception as exc:
                msg, why = None, f"a message from the commlib controller could not be read ({type(exc).__name__}: " \
                                 f"{exc}); the job stops"
            if msg is None:
                if not self._closed and not self._lost:   # keep the precise reason if one came first
                    self._lost = {"t": "error", "kind": "PeerFailure", "names": None, "message": why}
                    self.events.put(self._lost)
                with self._cond:
                    self._cond.notify_all()
                return
            if msg["t"] == "go" and not msg["batch"]:   # evictions only: the cache took them, nothing to run
                continue
            if msg["t"] == "gathered":
                with self._cond:
                    self._gathered[msg["key"]] = msg
                    self._cond.notify_all()
            else:
                if msg["t"] == "error" and msg["names"] is None:
                    self._lost = msg
                    with self._cond:
                        self._cond.notify_all()
                self.events.put(msg)

    def _send(self, msg):
        if self._lost:
            raise error_from(self._lost)
        with self._send_lock:
            self._flush()   # what this rank submitted reaches the controller before what it says next
            self._link.send(msg)

    def _flush(self, hurry=False):
        """Send the submissions waiting in the outbox (the send lock held): metas agreed before with the
        same contents travel as a bit each, the rest in full. `hurry`: a caller waits for them, so the
        controller releases them at once, not at the end of its cycle."""
        metas = [self._outbox.popleft() for _ in range(len(self._outbox))]   # (the caller may append meanwhile)
        if metas or hurry:
            full, hits = [], 0
            with self._cache_lock:
                for meta in metas:
                    cached = self._cache.get(meta["name"])
                    if cached is not None and (cached[1] is meta or cached[1] == meta):
                        hits |= 1 << cached[0]
                    else:
                        full.append(meta)
                        if "error" not in meta and not meta.get("once"):
                            self._asked[meta["name"]] = meta
                seen = self._gos   # the gos read when these hits were made (ControllerServer._reclaim)
            msg = {"t": "submit", "metas": full, "seen": seen}
            if hits:
                msg["hits"] = format(hits, "x")
            if hurry:
                msg["hurry"] = True
            self._link.send(msg)
        self._last_send = time.monotonic()

    def hurry(self):
        """A caller is about to wait (Handle.hurry): what the outbox holds for the cycle goes now, and the
        controller is told to release at once (at most one message per submission, however many wait:
        alone, an empty one, when the submission went before)."""
        with self._send_lock:
            if not self._hurried:
                self._send_hurried()

    def _send_hurried(self):
        """The outbox, now, with the controller told to release at once (the send lock held)."""
        self._hurried = True
        try:
            self._flush(hurry=True)
        except OSError:   # the reader sees the lost connection and fails what is in flight
            pass

    def _send_batches(self):
        """Sends the outbox at most once per cycle while submissions keep coming, and holds a burst
        of back-to-back submissions (see QUIET): a quarter cycle first (a lone one, DDP's first
        bucket, goes then), a cycle at a time after, HOLD cycles at most."""
        while not self._closed:
            self._wake.acquire()   # until a submission (or close) releases it
            while self._outbox and not self._closed:
                now = time.monotonic()
                delay, held = self._last_send + self.cycle_s - now, now - self._held_since
                if now - self._last_submit < QUIET * self.cycle_s and held < HOLD * self.cycle_s:
                    delay = max(delay, QUIET * self.cycle_s if held < self.cycle_s else self.cycle_s)
                if delay > 0:   # sent within this cycle, or the caller still submitting: gather what else comes
                    time.sleep(delay)
                    continue
                with self._send_lock:
                    try:
                        self._flush()   # empties the outbox before it sends
                    except OSError:   # the reader sees the lost connection and fails what is in flight
                        pass

    def _signal(self):
        """Wake the sender, without blocking: once released, the lock stays so until the sender takes it
        (a step's hundreds of submissions test it; the first releases it)."""
        if self._wake.locked():
            try:
                self._wake.release()
            except RuntimeError:   # another thread released it between the test and here
                pass

    def _expand(self, msg):
        """A go's Releases: its batch, then the cached releases of its hits (bit order, the same on every rank)."""
        batch = [Release(**wire) for wire in msg["batch"]]
        with self._cache_lock:
            for release in batch:
                meta = self._asked.pop(release.name, None)
                if release.bit is not None and meta is not None:
                    self._cache[release.name] = (release.bit, meta)
                    self._by_bit[release.bit] = release
            try:
                batch += [self._by_bit[bit] for bit in _bits(int(msg.get("hits") or "0", 16))]
            except KeyError as exc:   # (the reader fails the job with this: a rank that hung here waited for good)
                raise ValueError(f"a go released cache bit {exc} that this rank does not hold") from None
            for bit in msg.get("evict", ()):
                release = self._by_bit.pop(bit, None)
                if release is not None and self._cache.get(release.name, (None,))[0] == bit:
                    del self._cache[release.name]
            self._gos += 1   # this go's evicted bits are in no hit made from now on
        tuned = msg.get("tuned")
        if tuned:   # autotune's cycle: this rank's batching follows the controller's
            self.cycle_s = tuned["cycle_time_ms"] / 1000.0
        return {"t": "go", "batch": batch, "tuned": tuned}

    def submit(self, metas, hurry=False):
        """Add metas to the outbox; they go within the cycle (see _send_batches). `hurry`: a caller waits
        for them next; they go now, from this thread, as hurry() sends them."""
        if self._lost:
            raise error_from(self._lost)
        if self._closed:
            raise CommError("commlib's connection to the controller is closed (commlib.shutdown() ran): "
                            "call commlib.init() again before reducing")
        now = time.monotonic()
        if not self._outbox:
            self._held_since = now
        self._outbox.extend(metas)
        self._last_submit = now
        self._hurried = False   # a waiter hurries these anew (after they joined the outbox: never left unsent)
        if hurry:
            with self._send_lock:
                self._send_hurried()
        else:
            # the sender thread sends them (at once after a quiet cycle, else when the cycle ends), or a
            # caller about to wait (hurry); not this thread: a caller submitting a step's tensors holds
            # the GIL throughout, and a send from it at its first tensor made that one a bucket alone,
            # a collective more per step (2 ranks x 100 tensors: 5.7 -> 3.8 ms a step without it)
            self._signal()

    def exchange(self, key, value, timeout, ranks=None):
        """Every rank's value (index = rank), or with `ranks` (this rank among them) only theirs,
        in that order: the other ranks need not take part."""
        self._send({"t": "gather", "key": key, "value": value, **({"ranks": list(ranks)} if ranks else {})})
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._gathered or self._lost, timeout + 1.0):
                raise CommTimeout(f"exchange {key!r} got no answer within {timeout}s")
            if key not in self._gathered:
                raise error_from(self._lost)
            answer = self._gathered.pop(key)
        if "error" in answer:
            raise CommTimeout(answer["error"])
        return answer["values"]

    def join(self):
        """This rank is out of data (commlib.join): the others' tensors go on without it; a `joined`
        event follows once every rank joined."""
        self._send({"t": "join"})

    def leave(self, error=None):
        """Tell the controller this rank is shutting down, with the error it fails with (a
        string), if any: the others then fail what waits for this rank at once, naming it."""
        try:
            self._send({"t": "leave", "error": error})
        except (CommError, OSError):
            pass   # the job is gone already: nobody waits for this rank

    def close(self):
        if self._closed:
            return
        self._closed = True
        self._signal()
        try:
            with self._send_lock:
                self._flush()
                self._link.send({"t": "bye"})
        except OSError:
            pass
        self._reader.join(1.0)
        self._link.sock.close()

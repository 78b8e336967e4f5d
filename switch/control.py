"""The control plane of both daemons, commlib-switch and commlib-aggregator: one message format
and one readiness handshake.

Message: one JSON object in UTF-8, ending in a newline. A request names its operation and carries
its fields, {"op": "register", ...}; the answer is {"ok": true, ...fields} or {"ok": false,
"error": "why, and what to do"}. Over TCP (the switch's control port) the messages of one
connection follow each other line by line; over UDP (an aggregator's port, which it shares with
the data plane) one message is one datagram, told apart from data packets by its first byte `{`
(OMR_CONTROL in switch/csrc/omnireduce.h; no data packet type has that value).

Hostile input: `answer` turns every failure of a handler into an error answer and counts it by
reason in the daemon's `Drops`, so no request ends a serving loop. `LineServer` serves the switch's
TCP control port from one thread: bounded connections (the oldest idle one makes room for a new
one), bounded line size, a bounded number of lines per connection and round, idle connections closed.
A request whose answer waits on the network (a leaf's probe of its parent) is `Deferred`: it runs on
a thread of its own, a bounded number at a time, so no request stalls the others' (keepalives).

Readiness: a daemon prints one line `READY host:port[,host:port...]` on stdout once every
endpoint serves, and writes the same addresses to a file when given one (--port-file);
`wait_ready` reads the line.
"""
import errno
import json
import logging
import os
import queue
import selectors
import socket
import threading
import time
from collections import Counter

from commlib.errors import ConfigError

log = logging.getLogger("commlib.switch")

MARK = b"{"       # the first byte of every control message
READY = "READY"


def encode(message):
    """The bytes of one message (a dict)."""
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def decode(data):
    """The message in `data` (one line or one datagram), or None if it is not a JSON object."""
    try:
        message = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):   # RecursionError: deeply nested arrays
        return None
    return message if isinstance(message, dict) else None


class Refused(ConfigError):
    """A request the daemon refuses for a reason worth counting apart (bad_mac, replay, limit, ...)."""

    def __init__(self, reason, message):
        super().__init__(message)
        self.reason = reason


class Drops:
    """Requests a daemon refused or dropped, by reason; thread-safe, readable while it serves."""

    def __init__(self):
        self._counts, self._lock = Counter(), threading.Lock()

    def add(self, reason, n=1):
        with self._lock:
            self._counts[reason] += n

    def snapshot(self):
        with self._lock:
            return dict(self._counts)


def answer(handle, request, drops=None):
    """The answer to `request` (a decoded message, or None): {"ok": True, **handle(request)}, or
    {"ok": False, "error": ..., "reason": ...} when it is malformed or `handle` refuses it (ConfigError, or the
    ValueError/KeyError/TypeError of a missing or mistyped field). Nothing `handle` raises escapes:
    a daemon's serving loop must outlive any request. Refusals are counted in `drops`."""
    def refuse(reason, error):   # the reason too: a client may retry some (a register's "replay")
        if drops is not None:
            drops.add(reason)
        return {"ok": False, "error": error, "reason": reason}

    if request is None:
        return refuse("malformed", 'a request is one JSON object, e.g. {"op": "status"}')
    try:
        fields = handle(request)
        return fields if isinstance(fields, Deferred) else {"ok": True, **fields}
    except Refused as exc:
        return refuse(exc.reason, str(exc))
    except OverflowError as exc:   # cffi: a number beyond its C type that no check caught
        return refuse("invalid", f"a number in the request is out of range ({exc})")
    except KeyError as exc:
        return refuse("invalid", f"the request lacks the field {exc}")
    except (ValueError, TypeError, ConfigError) as exc:
        return refuse("invalid", str(exc)[:500])
    except Exception as exc:       # a bug or a case nobody foresaw: answer, count, keep serving
        log.exception("control request %.200r failed", request)
        return refuse("internal", f"the daemon could not handle the request ({type(exc).__name__}); it was "
                                  f"counted and the daemon keeps serving")


class Deferred:
    """What a handler returns for a request whose answer waits on the network: `work()` gives its
    fields, run off the serving thread (LineServer), or here by `answer`."""
    __slots__ = ("work",)

    def __init__(self, work):
        self.work = work

    def answer(self, drops=None):
        return answer(lambda _: self.work(), {}, drops)


def pad(request, size):
    """`request` with a "pad" field that brings its encoding to about `size` bytes: a daemon answers a
    datagram with no more bytes than it had (as QUIC's padded Initial), so no spoofed request
    amplifies a flood."""
    short = size - len(encode(request)) - len(',"pad":""')
    return dict(request, pad=" " * short) if short > 0 else request


def fit(reply, size):
    """The encoding of `reply` if it is at most `size` bytes, a refusal's reason left out and its error cut
    to fit, else None."""
    data, error = encode(reply), str(reply.get("error", ""))
    if len(data) > size and "reason" in reply:   # the error says it too
        reply = {k: v for k, v in reply.items() if k != "reason"}
        data = encode(reply)
    while len(data) > size and not reply.get("ok", True) and error:   # escapes make it longer than its characters
        error = error[:max(0, len(error) - (len(data) - size) - 3)]
        data = encode(dict(reply, error=error + "..."))
    return data if len(data) <= size else None


def result(reply, what):
    """The fields of an answer; a refusal raises ConfigError naming `what` and the reason."""
    if reply is None:
        raise ConfigError(f"{what}: the answer is not a control message")
    if not reply.pop("ok", False):
        raise ConfigError(f"{what}: {reply.get('error', 'refused')}")
    return reply


def operator_hint(error, key_file):
    """What a counters CLI's user can do when the daemon refused them for want of its key."""
    if key_file or "not signed" not in str(error):
        return ""
    return (" -- pass --key-file with the daemon key it was started with; a switch or aggregator a job "
            "embeds is keyed with that job's secret, which no file holds: read its counters in the job's "
            "trace (COMMLIB_STUDY or COMMLIB_TIMELINE: rank 0 has a row per daemon, sampled while it runs)")


def announce_ready(addresses, port_file=""):
    """The daemon serves at `addresses` ('host:port' each): say so."""
    text = ",".join(addresses)
    if port_file:
        with open(port_file + ".tmp", "w") as f:
            f.write(text)
        os.replace(port_file + ".tmp", port_file)
    print(f"{READY} {text}", flush=True)


def wait_ready(proc, seconds, what="the daemon"):
    """The addresses a child daemon announced on its stdout (a text pipe), waiting at most
    `seconds`; RuntimeError with its exit code and its last words otherwise."""
    lines = queue.Queue()

    def read():   # a thread: select() cannot see lines the pipe's reader already buffered
        for line in proc.stdout:
            lines.put(line)
            if line.startswith(READY + " "):
                return
        lines.put(None)

    threading.Thread(target=read, name="commlib-wait-ready", daemon=True).start()
    deadline, said = time.monotonic() + seconds, []
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        if line.startswith(READY + " "):
            return line.split()[1].split(",")
        said.append(line.strip())
    raise RuntimeError(f"{what} did not start within {seconds:.0f}s (exit code {proc.poll()}, said {said[-3:]!r})")


class LineServer:
    """The switch's TCP control port, served by one thread with a selector: a connection sends lines
    (requests) and reads one answer line per request.

    Bounded: at most `max_connections` open, `max_per_source` from one address (a new one closes
    the connection idle the longest, of its own address when that one has its fill), a line
    of at most `max_line` bytes (a longer one is answered with an error and its connection closed),
    at most `max_pending` answer bytes a client has not read, `idle_s` without a byte closes a
    connection. Fair: a connection has at most `lines_per_round` lines answered per round of the
    selector (the rest wait in its buffer, and it reads no more until they are answered), so one
    client's flood of lines delays the others' requests by a round, not by its length; an empty
    line gets no answer (counted as empty_lines). `handle(request, source_ip)` answers one decoded
    request; `tick()` runs every `tick_s` (expiry of jobs). A `Deferred` answer runs on a thread of its
    own, at most `max_deferred` at a time and `max_deferred_per_source` for one address (beyond them
    refused as busy); its connection's later lines wait for it."""

    def __init__(self, sock, handle, drops, max_connections=256, max_per_source=16, max_line=64 << 10,
                 max_pending=1 << 20, idle_s=30.0, tick=None, tick_s=0.25, lines_per_round=64, max_deferred=8,
                 max_deferred_per_source=2):
        self.sock, self.handle, self.drops = sock, handle, drops
        self.max_per_source, self.lines_per_round = max_per_source, lines_per_round
        self.max_connections, self.max_line, self.max_pending, self.idle_s = max_connections, max_line, \
            max_pending, idle_s
        self.tick, self.tick_s = tick, tick_s
        self.max_deferred, self.max_deferred_per_source = max_deferred, max_deferred_per_source
        self._conns = {}   # socket -> _Conn
        self._deferred = Counter()              # address -> its requests running off this thread
        self._settled = queue.SimpleQueue()     # (socket, address, answer) of those done

    def serve(self, stop):
        """Until `stop` (an Event) is set or the listening socket is closed."""
        self.sock.setblocking(False)
        self._wake, wake_reader = socket.socketpair()   # a deferred answer is ready
        for end in (self._wake, wake_reader):
            end.setblocking(False)
        with selectors.DefaultSelector() as sel, self._wake, wake_reader:
            sel.register(self.sock, selectors.EVENT_READ)
            sel.register(wake_reader, selectors.EVENT_READ)
            self._sel = sel
            next_tick = time.monotonic()
            try:
                while not stop.is_set() and self.sock.fileno() >= 0:
                    for key, events in sel.select(self.tick_s):
                        try:
                            if key.fileobj is self.sock:
                                self._accept()
                            elif key.fileobj is wake_reader:
                                self._settle(wake_reader)
                            else:
                                self._serve(key.fileobj, events)
                        except Exception:   # a bug in our own bookkeeping: drop that connection, keep serving
                            if stop.is_set():
                                return      # stop() shut the listening socket down under accept()
                            log.exception("control connection failed")
                            self.drops.add("internal")
                            if key.fileobj is not self.sock:
                                self._close(key.fileobj)
                    now = time.monotonic()
                    if now >= next_tick:
                        next_tick = now + self.tick_s
                        self._close_idle(now)
                        if self.tick is not None:
                            try:
                                self.tick()
                            except Exception:
                                log.exception("control tick failed")
            finally:
                for conn in list(self._conns):
                    self._close(conn)

    def _accept(self):
        for _ in range(64):                 # a burst of connections, then back to serving
            try:
                conn, (host, _) = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:          # EMFILE and friends: say so, keep serving the others
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self.drops.add("accept_failed")
                    return
                raise
            same = [c for c, state in self._conns.items() if state.host == host]
            if len(same) >= self.max_per_source or len(self._conns) >= self.max_connections:
                self.drops.add("connections_evicted")   # one address cannot push the others out
                crowd = same if len(same) >= self.max_per_source else self._conns
                self._close(min(crowd, key=lambda c: self._conns[c].active))
            conn.setblocking(False)
            self._conns[conn] = _Conn(host)
            self._sel.register(conn, selectors.EVENT_READ)

    def _serve(self, conn, events):
        state = self._conns.get(conn)
        if state is None:                   # closed earlier in this round of events (evicted)
            return
        state.active = time.monotonic()
        # read more only once the lines already here are answered: one client's backlog stays bounded
        if events & selectors.EVENT_READ and not state.closing and not self._has_line(state):
            try:
                data = conn.recv(65536)
            except (BlockingIOError, InterruptedError):
                data = None
            except OSError:
                return self._close(conn)
            if data == b"":                 # the client is done sending: finish the answers, then close
                state.closing = True
            elif data:
                state.inbuf += data
        self._answer_lines(conn, state)
        if len(state.inbuf) > self.max_line and not self._has_line(state):
            self.drops.add("oversize")
            state.out += encode({"ok": False, "error": f"a request line is at most {self.max_line} bytes"})
            state.inbuf, state.closing = bytearray(), True
        if state.out:
            try:
                sent = conn.send(state.out)
                del state.out[:sent]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                return self._close(conn)
        if len(state.out) > self.max_pending:
            self.drops.add("unread_answers")
            return self._close(conn)
        backlog = self._has_line(state) and not state.waiting
        if state.closing and not state.out and not backlog and not state.waiting:
            return self._close(conn)
        # a closing connection reads no more, nor one waiting for a deferred answer; lines left for the next rounds wait on EVENT_WRITE too: a
        # writable socket brings them back at once, even with no new data; one whose client reads nothing
        # holds them until it does
        self._sel.modify(conn, (0 if state.closing or state.waiting else selectors.EVENT_READ) |
                         (selectors.EVENT_WRITE if state.out or backlog else 0))

    def _answer_lines(self, conn, state):
        """Answers at most `lines_per_round` of the lines in `state.inbuf`, none once its answers pass
        `max_pending` or while one is deferred, and leaves the rest there: a burst of lines costs the
        serving thread a bounded slice of one round (found by offset, the buffer cut once: no copy of
        its rest per line)."""
        start, empty = 0, 0
        for _ in range(self.lines_per_round):
            end = state.inbuf.find(b"\n", start, start + self.max_line + 1)
            if end < 0 or len(state.out) > self.max_pending or state.waiting:
                break
            if end == start:                # no request, so no answer: a flood of them is cheap
                empty += 1
            else:
                line = bytes(state.inbuf[start:end])
                reply = answer(lambda r: self.handle(r, state.host), decode(line), self.drops)
                if isinstance(reply, Deferred):
                    reply = self._defer(conn, state, reply)
                if reply is not None:
                    state.out += encode(reply)
            start = end + 1
        del state.inbuf[:start]
        if empty:
            self.drops.add("empty_lines", empty)

    def _defer(self, conn, state, deferred):
        """Start `deferred` on a thread of its own (None), or the refusal when too many run."""
        if sum(self._deferred.values()) >= self.max_deferred or \
                self._deferred[state.host] >= self.max_deferred_per_source:
            self.drops.add("busy")
            return {"ok": False, "error": "the daemon is busy with other requests that wait on the network; "
                                         "try again in a few seconds"}
        self._deferred[state.host] += 1
        state.waiting = True

        def run():
            self._settled.put((conn, state.host, deferred.answer(self.drops)))
            try:
                self._wake.send(b"!")
            except OSError:                 # full (a wake-up is pending anyway) or closed (stopped)
                pass

        threading.Thread(target=run, name="commlib-control-deferred", daemon=True).start()
        return None

    def _settle(self, wake_reader):
        """Send the deferred answers that are ready, and go on with their connections' lines."""
        try:
            wake_reader.recv(4096)
        except (BlockingIOError, InterruptedError):
            pass
        while True:
            try:
                conn, host, reply = self._settled.get_nowait()
            except queue.Empty:
                return
            self._deferred[host] -= 1
            if not self._deferred[host]:
                del self._deferred[host]
            state = self._conns.get(conn)
            if state is not None:           # else closed meanwhile: nobody reads the answer
                state.out += encode(reply)
                state.waiting = False
                self._serve(conn, 0)

    def _has_line(self, state):
        """Whether the first line in `state.inbuf` is whole and at most `max_line` bytes: one to answer."""
        return state.inbuf.find(b"\n", 0, self.max_line + 1) >= 0

    def _close_idle(self, now):
        for conn, state in list(self._conns.items()):
            if now - state.active > self.idle_s:
                self.drops.add("idle_closed")
                self._close(conn)

    def _close(self, conn):
        if self._conns.pop(conn, None) is not None:
            self._sel.unregister(conn)
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        conn.close()


class _Conn:
    __slots__ = ("host", "inbuf", "out", "active", "closing", "waiting")

    def __init__(self, host):
        self.host, self.inbuf, self.out, self.active, self.closing = host, bytearray(), bytearray(), \
            time.monotonic(), False
        self.waiting = False   # for a deferred answer

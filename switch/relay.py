"""A user-space fault relay: what `tc netem` would do to a UDP link, where netem is not available.

The relay stands between workers and one UDP service (a switch, an aggregator) on loopback. A
worker sends to the relay's address instead of the service's; the relay forwards each datagram
from a socket of its own per worker (so the service sees one distinct address per worker: the
one `link()` returns) and carries the service's answers back. TCP on the same port number is
passed through untouched (the switch's control plane), so the relay's address can replace the
service's everywhere.

Each direction has its own `Faults`, applied per datagram with a seeded random stream of its own:
the k-th datagram a direction carries meets the same fate in every run, however the two directions
interleave (with one stream for both, a test saw 67 datagrams down and not one lost at 5%: 3% of runs):

    loss       drop it
    duplicate  send it twice (each copy delayed on its own)
    reorder    hold it back `reorder_ms` longer, so later datagrams overtake it
    delay_ms, jitter_ms   every datagram waits delay +- jitter (uniform)

    with FaultRelay(("127.0.0.1", switch_port), up=Faults(reorder=0.25, reorder_ms=5)) as relay:
        relay.address   # give this to the workers
        relay.link(worker_address)   # the address the service sees for that worker

`relayed(backend_cls, faults)` puts the daemons a job embeds (rank 0's switch, its spawned
aggregators) behind relays, for tests and `make faults`.

`tap(direction, data, worker)` (direction "up": worker -> service, "down": back; worker: that
worker's address), when set, sees every datagram as it arrives, before any fault and before it is
forwarded: what an observer on the wire reads. With `inject` it plays an attacker who can also
send (and spoof source addresses): its packets can overtake the one it just saw.
"""
import dataclasses
import heapq
import random
import selectors
import socket
import threading
import time


@dataclasses.dataclass(frozen=True)
class Faults:
    loss: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    reorder_ms: float = 5.0
    delay_ms: float = 0.0
    jitter_ms: float = 0.0

    def __post_init__(self):
        for name in ("loss", "duplicate", "reorder"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name}={getattr(self, name)}: a probability in [0, 1)")
        if self.delay_ms < 0 or self.jitter_ms < 0 or self.reorder_ms < 0 or self.jitter_ms > self.delay_ms:
            raise ValueError("delays must be >= 0 and jitter_ms <= delay_ms")

    def __str__(self):
        parts = [f"loss {self.loss:.0%}" if self.loss else "", f"dup {self.duplicate:.0%}" if self.duplicate else "",
                 f"reorder {self.reorder:.0%} (+{self.reorder_ms:g} ms)" if self.reorder else "",
                 f"delay {self.delay_ms:g}+-{self.jitter_ms:g} ms" if self.delay_ms else ""]
        return ", ".join(p for p in parts if p) or "none"


class FaultRelay:
    """UDP (with faults) and TCP (pass-through) relay in front of `target` (host, port). Bounded: at
    most MAX_PEERS source addresses get a socket towards the target (datagrams from more are lost and
    counted as unlinked) and MAX_STREAMS TCP connections pass through at a time, so a flood of sources
    cannot exhaust its file descriptors and stop it for the job behind it."""

    MAX_PEERS, MAX_STREAMS = 1024, 64

    def __init__(self, target, up=Faults(), down=Faults(), seed=0, host="127.0.0.1"):
        self.target, self.faults, self.host = tuple(target), {"up": up, "down": down}, host
        self.rngs = {"up": random.Random(2 * seed), "down": random.Random(2 * seed + 1)}
        self.tap = None
        self.counters = {d: dict.fromkeys(("received", "sent", "lost", "duplicated", "reordered", "unlinked"), 0)
                         for d in ("up", "down")}
        self._streams = threading.BoundedSemaphore(self.MAX_STREAMS)
        self._front = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._front.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self._tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._bind_pair()
        self.address = self._front.getsockname()
        self._back = {}        # worker address -> its socket towards the target
        self._worker_of = {}   # back socket -> worker address
        self._queue, self._order = [], 0   # (release time, order, socket, data, destination)
        self._sel = selectors.DefaultSelector()
        self._lock = threading.Lock()      # link() from other threads
        self._stop = threading.Event()
        self._threads = []

    def _bind_pair(self):
        for _ in range(20):
            self._front.bind((self.host, 0))
            try:
                self._tcp.bind((self.host, self._front.getsockname()[1]))
                self._tcp.listen(16)
                return
            except OSError:
                self._front.close()
                self._front = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        raise OSError("the relay found no port free for UDP and TCP together")

    # -- life cycle ------------------------------------------------------------------------------
    def start(self):
        self._front.setblocking(False)
        self._sel.register(self._front, selectors.EVENT_READ)
        for target in (self._udp_loop, self._tcp_loop):
            thread = threading.Thread(target=target, name="commlib-fault-relay", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self):
        self._stop.set()
        try:
            self._tcp.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._tcp.close()
        for thread in self._threads:
            thread.join(5.0)
        for sock in [self._front, *self._back.values()]:
            sock.close()
        self._sel.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def link(self, worker):
        """The address the target sees for datagrams from `worker` (made on first use)."""
        worker = (socket.gethostbyname(worker[0]), int(worker[1]))
        with self._lock:
            sock = self._back.get(worker)
            if sock is None:
                sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
                sock.bind((self.host, 0))
                sock.connect(self.target)
                sock.setblocking(False)
                self._back[worker], self._worker_of[sock] = sock, worker
                self._sel.register(sock, selectors.EVENT_READ)
            return sock.getsockname()

    # -- UDP: faults and scheduling --------------------------------------------------------------
    def _udp_loop(self):
        while not self._stop.is_set():
            now = time.monotonic()
            while self._queue and self._queue[0][0] <= now:
                _, _, sock, data, to = heapq.heappop(self._queue)
                self._send(sock, data, to)
            wait = min(0.05, max(0.0, self._queue[0][0] - now)) if self._queue else 0.05
            with self._lock:
                ready = self._sel.select(wait)
            for key, _ in ready:
                self._drain(key.fileobj)

    def _drain(self, sock):
        for _ in range(256):
            try:
                data, source = sock.recvfrom(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:      # ICMP from a closed port, reported on the next receive
                continue
            if sock is self._front:
                back = self._back.get(source)
                if back is None and len(self._back) < self.MAX_PEERS:
                    try:
                        self.link(source)
                        back = self._back[source]
                    except OSError:   # out of descriptors or ports: lost, as on a full wire
                        pass
                if back is None:
                    self.counters["up"]["unlinked"] += 1
                    continue
                self._forward("up", data, back, None, source)
            else:
                worker = self._worker_of[sock]
                self._forward("down", data, self._front, worker, worker)

    def _forward(self, direction, data, sock, to, worker):
        f, c, rng = self.faults[direction], self.counters[direction], self.rngs[direction]
        c["received"] += 1
        if self.tap is not None:
            self.tap(direction, data, worker)
        if rng.random() < f.loss:
            c["lost"] += 1
            return
        copies = 2 if rng.random() < f.duplicate else 1
        c["duplicated"] += copies - 1
        for _ in range(copies):
            delay = f.delay_ms + (rng.uniform(-f.jitter_ms, f.jitter_ms) if f.jitter_ms else 0.0)
            if rng.random() < f.reorder:
                c["reordered"] += 1
                delay += f.reorder_ms
            if delay <= 0:
                self._send(sock, data, to)
            else:
                self._order += 1
                heapq.heappush(self._queue, (time.monotonic() + delay / 1000, self._order, sock, data, to))

    def _send(self, sock, data, to):
        direction = "up" if to is None else "down"
        try:
            sock.send(data) if to is None else sock.sendto(data, to)
            self.counters[direction]["sent"] += 1
        except OSError:          # a full buffer or a closed port: a loss, as on a wire
            self.counters[direction]["lost"] += 1

    def inject(self, data, to_worker=None, via=None):
        """Send `data` as if it came from the other end (for attacker tests): to the target from
        the address it knows as worker `via`, or to `to_worker` from the address the worker
        knows as the target's. Silently lost when a buffer is full, as on a wire."""
        try:
            if to_worker is not None:
                self._front.sendto(data, to_worker)
            else:
                self._back[via].send(data)
        except OSError:
            pass

    # -- TCP: pass-through -----------------------------------------------------------------------
    def _tcp_loop(self):
        while not self._stop.is_set():
            try:
                client, _ = self._tcp.accept()
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.05)   # out of descriptors: the connections that end free some
                continue
            if not self._streams.acquire(blocking=False):
                client.close()     # MAX_STREAMS pass through already
                continue
            try:
                server = socket.create_connection(self.target, timeout=10.0)
            except OSError:
                client.close()
                self._streams.release()
                continue
            ends = threading.Barrier(2, action=self._streams.release)   # both directions done: one stream less
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=_pipe, args=(a, b, ends), daemon=True).start()


def _pipe(src, dst, ends):
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        try:
            ends.wait()
        finally:
            src.close()


def relayed(backend_cls, faults, seed=0):
    """A subclass of the switchml or omnireduce backend whose daemons (rank 0's embedded switch or the
    configured switches and spine, rank 0's spawned aggregators) sit behind fault relays with `faults` both ways,
    one relay per daemon: every rank talks to the relays and registers the address the daemon sees for
    it (the relay's socket for this worker). Returns (class, the list its relays are added to; stop them
    when done). The ranks are threads of one process (they share the relays)."""
    relays, by_address = [], {}

    def relay_for(address):
        host, port = address.rsplit(":", 1)
        relay = FaultRelay((host, int(port)), up=faults, down=faults, seed=seed + len(relays)).start()
        relays.append(relay)
        by_address[f"{host}:{relay.address[1]}"] = relay
        return f"{host}:{relay.address[1]}"

    class Relayed(backend_cls):
        def _switch_address(self):                     # switchml, rank 0: each switch behind its relay
            address = super()._switch_address()
            return ",".join(relay_for(a) for a in address.split(",")) if self.rank == 0 else address

        def _spine_address(self):                      # switchml, rank 0: a two-level job's spine behind its relay too
            return relay_for(super()._spine_address())

        def _leaf_address(self, leaf, stream):         # switchml, rank 0: a leaf as the spine sees it (via its relay)
            return list(by_address[self._spine.address].link(by_address[leaf.address].target))

        def _streams_per_switch(self):                 # switchml: a relay forwards to a switch's first port
            return 1

        def _open_socket(self, stream):                # switchml, every rank
            path = super()._open_socket(stream)
            return dict(path, addr=list(by_address[stream.switch.address].link(tuple(path["addr"]))))

        def _spawn_aggregators(self, count):           # omnireduce dedicated, rank 0
            return [relay_for(address) for address in super()._spawn_aggregators(count)]

    Relayed.__name__ = f"Relayed{backend_cls.__name__}"
    return Relayed, relays

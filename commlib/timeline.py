"""Where a tensor's time goes: its phases, and a Chrome trace of them (Perfetto, chrome://tracing).

A tensor's life on one rank, in order (the breakdown of the IMC'20 parameter-server study, as far
as a worker's own clock can split it):

    NEGOTIATE   enqueued -> every rank agreed (the controller)
    QUEUE       agreed -> its bucket starts (the worker queue)
    FUSE        copying the bucket's tensors into one buffer                     \
    SCALE       prescale / postscale                                              | worker processing
    COMPRESS    a compressor's work before and between its collectives            |
    DECOMPRESS  ... and after the last one                                        |
    RESTORE     splitting the result (and a sparse one into the caller's type;    /
                a dense one's is made on the thread that waits for it)
    <ALGORITHM> each collective of the algorithm (network + switch/aggregators), with its bytes and,
                where the algorithm can tell (switchml), `busy_s`: its own processing inside, and
                where it has a server that stamps its results (switchml, omnireduce) the rest split
                into server_queue_s + server_proc_s + network_s (commlib.executor.Phases)

A bucket's phases are measured once (commlib.executor.Phases) and shared by its tensors. Timestamps are the
monotonic clock shifted to wall-clock microseconds, so the files of the ranks of one host (or of
hosts whose clocks NTP keeps close) line up; `python -m commlib.timeline merge OUT FILES...` joins
them into one trace with a process row per rank.

The trace is streamed as events happen (a JSON array Chrome reads even unfinished, so a crashed run
keeps its trace, and a long run holds nothing in memory); close() ends the array. With '{rank}' in
the path every rank writes its own file, else only rank 0 writes. Rank 0 adds a row per daemon (the
switch, the aggregators) with their counters' rates, sampled while the trace is on.
"""
import functools
import json
import logging
import sys
import threading
import time

log = logging.getLogger("commlib")
DAEMON_ROWS = 10000   # process rows of the switch and aggregators, after the ranks'


class Timeline:
    def __init__(self, path, rank):
        self.rank = rank
        self._file = None
        if path and ("{rank}" in path or rank == 0):
            self._file = open(path.replace("{rank}", str(rank)), "w")
            self._file.write("[\n")
            self._write([_meta("process_name", rank, name=f"commlib rank {rank}"),
                         _meta("process_sort_index", rank, sort_index=rank)])
        self._lock = threading.Lock()
        self._to_wall = time.time() - time.monotonic()
        self._rows = {}    # tensor name -> its thread id (Chrome wants integers)
        self._sources, self._samples = {}, {}   # daemons watched: row name -> fn, (time, counters)

    @property
    def active(self):
        return self._file is not None

    def tensor(self, name, algorithm, times, start, phases, nbytes, fused_with):
        """One tensor's round: its negotiation and queue (`times`: when it was submitted and released;
        `start`: its bucket's start) and its bucket's `phases`."""
        if self._file is None:   # off: no cost beyond this test
            return
        with self._lock:
            if self._file is None:   # closed meanwhile (stop_timeline)
                return
            tid, meta = self._row(name)
            # formatted by hand, not json.dumps per event: a third of the cost, on the step's path
            head = f'{{"ph":"X","pid":{self.rank},"tid":{tid},"name":'
            enqueued, went = times
            stages = [("NEGOTIATE", enqueued, went, False, {}), ("QUEUE", went, start, False, {})]
            lines = [_compact(e) + ",\n" for e in meta]
            for stage, begin, end, comm, args in stages + phases.spans:
                args = {**args, "algorithm": algorithm, "bytes": nbytes, "fused_with": fused_with} if comm else args
                lines.append(f'{head}{_quoted(stage)},"cat":"{"comm" if comm else "worker"}","ts":{self._us(begin):.3f},'
                             f'"dur":{max(0.0, end - begin) * 1e6:.3f},"args":{_compact(args) if args else "{}"}}},\n')
            self._file.write("".join(lines))
            self._file.flush()

    def counts(self, name, rows, counts):
        """Updates per row of a sparse tensor since the last call: the skew `commlib.analyze` plots."""
        with self._lock:
            if self._file is not None:
                self._write([{"name": "UPDATE_COUNTS", "ph": "i", "s": "p", "pid": self.rank, "tid": 0,
                              "ts": self._us(time.monotonic()), "args": {"tensor": name, "rows": [int(r) for r in rows],
                                                      "counts": [int(c) for c in counts]}}])

    def watch(self, sources, interval_s=0.1):
        """Sample each daemon's counters (`sources`: {row name: fn() -> {counter: number}}) now, every
        `interval_s` on a thread, and at close, writing their rates per second as counter tracks, one
        process row per daemon (the switch's, the aggregators' beside the ranks'). A source that fails
        is dropped."""
        if self._file is None or not sources:
            return
        self._sources = dict(sources)
        self._daemon_rows = {name: DAEMON_ROWS + i for i, name in enumerate(sources)}
        with self._lock:
            self._write([_meta("process_name", pid, name=name) for name, pid in self._daemon_rows.items()])
        self._sample()
        threading.Thread(target=self._sample_every, args=(interval_s,), name="commlib-timeline-daemons",
                         daemon=True).start()

    def _sample_every(self, interval_s):
        while self._file is not None and self._sources:
            time.sleep(interval_s)
            self._sample()

    def _sample(self):
        for name, fn in list(self._sources.items()):
            try:
                values, now = fn(), time.monotonic()
            except Exception as exc:   # the daemon went away or refused: stop asking it
                log.info("timeline: no more counters from %s (%s)", name, exc)
                self._sources.pop(name, None)
                continue
            before, self._samples[name] = self._samples.get(name), (now, values)
            numbers = {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            if before is None:   # the track starts at 0: each later sample is the rate since the one before
                rates = dict.fromkeys(numbers, 0.0)
            elif now > before[0]:
                rates = {k: (v - before[1].get(k, 0)) / (now - before[0]) for k, v in numbers.items()}
            else:
                continue
            with self._lock:
                if self._file is not None:
                    self._write([{"name": "per second", "ph": "C", "pid": self._daemon_rows[name], "tid": 0,
                                  "ts": self._us(now), "args": rates}])

    def close(self):
        """End the trace (a last sample of the daemons first: call it while they still run)."""
        if self._file is not None and self._sources:
            self._sample()
        with self._lock:
            if self._file is not None:
                # a last event with no comma after it: the finished file is strict JSON
                self._file.write(json.dumps(_meta("process_labels", self.rank, labels="commlib")) + "\n]\n")
                self._file.close()
                self._file = None

    def _row(self, name):
        events = []
        if name not in self._rows:
            self._rows[name] = len(self._rows) + 1
            events.append(_meta("thread_name", self.rank, self._rows[name], name=name))
        return self._rows[name], events

    def _us(self, monotonic):
        return (monotonic + self._to_wall) * 1e6

    def _write(self, events):
        self._file.write("".join(_compact(e) + ",\n" for e in events))
        self._file.flush()


_compact = json.JSONEncoder(separators=(",", ":")).encode
_quoted = functools.lru_cache(maxsize=None)(json.dumps)


def _meta(what, pid, tid=0, **args):
    return {"name": what, "ph": "M", "pid": pid, "tid": tid, "args": args}


def load(path):
    """The events of a trace file, finished or not (a crashed run leaves the array open)."""
    with open(path) as f:
        text = f.read().strip()
    if text.startswith("[") and not text.endswith("]"):
        text = text.rstrip().rstrip(",") + "\n]"
    events = json.loads(text)
    return events["traceEvents"] if isinstance(events, dict) else events


def merge(paths):
    """The events of several ranks' traces as one, times from the earliest event (microseconds)."""
    events = [event for path in paths for event in load(path)]
    timed = [e["ts"] for e in events if "ts" in e]
    origin = min(timed) if timed else 0.0
    for event in events:
        if "ts" in event:
            event["ts"] -= origin
    return events


def write(path, events):
    """A merged trace file (Perfetto and chrome://tracing read it)."""
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3 or argv[0] != "merge":
        print("usage: python -m commlib.timeline merge OUT.json RANK0.json RANK1.json ...", file=sys.stderr)
        return 2
    events = merge(argv[2:])
    write(argv[1], events)
    print(f"merged {len(argv) - 2} traces, {len(events)} events -> {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A Chrome trace (chrome://tracing, Perfetto) of every tensor's stages, like Horovod's Timeline:
negotiation (enqueue -> agreed), queue (agreed -> started) and the algorithm's run.

Events are streamed to the file as they happen (a JSON array that Chrome reads even unfinished,
so a crashed run keeps its trace, and a long run holds nothing in memory); close() ends the array.
With '{rank}' in the path every rank writes its own file, else only rank 0 writes."""
import json
import threading
import time


class Timeline:
    def __init__(self, path, rank):
        self.rank = rank
        self._file = None
        if path and ("{rank}" in path or rank == 0):
            self._file = open(path.replace("{rank}", str(rank)), "w")
            self._file.write("[\n")
        self._lock = threading.Lock()
        self._origin = time.monotonic()

    def tensor(self, name, enqueued, agreed, started, finished, algorithm):
        if self._file is None:
            return
        lines = []
        for stage, begin, end in (("NEGOTIATE", enqueued, agreed), ("QUEUE", agreed, started),
                                  (algorithm.upper(), started, finished)):
            lines.append(json.dumps({"name": stage, "cat": algorithm, "ph": "X", "pid": self.rank, "tid": name,
                                     "ts": (begin - self._origin) * 1e6, "dur": max(0.0, end - begin) * 1e6}))
        with self._lock:
            self._file.write(",\n".join(lines) + ",\n")
            self._file.flush()

    def close(self):
        if self._file is not None:
            with self._lock:
                self._file.write(json.dumps({"name": "process_name", "ph": "M", "pid": self.rank,
                                             "args": {"name": f"commlib rank {self.rank}"}}) + "\n]\n")
                self._file.close()
                self._file = None

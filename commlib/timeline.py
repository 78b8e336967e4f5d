"""A Chrome trace (chrome://tracing, Perfetto) of every tensor's stages, like Horovod's Timeline:
negotiation (enqueue -> agreed), queue (agreed -> started) and the algorithm's run."""
import json
import time


class Timeline:
    def __init__(self, path, rank):
        self.path = path.replace("{rank}", str(rank)) if path else ""
        self.rank = rank
        self._events = []
        self._origin = time.monotonic()

    def tensor(self, name, enqueued, agreed, started, finished, algorithm):
        if not self.path:
            return
        for stage, begin, end in (("NEGOTIATE", enqueued, agreed), ("QUEUE", agreed, started),
                                  (algorithm.upper(), started, finished)):
            self._events.append({"name": stage, "cat": algorithm, "ph": "X", "pid": self.rank, "tid": name,
                                 "ts": (begin - self._origin) * 1e6, "dur": max(0.0, end - begin) * 1e6})

    def close(self):
        if self.path:
            with open(self.path, "w") as f:
                json.dump({"traceEvents": self._events, "displayTimeUnit": "ms"}, f)

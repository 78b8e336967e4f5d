"""A worker process of tests/test_hierarchy.py: several switchml ranks, each a thread driving the C worker
data path (sml_worker_allreduce) directly, numpy only (no commlib core, no torch), so that a job of about a
hundred ranks fits a small machine.

stdin, one JSON line each: {"connect": [[host, port], ...] (per rank: its switch, or a relay), "ranks": [...]
(global ranks), "n": N (the job's ranks: the quantization scale), "window", "elems", "tensors": [[kind, size,
seed], ...], "timeout_ms", "rto_ms", "out": path}; the process answers {"addrs": [[ip, port], ...]} (each
rank's socket); then {"jobs": [...], "locals": [...], "keys": [hex or null, ...]} (per rank: its switch's
job, its rank there, its stream key); the process runs the tensors and writes `out` (npz: r{rank}_{i} the
results, rc_{rank} the return codes), then prints {"done": true}.
"""
import json
import socket
import sys
import threading

import numpy as np

from commlib import kernels
from commlib.switch.switchml import ffi, lib

TOKEN = 0x5EED


def tensor(kind, size, seed, rank):
    """Rank `rank`'s input: float32 over many magnitudes with zero blocks, or int32."""
    rng = np.random.default_rng(1000 * seed + rank)
    if kind == "int":
        return rng.integers(-2 ** 20, 2 ** 20, size, dtype=np.int32)
    x = rng.standard_normal(size).astype(np.float32)
    x *= np.float32(10.0) ** rng.integers(-6, 6, size=(size + 99) // 100).repeat(100)[:size].astype(np.float32)
    x[(np.arange(size) // 300) % 4 == 2] = 0.0
    return x


def allreduce(worker, x, elems, timeout_ms):
    out = np.empty_like(x)
    if x.dtype == np.int32:
        rc = lib.sml_worker_allreduce(worker, 1, ffi.from_buffer(x), ffi.from_buffer(out), x.size, ffi.NULL,
                                      ffi.NULL, ffi.NULL, timeout_ms)
        return out, rc
    exps, _ = kernels.block_exponents(x, elems)
    nf, mexp = np.zeros(exps.size, np.uint8), np.empty_like(exps)
    rc = lib.sml_worker_allreduce(worker, 0, ffi.from_buffer(x), ffi.from_buffer(out), x.size,
                                  ffi.cast("int8_t *", ffi.from_buffer(exps)), ffi.cast("uint8_t *", ffi.from_buffer(nf)),
                                  ffi.cast("int8_t *", ffi.from_buffer(mexp)), timeout_ms)
    return out, rc


def main():
    spec = json.loads(sys.stdin.readline())
    socks = []
    for host, port in spec["connect"]:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        sock.bind(("127.0.0.1", 0))
        sock.connect((host, port))
        socks.append(sock)
    print(json.dumps({"addrs": [list(s.getsockname()) for s in socks]}), flush=True)
    setup = json.loads(sys.stdin.readline())
    results = {}

    def rank_main(i):
        rank = spec["ranks"][i]
        key = setup["keys"][i]
        worker = lib.sml_worker_new(socks[i].fileno(), setup["jobs"][i], setup["locals"][i], TOKEN, spec["n"],
                                    spec["window"], spec["elems"], spec["rto_ms"], 200.0, 1,
                                    bytes.fromhex(key) if key else ffi.NULL,
                                    lib.TP_MAC_CHACHA20_POLY1305)   # SwitchServer.register's default algorithm
        codes = []
        try:
            for t, (kind, size, seed) in enumerate(spec["tensors"]):
                out, rc = allreduce(worker, tensor(kind, size, seed, rank), spec["elems"], spec["timeout_ms"])
                codes.append(rc)
                results[f"r{rank}_{t}"] = out
                if rc < 0:
                    break
        finally:
            lib.sml_worker_free(worker)
        results[f"rc_{rank}"] = np.array(codes, np.int64)

    threads = [threading.Thread(target=rank_main, args=(i,)) for i in range(len(socks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    np.savez(spec["out"], **results)
    print(json.dumps({"done": True}), flush=True)


if __name__ == "__main__":
    main()

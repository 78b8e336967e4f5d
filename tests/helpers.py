"""What several test files share: the checks of the workers' reports (tests/workers/*.py, each
rank's commlib.testing.report), a software switch in its own process, and the SwitchML packets the
protocol tests write byte by byte. Test files import from here, never from one another."""
import json
import math
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import commlib.switch.switchml as sw
from commlib.settings import Settings
from commlib.switch import control
from commlib.testing import LocalGroup

if sw.lib is None:   # not built: a failure of the suite, never a quiet skip
    raise ImportError(sw.IMPORT_ERROR)


# -- one process as the whole job ------------------------------------------------------------------
def single_process(monkeypatch):
    """No launcher's variables: commlib.init() starts a job of one rank."""
    for var in ("RANK", "WORLD_SIZE", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "COMMLIB_POLICY"):
        monkeypatch.delenv(var, raising=False)


# -- the workers' reports ---------------------------------------------------------------------------
def check_closed_form(results):
    """tests/workers/basic.py: rank r contributes (r + 1) * arange(length)."""
    for result in results:
        n = result["size"]
        total = n * (n + 1) // 2
        for length, got in result["sums"].items():
            expected = total * np.arange(int(length), dtype=np.float32)
            assert got == {"dtype": "float32", "shape": [int(length)], "values": expected[:8].tolist(),
                           "sum": float(expected.sum())}, (result["rank"], length)
        assert result["torch"] == {"type": "Tensor", "shape": [3, 4], "values": [total / n]}, result
        assert result["small"] == [[n * (n - 1) // 2] * 5] * 20, result
        assert result["grad"] == [(result["rank"] + 1) * (n + 1) / 2] * 3, result   # (r+1) * mean_j (j+1)
        average = [math.trunc(s * (1 / n)) for s in (total, -total, total - n)]
        assert result["ops"] == {"min": [1.0] * 4, "max": [float(n)] * 4, "product": [float(math.factorial(n))] * 4,
                                 "horovod max": [n] * 2, "int average": average, "torch int average": average}, result
        for name in ("op.min", "op.max", "op.product"):   # the policy said switchml, which only sums
            algorithm, note = result["op_records"][name]
            assert algorithm == "ring" and "switchml cannot reduce with op=" in note, (name, algorithm, note)
        assert result["records"] == 33 and result["fused"] > 0, f"20 small tensors should have been fused: {result}"


def check_omnireduce_sums(results, context=""):
    """tests/workers/omnireduce_worker.py sums: exact dense sums; zero tensors cost no blocks."""
    for result in results:
        assert result["wrong"] == [] and result["embedding_error"] <= 1e-5, (result, context)
        assert result["bytes_sent"] > 0 and result["densities"], (result, context)
        assert result["authenticated"], (result, context)   # embedded aggregators: the job's key, MACs on


def check_switchml(results, mode, address=None, packet_elems=8192):
    """tests/workers/switchml_worker.py: rank r contributes (r + 1) * x; packets sized by the path
    (loopback: the largest)."""
    for result in results:
        assert result["packet_elems"] == packet_elems, result
        r, n = result["rank"], result["size"]
        total = n * (n + 1) // 2
        embedded = mode == "embedded" and r == 0
        assert result["job_at_init"] and result["embedded"] == [embedded, embedded], result
        for length, sums in result["sums"].items():
            assert sums["dtypes"] == ["int32", "float32"] and sums["int_error"] == 0, (length, sums)
            assert sums["float_error_over_bound"] <= 1.0, (length, sums)
        assert result["avg"] == {"type": "Tensor", "values": [pytest.approx(total / n, abs=1e-5)]}, result
        assert result["half"] == {"dtype": "float16", "values": [total]}, result        # exact small integers
        assert result["half_avg"] == {"dtype": "float16", "values": [40000.0]}, result  # no float16 overflow
        assert result["torch_half"] == {"dtype": "torch.float16", "values": [0.5 * total]}, result
        assert result["received"] > 0 and result["algorithms"] == ["switchml"], result
        # the embedded switch holds the key rank 0 shared through the launcher; the external one has none
        assert result["authenticated"] == (mode == "embedded"), result
        assert address is None or result["switch"] == address, result
        if embedded or mode == "external":   # (a rank beside the embedded switch's cannot know when it stops)
            assert result["answers_after_shutdown"] == (mode == "external"), \
                "shutdown stops the embedded switch, and only that one"


# -- daemons ----------------------------------------------------------------------------------------
def switch_process(port=0, extra=()):
    """`python -m commlib.switch` as its own process; returns (process, address) once it says READY."""
    proc = subprocess.Popen([sys.executable, "-m", "commlib.switch", "--port", str(port), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        address, = control.wait_ready(proc, 20, "commlib-switch")
    except RuntimeError:
        proc.kill()
        raise
    return proc, address


# -- SwitchML packets, by hand (tests/test_switch_protocol.py, tests/test_trust_dataplane.py) --------
TOKEN = 0x1234ABCD
E = 64   # values per packet in these tests (size code 1)


def header(type, flags, job, rank, pkt, pool, exp, token=TOKEN, code=0):
    """The 20-byte header, written out field by field (big-endian) with its checksum."""
    raw = bytearray(20)
    raw[0], raw[1], raw[2], raw[3] = type, flags, job, rank
    raw[4:8] = pkt.to_bytes(4, "big")
    raw[8:10] = pool.to_bytes(2, "big")
    raw[10] = exp & 0xFF
    raw[11] = code
    raw[12:16] = token.to_bytes(4, "big")
    raw[16:20] = transport_checksum(bytes(raw[:16]) + b"\0\0\0\0").to_bytes(4, "big")
    return bytes(raw)


def transport_checksum(data):
    """switch/csrc/transport.h's checksum, written out independently: over the little-endian 32-bit
    words w_1..w_k, s1 = sum w_i, s2 = sum i * w_i (mod 2^32); s1 ^ rotate16(s2) ^ length."""
    words = struct.unpack(f"<{len(data) // 4}I", data)
    s1 = sum(words) & 0xFFFFFFFF
    s2 = sum(i * w for i, w in enumerate(words, 1)) & 0xFFFFFFFF
    return s1 ^ ((s2 << 16 | s2 >> 16) & 0xFFFFFFFF) ^ len(data)


def data(job, rank, pkt, slot, set, values=None, exp=0, token=TOKEN, nf=None):
    flags = 0 if values is None else 1
    payload = b"" if values is None else struct.pack(f"!{E}i", *values)
    if nf is not None:
        flags |= 4
        payload += bytes(nf)
    return header(1, flags, job, rank, pkt, slot | set << 15, exp, token) + payload


def parse(packet):
    fields = sw.HEADER.unpack(packet[:sw.HDR_LEN])
    names = ("type", "flags", "job", "rank", "pkt", "pool", "exp", "code", "token", "checksum")
    out = dict(zip(names, fields))
    n = {0: 0, 1: 64, 2: 256}[out["flags"] & 3]
    out["values"] = list(struct.unpack(f"!{n}i", packet[20:20 + 4 * n]))
    out["nf"] = list(packet[20 + 4 * n:20 + 5 * n]) if out["flags"] & 4 else None
    end = 20 + (5 if out["flags"] & 4 else 4) * n
    out["stamp"] = struct.unpack("!II", packet[end:end + 8]) if out["flags"] & 16 else None   # queue, proc ns
    out["checksum_ok"] = header(*[out[k] for k in ("type", "flags", "job", "rank", "pkt", "pool", "exp")],
                                token=out["token"], code=out["code"]) == packet[:20]
    return out


class Job:
    """n worker sockets registered as one job."""

    def __init__(self, switch, n, slots=8, token=TOKEN):
        self.switch, self.token = switch, token
        self.socks = []
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind(("127.0.0.1", 0))
            s.settimeout(1.0)
            self.socks.append(s)
        self.client = sw.SwitchClient(switch.address)
        self.number = self.client.register(token, [list(s.getsockname()) for s in self.socks], slots, E)["job"]

    def send(self, rank, packet):
        self.socks[rank].sendto(packet, ("127.0.0.1", self.switch.port))

    def recv(self, rank, timeout=1.0):
        self.socks[rank].settimeout(timeout)
        return parse(self.socks[rank].recv(4096))

    def silent(self, rank, timeout=0.15):
        self.socks[rank].settimeout(timeout)
        try:
            got = self.socks[rank].recv(4096)
        except socket.timeout:
            return True
        raise AssertionError(f"rank {rank} got an unexpected packet {parse(got)}")

    def counters(self):
        return self.client.counters(self.number)["counters"]

    def close(self):
        for s in self.socks:
            s.close()


def vals(seed):
    return [(seed * 1000 + i) * (-1) ** i for i in range(E)]


FUZZ = Path(__file__).resolve().parent / "fuzz" / "run.py"


def fuzz(tmp_path, target, *flags, timeout=240, env=None):
    """(exit code, output) of a bounded run of a tests/fuzz target (run.py's flags, libFuzzer's)."""
    out = subprocess.run([sys.executable, str(FUZZ), target, *flags, f"-artifact_prefix={tmp_path}/"],
                         capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
                         env=None if env is None else dict(os.environ, **env))
    return out.returncode, out.stdout + out.stderr


def run_backends(n, make_backend, work, **settings):
    """work(rank, backend) on n ranks of a LocalGroup (threads), each with make_backend(ctx) started
    and closed around it; returns every rank's result."""
    group = LocalGroup(n, Settings({"timeout_s": 20.0, **settings}))

    def main(ctx):
        backend = make_backend(ctx)
        backend.start()
        try:
            return work(ctx.rank, backend)
        finally:
            backend.close()

    return group.run(main, 100.0)


# -- DDP with commlib's hook against DDP's own allreduce (tests/workers/ddp_grads.py) -------------------
def ddp_results(folder, name, nprocs):
    """Each rank's result of the ddp_grads.py scenario `name` written in `folder`; a scenario that
    failed on a rank fails here with that rank's traceback."""
    found = [json.loads((folder / f"{name}.rank{r}.json").read_text()) for r in range(nprocs)]
    for r in found:
        assert "error" not in r, f"scenario {name!r} on {nprocs} ranks failed on rank {r['rank']}:\n{r['error']}"
    return found


def switchml_bound(n, largest):
    """backends/switchml.py: the n-way sum errs by at most n^2 2^(e-1) / (2^31 - 1) with
    2^e <= 2 max|x| (so n^2 max|x| 2^-30 on the sum, n max|x| 2^-30 on the average), plus float32
    rounding: one of the switch's result, n - 1 of the partial sums in DDP's own ring."""
    return largest * (n * 2.0 ** -30 + n * 2.0 ** -23)


def check_grads(results, tolerance, uncounted=0):
    """Every rank holds the same reduced gradients, each step within `tolerance(size, max|grad|)`
    of DDP's own allreduce; the state counted every step but `uncounted`."""
    first = results[0]
    for r in results[1:]:
        assert r["grads"] == first["grads"], f"rank {r['rank']} reduced to other gradients than rank 0"
    for r in results:
        for step, s in enumerate(r["steps"]):
            bound = tolerance(r["size"], s["max_grad"])
            assert s["max_diff"] <= bound, f"rank {r['rank']} step {step}: |hook - DDP| {s['max_diff']} > {bound}"
        assert r["iteration"] == len(r["steps"]) - uncounted, r
        assert r["buckets_reduced"] > r["iteration"], "expected several buckets in the first step"


def exact(n, largest):
    return 0.0

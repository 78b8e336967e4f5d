"""The data paths' per-element kernels, each beside a memcpy of the same bytes on the same machine.

For a packet's worth of values (--elems, in cache) and for a large tensor (--large, from memory),
the CPU ns per element of each kernel of commlib/csrc/kernels.h (the worker's exponents,
quantization and dequantization, the switch's big-endian lanes, omnireduce's non-zero-block scan and
aggregation), of the transport's checksum, and of the packet MAC (each algorithm of switch/packet_mac.py
through OpenSSL, per int32), with the portable scalar kernels and with the vector (AVX2) ones, and memcpy of
4 bytes per element (the floor: a kernel at memcpy's cost runs at memory speed). CPU time, median of --repeats.
Then one packet MAC's cost per call of 1, 4 and 32 KiB (MAC_BYTES), each algorithm: CPU ns per call
and per byte, beside a memcpy of the packet (mac_call_ns; bench_switchml and bench_omnireduce use it too).

    python benchmarks/bench_kernels.py [--quick] [--elems 8192] [--large 4194304] [--repeats 7]
Results: benchmarks/results/kernels.json (and RESULTS.md).
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402
from commlib._native import ffi, lib  # noqa: E402


def per_element(fn, n, budget_ns=20_000_000, repeats=7):
    """CPU ns per element of fn() over n elements: the median of `repeats` batches of calls."""
    fn()
    calls = max(1, int(budget_ns / max(1.0, n)))
    samples = []
    for _ in range(repeats):
        start = time.process_time_ns()
        for _ in range(calls):
            fn()
        samples.append((time.process_time_ns() - start) / calls / n)
    return statistics.median(samples)


MAC_BYTES = (1024, 4096, 32768)


def mac_call_ns(algorithm, nbytes, calls=2000, repeats=5):
    """CPU ns of one packet MAC (tp_mac_tag over an 8-byte prefix and nbytes, as switchml's) with
    `algorithm` (switch/packet_mac.py), the cffi call's own cost (a tp_checksum of 0 bytes, the same
    Python and cffi path) taken out: the median of `repeats` batches. CPU time: robust on a busy host."""
    from commlib.switch import packet_mac
    mac = ffi.gc(lib.tp_mac_new(os.urandom(lib.TP_KEY_LEN), b"commlib switchml packets", packet_mac.code(algorithm)),
                 lib.tp_mac_free)
    nonce, prefix, packet = os.urandom(lib.TP_NONCE_LEN), os.urandom(8), ffi.from_buffer(os.urandom(nbytes))
    tag = ffi.new("uint8_t[]", lib.TP_TAG_LEN)

    def batch(fn):
        start = time.process_time_ns()
        for _ in range(calls):
            fn()
        return (time.process_time_ns() - start) / calls
    costs = [batch(lambda: lib.tp_mac_tag(mac, nonce, prefix, 8, packet, nbytes, tag))
             - batch(lambda: lib.tp_checksum(packet, 0)) for _ in range(repeats)]
    return statistics.median(costs)


def memcpy_ns(nbytes, calls=2000, repeats=5):
    """CPU ns of a memcpy of nbytes (in cache), the cffi call's cost taken out as in mac_call_ns."""
    src, dst = ffi.from_buffer(bytearray(nbytes)), ffi.from_buffer(bytearray(nbytes))

    def batch(fn):
        start = time.process_time_ns()
        for _ in range(calls):
            fn()
        return (time.process_time_ns() - start) / calls
    return statistics.median(batch(lambda: ffi.memmove(dst, src, nbytes)) - batch(lambda: ffi.memmove(dst, src, 0))
                             for _ in range(repeats))


def mac_algorithms():
    from commlib.switch import packet_mac
    return sorted(packet_mac.algorithms())


def kernels(n):
    """name -> a call over n elements, and the buffers they use (keep them alive while calling)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(n).astype(np.float32)
    be, out, acc = np.zeros(4 * n, np.uint8), np.zeros(n, np.float32), np.zeros(n, np.int32)
    exps, mask = np.zeros(n // 256 + 1, np.int8), np.zeros(n // 256 + 1, np.uint8)
    tag = ffi.new("uint8_t[]", lib.TP_TAG_LEN)
    src, dst = ffi.from_buffer(x), ffi.from_buffer(out)
    xp, bep, outp, accp = (ffi.cast("float *", src), ffi.cast("uint8_t *", ffi.from_buffer(be)),
                           ffi.cast("float *", dst), ffi.cast("int32_t *", ffi.from_buffer(acc)))
    from commlib.switch import packet_mac
    macs = {name: ffi.gc(lib.tp_mac_new(os.urandom(lib.TP_KEY_LEN), b"commlib switchml packets", code), lib.tp_mac_free)
            for name, code in packet_mac.algorithms().items()}
    nonce, prefix = os.urandom(lib.TP_NONCE_LEN), os.urandom(8)
    calls = {
        "memcpy (the floor)": lambda: ffi.memmove(dst, src, 4 * n),
        "block exponents": lambda: lib.cl_block_exponents(xp, n, n, ffi.cast("int8_t *", ffi.from_buffer(exps))),
        "quantize (to big-endian)": lambda: lib.cl_quantize_be(xp, n, 3, 4, bep),
        "dequantize (from big-endian)": lambda: lib.cl_dequantize_be(bep, n, 3, 4, outp),
        "int32 from big-endian (worker)": lambda: lib.cl_be_load(accp, bep, n),
        "int32 to big-endian (worker)": lambda: lib.cl_be_store(bep, accp, n),
        "switch: add (int32 aggregation, wire order)": lambda: lib.cl_be_add_be(ffi.cast("uint8_t *", accp), bep, n),
        "checksum": lambda: lib.tp_checksum(bep, 4 * n),
        "omnireduce: non-zero-block scan": lambda: lib.cl_block_mask(xp, n, 0, 256, 0.0,
                                                                     ffi.cast("uint8_t *", ffi.from_buffer(mask))),
        "omnireduce: add float32 (aggregation)": lambda: lib.cl_add_f32(outp, bep, n),
        "omnireduce: add int32 (aggregation)": lambda: lib.cl_add_i32(accp, bep, n),
    }
    for name, mac in sorted(macs.items()):
        calls[f"packet MAC ({name})"] = lambda mac=mac: lib.tp_mac_tag(mac, nonce, prefix, 8, bep, 4 * n, tag)
    return (x, be, out, acc, exps, mask, src, dst, macs), calls


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elems", type=int, default=8192, help="a packet's values (in cache)")
    parser.add_argument("--large", type=int, default=1 << 22, help="a large tensor's values (from memory)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="a 1 Mi-value large tensor, 3 repeats (CI's smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.large, args.repeats = 1 << 20, 3
    vector = bool(lib.cl_simd(1))
    results, rows = {}, []
    for n in (args.elems, args.large):
        buffers, calls = kernels(n)
        for name, fn in calls.items():
            row = {}
            for level in ((0, 1) if vector else (0,)):
                lib.cl_simd(level)
                row["vector" if level else "scalar"] = per_element(fn, n, repeats=args.repeats)
            lib.cl_simd(1)
            results.setdefault(str(n), {})[name] = row
        floor = results[str(n)]["memcpy (the floor)"]["scalar"]
        print(f"== {n} values ({4 * n / 2 ** 10:.0f} KiB); CPU ns per element, x memcpy (vector kernels: "
              f"{'AVX2' if vector else 'none on this CPU'})")
        for name, row in results[str(n)].items():
            best = row.get("vector", row["scalar"])
            cells = "  ".join(f"{k} {v:6.3f}" for k, v in row.items())
            print(f"  {name:<36} {cells}  ({best / floor:.1f}x memcpy)")
            rows.append(f"| {n:,} | {name} | {row['scalar']:.3f} | "
                        + (f"{row['vector']:.3f}" if "vector" in row else "-") + f" | {best / floor:.1f}x |")
    print(f"== one packet MAC per call, CPU ns (median of {args.repeats}; the cffi call's cost taken out), beside a "
          f"memcpy of the packet (in cache); AES-NI and PCLMULQDQ on this CPU: {'yes' if lib.tp_mac_fast() else 'no'}")
    mac_rows = []
    for nbytes in MAC_BYTES:
        copy = memcpy_ns(nbytes, repeats=args.repeats)
        for name in mac_algorithms():
            ns = mac_call_ns(name, nbytes, repeats=args.repeats)
            results.setdefault("mac", {}).setdefault(name, {})[str(nbytes)] = {"ns_per_call": ns, "memcpy_ns": copy}
            print(f"  {nbytes:>6} B {name:<18} {ns:7.0f} ns per call  {ns / nbytes:.3f} ns/B  "
                  f"({ns / max(copy, 1):.1f}x the memcpy's {copy:.0f} ns)")
            mac_rows.append(f"| {nbytes:,} | {name} | {ns:.0f} | {ns / nbytes:.3f} | {copy:.0f} |")
    markdown = ("CPU ns per element (one float32 or int32; the MAC per int32 of a packet) of the data paths' kernels, "
                "scalar and AVX2 (commlib/csrc/kernels.h; chosen at load time where the CPU has AVX2), beside a "
                "memcpy of the same bytes; a packet's values (in cache) and a large tensor (from memory). "
                "Median of the repeats, process CPU time.\n\n"
                "| values | kernel | scalar | vector | best x memcpy |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
                "\nOne packet MAC (transport.h's tp_mac_tag over an 8-byte prefix and the packet; a keyed context "
                "reused, the call sets the nonce only), per algorithm and packet size: CPU ns per call and per byte, "
                "beside a memcpy of the packet (in cache); the cffi call's own cost taken out.\n\n"
                "| bytes | algorithm | ns per call | ns per byte | memcpy ns |\n|---|---|---|---|---|\n"
                + "\n".join(mac_rows) + "\n")
    common.save("kernels", {"elems": args.elems, "large": args.large, "repeats": args.repeats,
                            "vector": "avx2" if vector else None, "aes_ni": bool(lib.tp_mac_fast())}, results, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Compressor throughput, bytes on the wire and error, per method and tensor size (CPU, or a GPU).

For every registered method (default hyperparameters) and size n (a float32 matrix of about
sqrt(n) x sqrt(n), so PowerSGD has a matrix to factor):
  - compress + decompress throughput: n / median seconds of `--runs` timed calls after a warm-up;
  - bytes on the wire: the payload of one compress (data only; allgather adds a 8 + 16 per part
    byte header), and the ratio fp32 bytes / payload bytes;
  - relative error vs the uncompressed mean: ||allreduce_compressed - mean_r x_r|| / ||mean_r x_r||
    over 4 ranks (thread-ranks through the tests' FakeComm, so PowerSGD's two allreduces and the
    vote/aggregate rules are the real ones) on the first step (no memory yet). Inputs are i.i.d.
    Gaussian: a worst case for low rank (PowerSGD) and for sparsifiers; sign methods return a
    vote in {-1, +1}, so their "error" measures scale too.

    python benchmarks/bench_compressors.py [--quick] [--sizes 1M,25M] [--runs 5] [--methods topk,dgc]
                                           [--device cuda]
Results: benchmarks/results/compressors.json (compressors_cuda.json with --device cuda) and RESULTS.md.
"""
import argparse
import math
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))   # compressor_harness: the in-process 4-rank FakeComm

import common  # noqa: E402
import commlib.compressors as C  # noqa: E402
from commlib.compressors import packing  # noqa: E402
from compressor_harness import run_ranks  # noqa: E402

RANKS = 4
FULL_SIZES, QUICK_SIZES = "1M,25M", "64K,256K"


def parse_size(text):
    units = {"K": 2 ** 10, "M": 10 ** 6}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def matrix_shape(n):
    rows = int(math.isqrt(n))
    while n % rows:
        rows -= 1
    return rows, n // rows


def throughput(spec, x, runs):
    """Median seconds of compress + decompress, and the payload of the last call."""
    c = C.build(*C.parse(spec))
    last = {}

    def roundtrip():
        payload, ctx = c.compress(x, "bench")
        c.decompress(payload, ctx)
        last["payload"] = payload
        if x.is_cuda:   # kernels run asynchronously: time them, not their launch
            torch.cuda.synchronize(x.device)

    samples = common.timeit(roundtrip, runs, warmup=1)
    return samples, packing.nbytes(last["payload"])


def relative_error(spec, shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(shape, generator=gen) for _ in range(RANKS)]
    comps = [C.build(*C.parse(spec)) for _ in range(RANKS)]
    algorithm = sorted(comps[0].carriers())[0]
    out = run_ranks(RANKS, lambda r, comm: comps[r].reduce(xs[r], "bench", comm, True), algorithm, timeout=600)[0]
    mean = torch.stack(xs).mean(0)
    return float((out - mean).norm() / mean.norm())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"CI smoke sizes ({QUICK_SIZES}), seconds")
    parser.add_argument("--sizes", help=f"comma-separated element counts (default {FULL_SIZES})")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per point (median; >= 5)")
    parser.add_argument("--methods", help="comma-separated specs (default: every registered method)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cpu", help="where the compressors run, e.g. cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [parse_size(s) for s in (args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)).split(",")]
    # every method with its defaults, plus SIDCo's estimated threshold (tau=0.01 is scale dependent)
    specs = args.methods.split(",") if args.methods else sorted(C.compressors()) + ["threshold(ratio=0.01)"]
    runs = max(5, args.runs)

    rows, results = [], []
    header = (f"{'method':<22} {'elements':>9} {'Melem/s':>8} {'median ms':>10} {'best ms':>9} {'wire bytes':>11} "
              f"{'x fp32':>7} {'rel.err':>7}")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} torch threads)"
    print(f"# compress+decompress on {where}, median of {runs} runs; "
          f"error vs the mean of {RANKS} ranks")
    print(header)
    for n in sizes:
        shape = matrix_shape(n)
        x = torch.randn(shape, generator=torch.Generator().manual_seed(n)).to(device)
        for spec in specs:
            samples, nbytes = throughput(spec, x, runs)   # noisy on a shared machine: see best ms
            stats = common.summarize(samples)
            error = relative_error(spec, shape)
            row = {"method": spec, "elements": n, "shape": list(shape), "seconds": samples, **{
                f"{k}_s": v for k, v in stats.items() if k != "runs"}, "elements_per_s": n / stats["median"],
                "wire_bytes": nbytes, "ratio_vs_fp32": 4 * n / max(nbytes, 1), "relative_error": error}
            results.append(row)
            cells = (spec, n, f"{row['elements_per_s'] / 1e6:.1f}", f"{stats['median'] * 1e3:.2f}",
                     f"{stats['min'] * 1e3:.2f}", nbytes, f"{row['ratio_vs_fp32']:.1f}", f"{error:.3f}")
            print("{:<22} {:>9} {:>8} {:>10} {:>9} {:>11} {:>7} {:>7}".format(*cells), flush=True)
            rows.append("| " + " | ".join(map(str, cells)) + " |")
    markdown = (f"Compress + decompress on {where}, one tensor (a float32 matrix of about sqrt(n) x sqrt(n)), "
                f"median of {runs} runs after a warm-up; wire bytes are the payload of one call; relative error of "
                f"the {RANKS}-rank compressed mean vs the exact mean, i.i.d. Gaussian inputs, first step.\n\n"
                "| method | elements | Melem/s (median) | median ms | best ms | wire bytes | x fp32 | rel. error |\n"
                "|---|---|---|---|---|---|---|---|\n"
                + "\n".join(rows))
    settings = {"quick": args.quick, "sizes": sizes, "runs": runs, "ranks": RANKS, "device": where,
                "torch_threads": torch.get_num_threads()}
    suite = "compressors" if device.type == "cpu" else f"compressors_{device.type}"
    common.save(suite, settings, results, markdown)
    print(f"saved {common.RESULTS / (suite + '.json')}")


if __name__ == "__main__":
    main()

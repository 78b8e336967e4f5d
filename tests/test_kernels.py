"""SwitchML's block exponents (commlib.kernels) against numpy, and every kernel of
commlib/csrc/kernels.h the same bits with the portable scalar code and the AVX2 code (and as numpy
computes them). The quantization is also checked through the real path, a switch and its workers (test_switchml_backend.py: the bound,
zero blocks, full-scale blocks that must not overflow, int32 wrapping); omnireduce's block scan and
sums also through its backend (test_omnireduce.py)."""
import numpy as np
import pytest

from commlib import kernels


@pytest.mark.parametrize("n, block", [(1, 256), (255, 64), (1000, 256), (4096, 256)])
def test_block_exponents_bound_every_block(n, block):
    x = (np.random.default_rng(n).standard_normal(n) * 10.0 ** np.random.default_rng(1).integers(-30, 30)).astype(np.float32)
    exps, bad = kernels.block_exponents(x, block)
    assert bad == -1 and exps.size == -(-n // block)
    for b, e in enumerate(exps):
        amax = np.abs(x[b * block:(b + 1) * block]).max()
        assert amax < 2.0 ** int(e) and (amax >= 2.0 ** (int(e) - 1) or e == kernels.EXP_MIN)


def test_zero_blocks_and_nonfinite():
    x = np.zeros(600, dtype=np.float32)
    x[300] = np.inf
    x[550] = np.nan
    exps, bad = kernels.block_exponents(x, 256)
    assert exps[0] == kernels.EXP_ZERO and bad == 1


# -- the scalar and the AVX2 kernels give the same bits ----------------------------------------------
from commlib._native import ffi, lib   # noqa: E402

SIZES = [0, 1, 7, 8, 9, 31, 333, 1001, 8192]   # around and across the 8-lane vectors, and packet sizes


def _cpu_has_avx2():
    with open("/proc/cpuinfo") as f:
        return " avx2" in f.read()


@pytest.fixture
def levels():
    """Runs a kernel call under the scalar kernels, then the vector ones; restores the default."""
    def both(fn):
        out = []
        for want in (0, 1):
            lib.cl_simd(want)
            out.append(fn())
        return out
    assert lib.cl_simd(1) == _cpu_has_avx2()   # the vector kernels run where the CPU has AVX2: not a vacuous test
    yield both
    lib.cl_simd(1)


def _floats(n, seed):
    """Over magnitudes, with zeros, denormals, ties of the rounding and the largest values below 2^e."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3, n)).astype(np.float32)
    if n > 8:
        x[::7] = 0.0
        x[1] = np.float32(1.5 * 2.0 ** -126)             # denormal once scaled down
        x[2] = np.nextafter(np.float32(1024.0), np.float32(0))
        x[3] = -x[2]
    return x


def _ptr(a, kind):
    return ffi.cast(kind, ffi.from_buffer(a))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("nworkers", [1, 3, 8])
def test_quantize_and_dequantize_same_bits_scalar_and_vector_and_as_numpy(levels, n, nworkers):
    x = _floats(n, n + nworkers)
    exp = int(np.frexp(np.float64(np.abs(x).max(initial=0)))[1]) if n else 0
    exp = max(exp, 11)                                   # the agreed max over ranks: >= this rank's
    f = (2 ** 31 - 1) / nworkers * 2.0 ** -exp

    def quantize():
        be = np.zeros(4 * n, np.uint8)
        lib.cl_quantize_be(_ptr(x, "float *"), n, exp, nworkers, _ptr(be, "uint8_t *"))
        return be.tobytes()

    scalar, vector = levels(quantize)
    assert scalar == vector
    want = np.rint(x.astype(np.float64) * f).astype(">i4").tobytes()   # round half to even, big-endian
    assert scalar == want

    q = np.frombuffer(want, ">i4")

    def dequantize():
        out = np.zeros(n, np.float32)
        lib.cl_dequantize_be(ffi.from_buffer(want), n, exp, nworkers, _ptr(out, "float *"))
        return out.tobytes()

    scalar, vector = levels(dequantize)
    assert scalar == vector
    assert scalar == (q.astype(np.float64) * (1.0 / f)).astype(np.float32).tobytes()


@pytest.mark.parametrize("n", SIZES)
def test_big_endian_lanes_same_bits_scalar_and_vector(levels, n):
    rng = np.random.default_rng(n)
    acc = rng.integers(-2 ** 31, 2 ** 31, n, dtype=np.int32)
    src = rng.integers(-2 ** 31, 2 ** 31, n, dtype=np.int32)
    src[:2] = [2 ** 31 - 1, -2 ** 31][:n]                  # the wrap at both ends
    wire = src.astype(">i4").tobytes()

    def lanes():
        loaded, stored = np.zeros(n, np.int32), np.zeros(4 * n, np.uint8)
        added_be = np.frombuffer(acc.astype(">i4").tobytes(), np.uint8).copy()   # the switch's sums, in wire order
        lib.cl_be_load(_ptr(loaded, "int32_t *"), wire, n)
        lib.cl_be_store(_ptr(stored, "uint8_t *"), _ptr(src, "int32_t *"), n)
        lib.cl_be_add_be(_ptr(added_be, "uint8_t *"), wire, n)
        return loaded.tobytes(), stored.tobytes(), added_be.tobytes()

    scalar, vector = levels(lanes)
    assert scalar == vector
    total = (acc.astype(np.int64) + src).astype(np.int32)
    assert scalar == (src.tobytes(), wire, total.astype(">i4").tobytes())


@pytest.mark.parametrize("n, block", [(0, 8), (9, 8), (1000, 333), (20000, 8192), (4096, 256)])
def test_block_exponents_same_scalar_and_vector(levels, n, block):
    x = _floats(n, 5) * np.float32(1e-30)
    if n > 500:
        x[400], x[401] = np.nan, -np.inf                     # a bad block
        x[-1] = np.float32(2.0 ** 127)                       # finite but out of range
    scalar, vector = levels(lambda: (lambda e, bad: (e.tobytes(), bad))(*kernels.block_exponents(x, block)))
    assert scalar == vector


# -- omnireduce: the non-zero-block scan and the aggregators' sums -----------------------------------
OMR_BLOCKS = [1, 7, 8, 9, 256, 1001, 16000]   # around the 8-lane vectors, the default, and path-sized blocks


def _sparse(n, block, int32, seed):
    """Blocks that are all zero, zero but for a -0.0 (float) or one element at either end, tiny, NaN, Inf."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 1000).astype(np.float32)
    nb = -(-n // block)
    for b in range(nb):
        lo, hi = b * block, min(n, (b + 1) * block)
        kind = rng.integers(0, 7)
        if kind < 5:
            x[lo:hi] = 0
        if kind == 1:
            x[lo] = -0.0                          # float: still a zero block at threshold 0
        elif kind == 2:
            x[hi - 1] = 3.0                       # one element, in the tail lanes
        elif kind == 3:
            x[lo] = 1e-3                          # under the threshold below
        elif kind == 4:
            x[(lo + hi) // 2] = np.nan if not int32 else 5.0
    return x.astype(np.int32) if int32 else x


@pytest.mark.parametrize("block", OMR_BLOCKS)
@pytest.mark.parametrize("dtype", ["float32", "int32"])
@pytest.mark.parametrize("threshold", [0.0, 0.01, 2.5])
def test_block_mask_same_scalar_and_vector_and_as_numpy(levels, block, dtype, threshold):
    int32 = dtype == "int32"
    n = 3 * block + block // 2 + 1                       # a tensor not a multiple of the block
    x = _sparse(n, block, int32, block)
    nb = -(-n // block)

    def scan():
        mask = np.full(nb, 7, np.uint8)
        count = lib.cl_block_mask(ffi.from_buffer(x), n, int(int32), block, threshold, _ptr(mask, "uint8_t *"))
        return mask.tobytes(), count

    scalar, vector = levels(scan)
    assert scalar == vector, (scalar, vector)
    padded = np.zeros(nb * block, np.float64)
    padded[:n] = x
    if threshold == 0.0 and not int32:
        want = (np.frombuffer(np.pad(x, (0, nb * block - n)).tobytes(), np.uint32).reshape(nb, block)
                & 0x7FFFFFFF).any(axis=1)
    else:
        t = threshold if not int32 or threshold >= 0.5 else 0.0
        want = (~(np.abs(padded.reshape(nb, block)) <= t)).any(axis=1)
    assert scalar == (want.astype(np.uint8).tobytes(), int(want.sum())), (scalar, want)


@pytest.mark.parametrize("n", SIZES + [16000])
def test_aggregator_sums_same_bits_scalar_and_vector_and_as_numpy(levels, n):
    rng = np.random.default_rng(n)
    acc_f, src_f = _floats(n, n), _floats(n, n + 1)
    acc_i = rng.integers(-2 ** 31, 2 ** 31, n, dtype=np.int32)
    src_i = rng.integers(-2 ** 31, 2 ** 31, n, dtype=np.int32)
    src_i[:2] = [2 ** 31 - 1, -2 ** 31][:n]                  # the wrap at both ends
    packet_f, packet_i = b"\0" + src_f.tobytes(), b"\0" + src_i.tobytes()   # a packet's block: any alignment

    def add():
        f, i = acc_f.copy(), acc_i.copy()
        lib.cl_add_f32(_ptr(f, "float *"), ffi.from_buffer(packet_f) + 1, n)
        lib.cl_add_i32(_ptr(i, "int32_t *"), ffi.from_buffer(packet_i) + 1, n)
        return f.tobytes(), i.tobytes()

    scalar, vector = levels(add)
    assert scalar == vector
    assert scalar == ((acc_f + src_f).tobytes(), (acc_i.astype(np.int64) + src_i).astype(np.int32).tobytes())


@pytest.mark.parametrize("n", SIZES + [16000 * 4 + 52])
def test_checksum_same_scalar_and_vector_and_as_written_out(levels, n):
    """transport.h's checksum (its word loop is cl_checksum_words) over n bytes, a partial word at the
    end when n is not a multiple of 4: s1 = sum w_i, s2 = sum i * w_i (mod 2^32), s1 ^ rot16(s2) ^ n."""
    data = np.random.default_rng(n).bytes(n)
    scalar, vector = levels(lambda: lib.tp_checksum(data, n))
    assert scalar == vector
    words = np.frombuffer(data + bytes(-n % 4), "<u4").astype(np.uint64)
    s1 = int(words.sum()) & 0xFFFFFFFF
    s2 = int((words * np.arange(1, words.size + 1, dtype=np.uint64) % 2 ** 32).sum()) & 0xFFFFFFFF
    assert scalar == s1 ^ ((s2 << 16 | s2 >> 16) & 0xFFFFFFFF) ^ n

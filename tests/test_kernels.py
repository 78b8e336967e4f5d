"""SwitchML's block exponents (commlib.kernels) against numpy, and every kernel of
commlib/csrc/kernels.h the same bits with the portable scalar code and the AVX2 code (and as numpy
computes them). The quantization is also checked through the real path, a switch and its workers (test_switchml_backend.py: the bound,
zero blocks, full-scale blocks that must not overflow, int32 wrapping); the block scan through
omnireduce's block_mask (test_omnireduce.py)."""
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
        loaded, added, stored = np.zeros(n, np.int32), acc.copy(), np.zeros(4 * n, np.uint8)
        lib.cl_be_load(_ptr(loaded, "int32_t *"), wire, n)
        lib.cl_be_add(_ptr(added, "int32_t *"), wire, n)
        lib.cl_be_store(_ptr(stored, "uint8_t *"), _ptr(src, "int32_t *"), n)
        return loaded.tobytes(), added.tobytes(), stored.tobytes()

    scalar, vector = levels(lanes)
    assert scalar == vector
    assert scalar == (src.tobytes(), (acc.astype(np.int64) + src).astype(np.int32).tobytes(), wire)


@pytest.mark.parametrize("n, block", [(0, 8), (9, 8), (1000, 333), (20000, 8192), (4096, 256)])
def test_block_exponents_same_scalar_and_vector(levels, n, block):
    x = _floats(n, 5) * np.float32(1e-30)
    if n > 500:
        x[400], x[401] = np.nan, -np.inf                     # a bad block
        x[-1] = np.float32(2.0 ** 127)                       # finite but out of range
    scalar, vector = levels(lambda: (lambda e, bad: (e.tobytes(), bad))(*kernels.block_exponents(x, block)))
    assert scalar == vector

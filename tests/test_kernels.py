"""The C kernels against numpy."""
import numpy as np
import pytest

from commlib import kernels

INT32_MAX = 2 ** 31 - 1


def test_sum_f32_and_wrapping_i32():
    a, b = np.random.default_rng(0).standard_normal((2, 1001)).astype(np.float32)
    expected = a + b
    np.testing.assert_array_equal(kernels.sum_into(a, b), expected)
    x = np.array([INT32_MAX, -5, 7], dtype=np.int32)
    kernels.sum_into(x, np.array([1, 5, -9], dtype=np.int32))
    np.testing.assert_array_equal(x, [-(2 ** 31), 0, -2])   # wraps like the switch's int32 adders


def test_sum_rejects_mismatched_inputs():
    with pytest.raises(ValueError):
        kernels.sum_into(np.zeros(3, np.float32), np.zeros(4, np.float32))
    with pytest.raises(TypeError):
        kernels.sum_into(np.zeros(3), np.zeros(3))


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


@pytest.mark.parametrize("nworkers", [1, 2, 8])
def test_quantize_roundtrip_within_bound_and_sum_cannot_overflow(nworkers):
    rng = np.random.default_rng(nworkers)
    xs = [rng.standard_normal(1000).astype(np.float32) * 1e3 for _ in range(nworkers)]
    exps = np.max([kernels.block_exponents(x, 256)[0] for x in xs], axis=0).astype(np.int8)
    qs = [kernels.quantize(x, exps, 256, nworkers) for x in xs]
    assert max(np.abs(q.astype(np.int64)).max() for q in qs) <= INT32_MAX // nworkers + 1
    total = np.sum([q.astype(np.int64) for q in qs], axis=0)
    assert np.abs(total).max() <= INT32_MAX
    result = kernels.dequantize(total.astype(np.int32), exps, 256, nworkers)
    # each worker rounds by at most half a step 2^e * n / INT32_MAX; the float32 result adds one ulp
    step = (2.0 ** exps.astype(np.float64)).repeat(256)[:1000] * nworkers / INT32_MAX
    bound = nworkers * 0.5 * step + np.spacing(np.abs(result))
    assert np.all(np.abs(result - np.sum(xs, axis=0, dtype=np.float64)) <= bound)


def test_zero_block_stays_exactly_zero():
    x = np.zeros(512, dtype=np.float32)
    x[:256] = 1.5
    exps, _ = kernels.block_exponents(x, 256)
    out = kernels.dequantize(kernels.quantize(x, exps, 256, 4), exps, 256, 4)
    assert np.all(out[256:] == 0.0)


def test_nonzero_blocks_threshold():
    x = np.zeros(1000, dtype=np.float32)
    x[5] = 0.5
    x[700] = 0.01
    np.testing.assert_array_equal(kernels.nonzero_blocks(x, 256), [1, 0, 1, 0])
    np.testing.assert_array_equal(kernels.nonzero_blocks(x, 256, threshold=0.1), [1, 0, 0, 0])

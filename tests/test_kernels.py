"""SwitchML's block exponents (commlib.kernels) against numpy. The quantization they drive is
checked through the real path, a switch and its workers (test_switchml_backend.py: the bound,
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

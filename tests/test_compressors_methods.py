"""What each method promises beyond the common checks: PowerSGD's PyTorch options, SIDCo's
estimators, DGC's memory, error bounds, ranges, and the fast paths agreeing with the slow ones."""
import pytest
import torch

import commlib.compressors as C
from commlib.compressors import natural, packing, sidco, topk, u8bit
from commlib.testing import LocalGroup, run_ranks

pytestmark = pytest.mark.timeout(60)


def gen(seed):
    return torch.Generator().manual_seed(seed)


# --- powersgd ------------------------------------------------------------------------------------------------
def test_powersgd_start_iter_and_small_tensors_use_plain_allreduce():
    inputs = torch.randn(4, 20, 30, generator=gen(1))
    comps = [C.build("powersgd", {"start_iter": 2}) for _ in range(4)]

    def rank_main(rank, comm):
        outs = [comps[rank].reduce(inputs[rank] * (s + 1), "m", comm, True) for s in range(3)]
        vector = comps[rank].reduce(inputs[rank][0], "bias", comm, True)
        small = comps[rank].reduce(inputs[rank][:3, :3], "small", comm, True)   # (3+3)*1*2 >= 9: not worth it
        return outs, vector, small

    group = LocalGroup(4, algorithm="ring")
    for outs, vector, small in run_ranks(4, rank_main, group=group):
        assert torch.allclose(outs[0], inputs.mean(0), atol=1e-6)         # steps 0, 1: exact
        assert torch.allclose(outs[1], 2 * inputs.mean(0), atol=1e-6)
        assert not torch.allclose(outs[2], 3 * inputs.mean(0), atol=1e-2)  # step 2: rank-1 approximation
        assert torch.allclose(vector, inputs[:, 0].mean(0), atol=1e-6)
        assert torch.allclose(small, inputs[:, :3, :3].mean(0), atol=1e-6)
    sizes = [nbytes for rank, _, _, nbytes in group.log if rank == 0]
    assert sizes == [2400, 2400, 80, 120, 120, 36]     # 20*30*4 twice; then P (20x1), Q (30x1); bias; small


def test_powersgd_bucket_is_two_allreduces_and_equals_tensor_by_tensor():
    """As PyTorch's PowerSGD hook: every P of a bucket in one allreduce (with the tensors sent whole),
    every Q in a second, whatever the number of tensors; the result is the same as one by one."""
    mats = [torch.randn(4, 20, 30, generator=gen(5)), torch.randn(4, 16, 8, generator=gen(6))]
    bias = torch.randn(4, 30, generator=gen(7))
    bucketed, single = [C.build("powersgd") for _ in range(4)], [C.build("powersgd") for _ in range(4)]

    def rank_main(rank, comm):
        one = [single[rank].reduce(t[rank], n, comm, True) for t, n in ((mats[0], "a"), (mats[1], "b"), (bias, "c"))]
        start = len([e for e in group.log if e[0] == rank])
        many = bucketed[rank].reduce_bucket([mats[0][rank], mats[1][rank], bias[rank]], ["a", "b", "c"], comm, True)
        return one, many, [e for e in group.log if e[0] == rank][start:]

    group = LocalGroup(4, algorithm="ring")
    for one, many, calls in run_ranks(4, rank_main, group=group):
        for a, b in zip(one, many):
            assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
        assert [(op, nbytes) for _, op, _, nbytes in calls] == [("allreduce", 4 * (30 + 20 + 16)),
                                                                ("allreduce", 4 * (30 + 8))]


def test_powersgd_rank_above_a_matrix_side_is_that_side_as_in_pytorch():
    """rank=8 on a 4x16 matrix (compressed at min_compression_rate=0.01): a rank-4 approximation,
    which is the matrix itself (PyTorch's hook clamps the same way); it failed on a shape error."""
    inputs = torch.randn(2, 4, 16, generator=gen(9))
    comps = [C.build("powersgd", {"rank": 8, "min_compression_rate": 0.01}) for _ in range(2)]

    def rank_main(rank, comm):
        return comps[rank].reduce_bucket([inputs[rank]], ["w"], comm, True)[0]

    for out in run_ranks(2, rank_main, group=LocalGroup(2, algorithm="ring")):
        assert out.shape == (4, 16) and torch.allclose(out, inputs.mean(0), atol=1e-5), (out - inputs.mean(0)).abs().max()


def test_fp16_carries_powersgd_collectives():
    """fp16(powersgd(rank=1)), like DDP's fp16_compress_wrapper(powerSGD_hook): the P and Q
    allreduces travel as float16, and the result is PowerSGD's within fp16 rounding."""
    inputs = torch.randn(4, 20, 30, generator=gen(8))
    plain = [C.build("powersgd", {"memory": "none"}) for _ in range(4)]
    wrapped_per_rank = [C.build(*C.parse("fp16(powersgd(rank=1,memory=none))")) for _ in range(4)]
    assert wrapped_per_rank[0].carrier.name == "fp16"

    def rank_main(rank, comm):
        start = len([e for e in group.log if e[0] == rank])
        out = wrapped_per_rank[rank].reduce(inputs[rank], "m", comm, True)
        dtypes = [str(dtype) for r, _, dtype, _ in group.log if r == rank][start:]
        return out, plain[rank].reduce(inputs[rank], "m", comm, True), dtypes

    group = LocalGroup(4, algorithm="ring")
    for out, reference, dtypes in run_ranks(4, rank_main, group=group):
        assert dtypes[:2] == ["float16", "float16"]
        assert torch.allclose(out, reference, atol=1e-2, rtol=1e-2), (out - reference).abs().max()


def test_powersgd_warm_start_reuses_q():
    """The same matrix every step: warm start is a power iteration and reaches the best rank-1
    approximation; a fresh random Q each step (warm_start=False) stays at one iteration's quality."""
    u, _ = torch.linalg.qr(torch.randn(40, 30, generator=gen(2)))
    v, _ = torch.linalg.qr(torch.randn(30, 30, generator=gen(3)))
    m = u @ torch.diag(0.7 ** torch.arange(30.0)) @ v.T
    best = float((0.7 ** torch.arange(1, 30.0)).norm())     # Eckart-Young: the tail singular values
    comm = LocalGroup(1, algorithm="ring").channel(0)
    errors = {}
    for warm in (True, False):
        c = C.build("powersgd", {"memory": "none", "warm_start": warm})
        errors[warm] = [float((c.reduce(m, "m", comm, True) - m).norm()) for _ in range(15)]
        assert ("m" in c.qs) and c.qs["m"].shape == (30, 1)
    assert errors[True][-1] <= best * 1.001 < errors[True][0]
    assert sum(errors[False]) / 15 > best * 1.05


def test_powersgd_error_feedback_telescopes():
    """e_t = M_i + e_(t-1) - approx_t on every rank, so sum_t approx_t = T mean(M) - mean_i(e_T)."""
    inputs = torch.randn(4, 12, 16, generator=gen(3), dtype=torch.float64)
    comps = [C.build("powersgd") for _ in range(4)]

    def rank_main(rank, comm):
        return sum(comps[rank].reduce(inputs[rank], "m", comm, True) for _ in range(30))

    total = run_ranks(4, rank_main, "ring")[0]
    residual = sum(c.memory.residuals["m"] for c in comps) / 4
    assert torch.allclose(total + residual, 30 * inputs.mean(0), atol=1e-9)
    assert residual.norm() < 30 * inputs.mean(0).norm() / 2       # the error stays bounded


# --- SIDCo ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("distribution, sample", [
    ("exponential", lambda g, n: torch.empty(n).exponential_(2.0, generator=g)),
    ("gpareto", lambda g, n: (torch.rand(n, generator=g) ** -0.25 - 1) / 0.25),   # GPD xi=0.25
    ("gamma", lambda g, n: torch.distributions.Gamma(0.5, 1.0).sample((n,))),
])
def test_sidco_single_stage_fits_its_own_distribution(distribution, sample):
    torch.manual_seed(0)
    a = sample(gen(4), 200_000).abs()
    for ratio in (0.1, 0.01):
        t = sidco.SIDCo(distribution, stages=1).threshold(a, ratio, "g")
        got = float((a > t).float().mean())
        assert abs(got / ratio - 1) < 0.2, (distribution, ratio, got)


@pytest.mark.parametrize("distribution", ["exponential", "gpareto", "gamma"])
def test_sidco_adaptive_stages_reach_the_target_on_gaussian_gradients(distribution):
    """|N(0,1)| is lighter-tailed than all three fits: one stage misses, more stages get close."""
    x = torch.randn(100_000, generator=gen(5))
    c = C.build("threshold", {"ratio": 0.01, "estimator": distribution, "memory": "none"})
    counts = [c.compress(x, "g")[0][0].numel() for _ in range(6)]
    assert all(abs(n / 1000 - 1) < 0.2 for n in counts[-2:]), counts
    assert c.sidco.stages["g"] >= 2


def test_sidco_ignores_zeros():
    x = torch.randn(50_000, generator=gen(6)).abs()
    x[::2] = 0                                          # half the gradient is exactly zero
    t = sidco.SIDCo("exponential", stages=3).threshold(x, 0.01, "g")
    assert abs(float((x > t).sum()) / 500 - 1) < 0.25
    assert sidco.SIDCo().threshold(torch.zeros(100), 0.01, "z") == 0.0


# --- sparsifiers --------------------------------------------------------------------------------------------
def test_topk_prefilter_selects_the_exact_topk():
    for n, k in ((100_000, 1000), (300_000, 30), (70_000, 4000)):
        a = torch.randn(n, generator=gen(n)).abs()
        fast = topk.largest(a, k, gen(1))
        exact = torch.topk(a, k).indices
        assert torch.equal(fast.sort().values, exact.sort().values)


def test_dgc_memory_momentum_correction():
    """u = m*u + g, v += u; sent entries are cleared from u and v (DGC's factor masking)."""
    c = C.build("topk", {"ratio": 0.5, "memory": "dgc", "momentum": 0.5})
    comm = LocalGroup(1).channel(0)
    g = torch.tensor([4.0, 1.0, -3.0, 0.5])
    out = c.reduce(g, "d", comm, True)
    assert torch.equal(out, torch.tensor([4.0, 0.0, -3.0, 0.0]))
    mem = c.memory
    assert torch.equal(mem.momentums["d"], torch.tensor([0.0, 1.0, 0.0, 0.5]))
    assert torch.equal(mem.accumulated["d"], torch.tensor([0.0, 1.0, 0.0, 0.5]))
    out = c.reduce(g, "d", comm, True)      # u = [4, 1.5, -3, .75]; v = [4, 2.5, -3, 1.25]
    assert torch.equal(out, torch.tensor([4.0, 0.0, -3.0, 0.0]))
    assert torch.equal(mem.accumulated["d"], torch.tensor([0.0, 2.5, 0.0, 1.25]))


def test_adaq_sends_one_mean_per_sign():
    x = torch.randn(20_000, generator=gen(7))
    c = C.build("adaq", {"ratio": 0.05, "memory": "none"})
    payload, ctx = c.compress(x, "a")
    y = c.decompress(payload, ctx)
    pos, neg = y[y > 0].unique(), y[y < 0].unique()
    assert pos.numel() == 1 and neg.numel() == 1
    for count, side in ((payload[0].numel(), x > 0), (payload[1].numel(), x < 0)):
        assert abs(count / (0.05 * int(side.sum())) - 1) < 0.3
    assert torch.allclose(pos, x[payload[0].long()].mean()) and torch.allclose(neg, x[payload[1].long()].mean())


# --- quantizers --------------------------------------------------------------------------------------------
def test_inceptionn_error_bound_and_classes():
    x = torch.cat([torch.randn(5000, generator=gen(8)) * s for s in (1e-4, 1e-2, 1.0, 1e3)])
    for bound in (2 ** -10, 1e-2):
        c = C.build("inceptionn", {"error_bound": bound})
        payload, ctx = c.compress(x, "i")
        assert (c.decompress(payload, ctx) - x).abs().max() <= bound
        assert packing.nbytes(payload) < 4 * x.numel()


def test_natural_rounds_to_neighbouring_powers_of_two():
    x = torch.tensor([0.0, 1.0, -2.0, 0.75, 3.0, 1e-35, -1e30, 2.0 ** -99, 2.0 ** 26])
    c = C.build("natural")
    y = c.decompress(*c.compress(x, "n"))
    assert y[0] == 0 and y[1] == 1 and y[2] == -2 and y[7] == 2.0 ** -99 and y[8] == 2.0 ** 26
    assert y[3] in (0.5, 1.0) and y[4] in (2.0, 4.0) and y[5] == 0         # below 2**-99: flushed
    assert y[6] == -(2.0 ** natural.EMAX)                 # beyond the range: clamped
    codes = torch.arange(256, dtype=torch.uint8)
    values = natural.decode_powers(codes)
    exact = natural.encode_powers(values, gen(0))        # powers of two (and Inf, NaN) encode to themselves
    decoded = natural.decode_powers(exact)
    assert torch.equal(decoded.isnan(), values.isnan()) and torch.equal(decoded[~values.isnan()], values[~values.isnan()])


def test_natural_keeps_inf_and_nan():
    """An overflowed gradient must stay non-finite (AMP's GradScaler skips the step on it)."""
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), -0.0, -(2.0 ** -120), 5.0])
    c = C.build("natural")
    y = c.decompress(*c.compress(x, "n"))
    assert y[0] == float("inf") and y[1] == -float("inf") and y[2].isnan()
    assert y[3] == 0 and y[4] == 0 and y[5] in (4.0, 8.0)     # a flushed negative is zero, not NaN


def test_u8bit_relative_error():
    x = torch.randn(10_000, generator=gen(9))
    c = C.build("u8bit")
    y = c.decompress(*c.compress(x, "u"))
    big = x.abs() > x.abs().max() * 2 ** -15
    assert ((y - x)[big].abs() / x[big].abs()).max() <= 0.045
    assert torch.equal(y.sign()[big], x.sign()[big])
    assert torch.equal(u8bit.nearest_entry(u8bit.TABLE), torch.arange(128))


def test_qsgd_wide_levels_use_int16():
    x = torch.randn(1000, generator=gen(10))
    c = C.build("qsgd", {"levels": 1000})
    payload, ctx = c.compress(x, "q")
    assert payload[0].dtype == torch.int16
    assert (c.decompress(payload, ctx) - x).norm() < 0.01 * x.norm()


def test_onebit_means():
    x = torch.tensor([-3.0, -1.0, 2.0, 4.0, 0.0])
    c = C.build("onebit", {"memory": "none"})
    assert torch.equal(c.decompress(*c.compress(x, "o")), torch.tensor([-2.0, -2.0, 2.0, 2.0, 2.0]))


def test_fp16_average_keeps_the_sum_in_range():
    x = torch.full((8,), 30000.0)        # 4 * 30000 overflows fp16; 4 * 30000/4 does not
    comps = [C.build("fp16") for _ in range(4)]
    outs = run_ranks(4, lambda r, comm: comps[r].reduce(x, "h", comm, True), "ring")
    assert torch.allclose(outs[0], x, rtol=1e-3)


def test_terngrad_clipping_and_constant_tensors():
    c = C.build("terngrad")
    const = torch.full((100,), 0.3)
    assert torch.allclose(c.decompress(*c.compress(const, "t")), const)   # std 0 must not clip everything
    x = torch.cat([torch.randn(999, generator=gen(11)), torch.tensor([100.0])])
    scalar = c.compress(x, "t")[0][-1]
    assert float(scalar) < 2.5 * float(x.std(correction=0)) + 1e-4       # the outlier was clipped


@pytest.mark.parametrize("name, params", [("topk", {"ratio": 0.25}), ("dgc", {"ratio": 0.25}), ("efsignsgd", {}),
                                          ("onebit", {}), ("powersgd", {"rank": 1}), ("signum", {}), ("signsgd", {})])
def test_a_gradient_that_is_not_finite_leaves_the_error_feedback_as_it_was(name, params):
    """An fp16 overflow travels (a loss scaler sees it and skips the step) and the steps after it reduce
    as if it never came: its Inf or NaN is not kept in the memory (before, every later step was Inf/NaN)."""
    comm = LocalGroup(1, algorithm="ring" if name == "powersgd" else "allgather").channel(0)
    steps = [torch.randn(16, 16, generator=gen(s)) for s in range(4)]
    bad = steps[1].clone()
    bad[3, 5] = float("inf")
    clean, hit = C.build(name, params), C.build(name, params)
    expected = [clean.reduce(g, "w", comm, True) for g in steps]
    got = [hit.reduce(g, "w", comm, True) for g in steps[:1] + [bad] + steps[1:]]
    assert not torch.isfinite(got[1]).all(), "the overflow did not travel"
    for a, b in zip(expected[1:], got[2:]):
        assert torch.allclose(a, b, atol=1e-6), (name, (a - b).abs().max())


@pytest.mark.parametrize("name, params", [("topk", {"ratio": 0.25}), ("dgc", {"ratio": 0.25}), ("efsignsgd", {}),
                                          ("powersgd", {"rank": 1}), ("signum", {}), ("signsgd", {})])
def test_an_inf_on_one_rank_poisons_no_ranks_error_feedback(name, params):
    """Rank 1's overflow reaches every rank's result, and no later one (before: every later step was Inf
    or NaN). PowerSGD's memory and Q follow the reduced result, the same on every rank: after it, both
    ranks reduce as in a run without that step."""
    steps = torch.randn(2, 4, 16, 16, generator=gen(3))
    bad = steps.clone()
    bad[1, 1, 3, 5] = float("inf")
    algorithm = "ring" if name == "powersgd" else "allgather"

    def run(inputs):   # (rank, step, ...)
        comps = [C.build(name, params) for _ in range(2)]
        return run_ranks(2, lambda rank, comm: [comps[rank].reduce(x, "w", comm, True) for x in inputs[rank]],
                         group=LocalGroup(2, algorithm=algorithm))

    hit = run(bad)
    for rank in range(2):
        assert not torch.isfinite(hit[rank][1]).all(), f"the overflow did not reach rank {rank}"
        assert all(torch.isfinite(out).all() for out in hit[rank][2:]), f"rank {rank}'s memory kept the Inf"
        assert all(torch.equal(a, b) for a, b in zip(hit[0][2:], hit[rank][2:])), "the ranks differ"
    if name == "powersgd":
        clean = run(steps[:, [0, 2, 3]])   # the same steps without the one that overflowed
        for a, b in zip(clean[0][1:], hit[0][2:]):
            assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


@pytest.mark.parametrize("name, params", [("topk", {"ratio": 0.25}), ("dgc", {"ratio": 0.25}), ("threshold", {"tau": 10}),
                                          ("powersgd", {"rank": 1})])
def test_a_name_whose_tensor_changes_shape_starts_its_error_feedback_anew(name, params):
    """(before: a RuntimeError of torch's at every later step, or for threshold the old residual added
    to every element of the new tensor)"""
    comm = LocalGroup(1, algorithm="ring" if name == "powersgd" else "allgather").channel(0)
    fresh, reused = C.build(name, params), C.build(name, params)
    for shape in ((16, 16), (8, 32), (32, 16), (3,), (1,)):   # (matrices PowerSGD compresses)
        reused.reduce(torch.full(shape, 3.0), "w", comm, True)
    now = torch.randn(8, 8, generator=gen(9))
    assert torch.equal(reused.reduce(now, "w", comm, True), fresh.reduce(now, "w", comm, True)), name

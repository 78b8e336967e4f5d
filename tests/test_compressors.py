"""The conformance checks every registered compressor passes, numbered as the tests below: 1 shapes
and dtypes round-trip, 2 payload size as promised (expected_bytes), 3 exact cases, 4 unbiasedness
where promised, 5 aggregation (votes, averaging), 6 error feedback, 7 shared random streams, 8 DGC's
count band, and 9 the multi-rank check (4 thread-ranks of commlib.testing.LocalGroup) on every
algorithm each one allows."""
import math

import numpy as np
import pytest
import torch

import commlib.compressors as C
from commlib.compressors import packing
from commlib.compressors.spec import build, parse
from commlib.testing import LocalGroup, run_ranks

pytestmark = pytest.mark.timeout(60)

# One spec per registered method (defaults), plus variants that reach other code paths.
DEFAULTS = sorted(C.compressors())
VARIANTS = ["qsgd(levels=7)", "topk(ratio=0.2)", "randomk(ratio=0.1)", "threshold(tau=0.5)",
            "threshold(ratio=0.05)", "threshold(ratio=0.05,estimator=gamma)", "dgc(ratio=0.05)",
            "adaq(ratio=0.05)", "powersgd(rank=2)", "sketch(bins=16)"]
SPECS = DEFAULTS + VARIANTS
VOTES = {"signsgd", "signum"}


def make(spec, **overrides):
    name, params, _ = parse(spec)
    return build(name, {**params, **overrides})


def test_every_issue_method_is_registered():
    issue = {"none", "fp16", "qsgd", "terngrad", "signsgd", "signum", "efsignsgd", "onebit", "natural", "topk",
             "randomk", "threshold", "dgc", "powersgd", "adaq", "inceptionn", "sketch", "u8bit"}
    assert set(C.compressors()) == issue
    assert set(C.memories()) == {"none", "residual", "dgc", "efsignsgd", "powersgd"}


# 1. decompress(compress(x)) has x's shape and dtype, 0-d and empty tensors included ------------------
@pytest.mark.parametrize("spec", SPECS)
def test_1_shape_and_dtype(spec):
    gen = torch.Generator().manual_seed(1)
    for shape in [(), (0,), (1,), (7,), (4, 5), (2, 3, 4), (3, 0)]:
        for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            c = make(spec)
            x = torch.randn(shape, generator=gen).to(dtype)
            payload, ctx = c.compress(x, "w")
            assert all(p.dim() == 1 for p in payload), spec
            y = c.decompress(payload, ctx)
            assert y.shape == x.shape and y.dtype == x.dtype, (spec, shape, dtype)
            assert torch.isfinite(y.float()).all(), (spec, shape, dtype)
    # the pipeline returns the input's type too: numpy in, numpy out (the TensorFlow path)
    for x in (np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32), np.full((), 2.5)):
        out = make(spec).reduce(x, "w", _single(make(spec)), True)
        assert isinstance(out, np.ndarray) and out.shape == x.shape and out.dtype == x.dtype, spec
    t = torch.randn(2, 6, dtype=torch.float64)
    out = make(spec).reduce(t, "w", _single(make(spec)), True)
    assert torch.is_tensor(out) and out.shape == t.shape and out.dtype == t.dtype


def _single(compressor):
    return LocalGroup(1, algorithm=sorted(compressor.carriers())[0]).channel(0)


# 2. payload size matches the declared ratio ------------------------------------------------------------
FORMULAS = {  # bytes on the wire for n float32 elements, written out independently of the code
    "none": lambda n: 4 * n,
    "fp16": lambda n: 2 * n,
    "qsgd": lambda n: n + 4 * math.ceil(n / 128),                       # 8-bit codes + a norm per 128
    "qsgd(levels=7)": lambda n: 4 * math.ceil(n / 8) + 4 * math.ceil(n / 128),  # 15 levels: 4 bits
    "terngrad": lambda n: 2 * math.ceil(n / 8) + 4,                     # 2 bits + the scalar
    "signsgd": lambda n: math.ceil(n / 8) + 1,                          # 1 bit + a finite flag
    "signum": lambda n: math.ceil(n / 8) + 1,
    "efsignsgd": lambda n: math.ceil(n / 8) + 4,
    "onebit": lambda n: math.ceil(n / 8) + 8,
    "natural": lambda n: n,
    "topk": lambda n: 8 * max(1, math.floor(0.01 * n)),                 # value + int32 index
    "topk(ratio=0.2)": lambda n: 8 * max(1, math.floor(0.2 * n)),
    "randomk": lambda n: 4 * max(1, math.floor(0.01 * n)),              # indices never travel
    "randomk(ratio=0.1)": lambda n: 4 * max(1, math.floor(0.1 * n)),
    "sketch": lambda n: 6 * math.ceil(n / 8) + 4 * 64,                  # 64 bins: 6 bits
    "sketch(bins=16)": lambda n: 4 * math.ceil(n / 8) + 4 * 16,
    "u8bit": lambda n: n + 4,
}


@pytest.mark.parametrize("spec", SPECS)
def test_2_payload_size(spec):
    gen = torch.Generator().manual_seed(2)
    for n in (1, 7, 100, 1000, 4099):
        c = make(spec)
        x = torch.randn(n, generator=gen)
        payload, ctx = c.compress(x, "w")
        size = packing.nbytes(payload)
        if spec in FORMULAS:
            assert size == FORMULAS[spec](n) == c.expected_bytes(n), (spec, n, size)
        elif spec.startswith("threshold(tau"):
            assert size == 8 * int((x.abs() > 0.5).sum())
        elif spec.startswith(("threshold", "dgc")):
            assert size % 8 == 0 and size <= 8 * n
        elif spec.startswith("adaq"):
            assert size == 4 * (payload[0].numel() + payload[1].numel()) + 8
        elif spec.startswith("powersgd"):
            assert size == 4 * n     # a vector: PyTorch sends 1-D tensors uncompressed
        elif spec == "inceptionn":
            cls = packing.unpack_bits(payload[0], 2, n)
            counts = [int((cls == k).sum()) for k in range(4)]
            assert size == 2 * math.ceil(n / 8) + counts[1] + 2 * counts[2] + 4 * counts[3]
        else:
            pytest.fail(f"no size rule for {spec}")
        blob = packing.to_bytes(payload)   # what allgather carries: payload + a small header
        assert size <= blob.size <= size + 8 + 23 * len(payload)
    if spec.startswith("powersgd"):
        rank = make(spec).rank
        payload, _ = make(spec).compress(torch.randn(40, 60, generator=gen), "m")
        assert packing.nbytes(payload) == 4 * (40 + 60) * rank


# 3. exact cases -----------------------------------------------------------------------------------------
def test_3_exact_cases():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 11, generator=gen)
    for spec in ("none", "topk(ratio=1)", "randomk(ratio=1)", "threshold(tau=0)"):
        c = make(spec)
        assert torch.equal(c.decompress(*c.compress(x, "w")), x), spec
    representable = torch.randint(-2048, 2048, (100,), generator=gen).float() / 64   # fp16 holds these exactly
    c = make("fp16")
    assert torch.equal(c.decompress(*c.compress(representable, "w")), representable)
    for rank in (1, 2, 3):
        m = torch.randn(30, rank, generator=gen, dtype=torch.float64) @ torch.randn(rank, 50, generator=gen,
                                                                                    dtype=torch.float64)
        for r in (rank, rank + 1):
            c = make(f"powersgd(rank={r})")
            assert torch.allclose(c.decompress(*c.compress(m, "m")), m, atol=1e-10), (rank, r)


# 4. unbiasedness by Monte Carlo ---------------------------------------------------------------------------
@pytest.mark.parametrize("spec, variance_bound", [
    ("qsgd(levels=2,bucket=64)", lambda x: (x.norm() / 2) ** 2 / 4),         # (norm/s)^2/4 per element
    ("terngrad(clip=0)", lambda x: x.abs().max() ** 2 / 4 + x.abs().max() ** 2),
    ("natural", lambda x: (x ** 2).max() / 8),
])
def test_4_unbiased(spec, variance_bound):
    """Tiling x T times keeps every statistic the methods use (bucket norm = x's norm, max|x|),
    so one compress of the tiled tensor is T independent draws. Tolerance: 5 standard errors."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(64, generator=gen, dtype=torch.float64) * torch.logspace(-3, 0, 64, dtype=torch.float64)
    trials = 4000
    c = make(spec)
    draws = c.decompress(*c.compress(x.repeat(trials), "w")).view(trials, 64)
    assert not torch.equal(draws[0], x)                    # it is random...
    error = (draws.mean(0) - x).abs().max()
    assert error <= 5 * math.sqrt(variance_bound(x) / trials), (spec, float(error))   # ...and unbiased


# 5. aggregation rules -------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["signsgd", "signum"])
def test_5_majority_vote_ties_positive(spec):
    columns = [[1, 1, -1, -1], [-1, -1, -1, 1], [1, 1, 1, -1], [0, -1, 0, -1], [-1, -1, -1, -1]]
    inputs = torch.tensor(columns, dtype=torch.float32).T          # rank r holds row r
    expected = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0])           # ties (and zeros) go to +1
    for average in (True, False):                                  # a vote is never divided
        comps = [make(spec) for _ in range(4)]
        outs = run_ranks(4, lambda r, comm: comps[r].reduce(inputs[r], "v", comm, average))
        for out in outs:
            assert torch.equal(out, expected)


@pytest.mark.parametrize("shape", [(3, 11), (), (5,)])
def test_5_a_vote_used_as_grace_does_keeps_its_shape_and_an_overflow(shape):
    """GRACE's own loop (compress, decompress, aggregate) on tensors of any shape; a rank's Inf makes
    the vote NaN (a sign could not carry it)."""
    c = make("signsgd")
    xs = [torch.randn(shape, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    vote = c.aggregate([c.decompress(*c.compress(x, "w")) for x in xs])
    assert vote.shape == shape and torch.equal(vote, torch.where(sum(x.sign() for x in xs) >= 0, 1.0, -1.0))
    xs[1].view(-1)[0] = float("inf")
    assert c.aggregate([c.decompress(*c.compress(x, "w")) for x in xs]).isnan().all()


def test_5_efsignsgd_sum_over_lr():
    values = torch.tensor([0.5, 1.0, 2.0, 4.5])          # rank r sends c_r * ones: p = lr * c_r exactly
    for average, expected in ((True, values.mean()), (False, values.sum())):
        comps = [make("efsignsgd(lr=0.05)") for _ in range(4)]
        outs = run_ranks(4, lambda r, comm: comps[r].reduce(values[r] * torch.ones(10), "e", comm, average))
        for out in outs:
            assert torch.allclose(out, expected * torch.ones(10), rtol=1e-6)


@pytest.mark.parametrize("spec, algorithm", [("topk(ratio=1)", "allgather"), ("topk(ratio=1)", "omnireduce"),
                                             ("none", "ring"), ("randomk(ratio=1)", "switchml")])
def test_5_average_divides_by_n(spec, algorithm):
    gen = torch.Generator().manual_seed(5)
    inputs = torch.randn(4, 20, generator=gen)
    for average, expected in ((True, inputs.mean(0)), (False, inputs.sum(0))):
        comps = [make(spec) for _ in range(4)]
        outs = run_ranks(4, lambda r, comm: comps[r].reduce(inputs[r], "a", comm, average), algorithm)
        for out in outs:
            assert torch.allclose(out, expected, atol=1e-6)


# 6. error feedback identity: residual + decompress(payload) == compensated --------------------------------
@pytest.mark.parametrize("spec", [s for s in DEFAULTS if s not in VOTES | {"none", "powersgd"}])
def test_6_error_feedback_identity(spec):
    """Through the real pipeline (one rank, so the output is decompress(own payload)): after step 1
    e1 = x1 - out1; step 2 compensates x2 + e1 and leaves e2 = x2 + e1 - out2."""
    gen = torch.Generator().manual_seed(6)
    c = make(spec, memory="efsignsgd" if spec == "efsignsgd" else "residual")
    comm = _single(c)
    x1, x2 = torch.randn(2, 300, generator=gen)
    scale = c.lr if spec == "efsignsgd" else 1.0     # efsignsgd compensates lr*g + e and divides by lr
    out1 = c.reduce(x1, "w", comm, True)
    e1 = c.memory.residuals["w"]
    assert torch.allclose(e1 + scale * out1, scale * x1, atol=1e-6)
    out2 = c.reduce(x2, "w", comm, True)
    assert torch.allclose(c.memory.residuals["w"] + scale * out2, scale * x2 + e1, atol=1e-6)


def test_6_powersgd_error_feedback():
    gen = torch.Generator().manual_seed(6)
    c = make("powersgd")
    m = torch.randn(20, 30, generator=gen)
    out = c.reduce(m, "m", LocalGroup(1, algorithm="ring").channel(0), True)
    assert torch.allclose(c.memory.residuals["m"] + out, m, atol=1e-6)


# 7. randomk indices identical on every rank for a (name, step) --------------------------------------------
def test_7_randomk_shared_indices():
    comps = [make("randomk(ratio=0.05)") for _ in range(4)]
    for rank, c in enumerate(comps):
        c.comm_rank = rank
    state = torch.random.get_rng_state()
    for step in range(3):
        for name in ("a", "b"):
            indices = [c.indices(name, step, 1000, "cpu") for c in comps]
            assert all(torch.equal(i, indices[0]) for i in indices)
            assert indices[0].unique().numel() == 50 and 0 <= int(indices[0].min()) and int(indices[0].max()) < 1000
    assert not torch.equal(comps[0].indices("a", 0, 1000, "cpu"), comps[0].indices("a", 1, 1000, "cpu"))
    assert not torch.equal(comps[0].indices("a", 0, 1000, "cpu"), comps[0].indices("b", 0, 1000, "cpu"))
    inputs = torch.randn(4, 1000, generator=torch.Generator().manual_seed(7))
    run_ranks(4, lambda r, comm: comps[r].reduce(inputs[r], "c", comm, True), "ring")
    assert torch.equal(torch.random.get_rng_state(), state), "the global RNG must not be touched"


# 8. dgc selected count within [0.7, 1.3] * r * n ----------------------------------------------------------
@pytest.mark.parametrize("n", [5_000, 200_000])
def test_8_dgc_count_band(n):
    gen = torch.Generator().manual_seed(8)
    data = {
        "normal": torch.randn(n, generator=gen),
        "laplace": torch.distributions.Laplace(0.0, 1.0).sample((n,)),
        "uniform": torch.rand(n, generator=gen),
        "heavy": torch.randn(n, generator=gen) / torch.rand(n, generator=gen).clamp_min(1e-3),
        "ties": torch.randint(-3, 4, (n,), generator=gen).float(),
        "mostly zero": torch.randn(n, generator=gen) * (torch.rand(n, generator=gen) < 0.005),
        "zeros": torch.zeros(n),
    }
    for ratio in (0.001, 0.01, 0.1):
        k = max(1, math.floor(ratio * n))
        for kind, x in data.items():
            payload, _ = make(f"dgc(ratio={ratio})").compress(x, "g")
            count = payload[0].numel()
            assert 0.7 * k <= count <= 1.3 * k, (kind, ratio, count, k)
            assert payload[1].unique().numel() == count


# 9. multi-rank: 4 ranks' compressed allreduce equals the reference ---------------------------------------
def _reference(spec, inputs, average):
    """Mean (or aggregate rule) of each rank's decompress(compress(compensate(x_r)))."""
    decoded = []
    for rank, x in enumerate(inputs):
        c = make(spec)
        c.comm_rank = rank
        flat = x.reshape(-1)
        scale_first = average and c.divide_before_sum
        flat = c.memory.compensate(flat / len(inputs) if scale_first else flat, "w")
        decoded.append(c.decompress(*c.compress(flat, "w")))
    out = c.aggregate(decoded)
    if average and c.averages and not scale_first:
        out = out / len(inputs)
    return out.view(inputs[0].shape)


def _powersgd_reference(spec, inputs, average):
    """PyTorch PowerSGD's math written out: P = orth(sum M_i Q0), Q = sum M_i^T P / N, M ~ P Q^T."""
    from commlib.compressors.powersgd import orthogonalize
    c = make(spec)
    g = c.generator("w", "cpu", shared=True, step=0)
    q0 = orthogonalize(torch.randn(inputs[0].shape[1], c.rank, generator=g, dtype=torch.float64).float())
    p = orthogonalize(sum(m @ q0 for m in inputs))
    q = sum(m.T @ p for m in inputs) / len(inputs)
    return p @ q.T if average else p @ q.T * len(inputs)


@pytest.mark.parametrize("spec", SPECS)
def test_9_multirank_equals_reference(spec):
    gen = torch.Generator().manual_seed(9)
    inputs = torch.randn(4, 16, 24, generator=gen) * torch.tensor([0.5, 1.0, 2.0, 3.0]).view(4, 1, 1)
    tolerance = 2e-3 if spec == "fp16" else 1e-5
    reference = _powersgd_reference if spec.startswith("powersgd") else _reference
    for algorithm in sorted(make(spec).carriers()):
        for average in (True, False):
            expected = reference(spec, inputs, average)
            comps = [make(spec) for _ in range(4)]
            group = LocalGroup(4, algorithm=algorithm)
            outs = run_ranks(4, lambda r, comm: comps[r].reduce(inputs[r], "w", comm, average), group=group)
            for out in outs:
                assert torch.allclose(out, expected, rtol=tolerance, atol=tolerance), (spec, algorithm, average)
            ops = {op for _, op, _, _ in group.log}
            assert ops == ({"allreduce"} if algorithm != "allgather" else {"allgather"}), (spec, algorithm, ops)

"""The surface the core and users see: resolve/from_params, the compatibility table, errors,
checkpoints, bit packing, and collectives that must never hang (empty and uneven payloads)."""
import numpy as np
import pytest
import torch

import commlib.compressors as C
from commlib.compressors import packing
from commlib.compressors.spec import parse
from commlib.errors import ConfigError, InvalidTensor
from commlib.testing import LocalGroup, run_ranks

pytestmark = pytest.mark.timeout(60)


# --- resolve / from_params / registry -------------------------------------------------------------------
def test_resolve_forms():
    assert C.resolve(None) is None and C.resolve("none") is None and C.resolve(" None ") is None
    topk = C.resolve("topk(ratio=0.05, memory=residual)")
    assert topk.name == "topk" and topk.ratio == 0.05 and topk.memory.name == "residual"
    assert topk.payload == "sparse" and topk.carriers() == ["omnireduce", "allgather"]
    assert C.resolve("topk(memory=residual,ratio=0.05)") is topk      # one object per spec: state persists
    assert C.resolve(topk) is topk
    assert C.resolve("signsgd").carriers() == ["allgather"]
    assert C.resolve("randomk").carriers() == ["ring", "switchml"]
    assert C.resolve("powersgd(rank=2,warm_start=false)").warm_start is False
    assert C.resolve("threshold(ratio=0.01,estimator=gamma,stages=3)").sidco.fixed == 3
    dgc = C.resolve("dgc(ratio=0.01,momentum=0.5)")                   # momentum goes to the dgc memory
    assert dgc.memory.name == "dgc" and dgc.memory.momentum == 0.5


def test_unknown_names_and_params_are_config_errors():
    with pytest.raises(ConfigError, match="known compressors: .*topk"):
        C.resolve("topq")
    with pytest.raises(ConfigError, match="known memories: .*residual"):
        C.resolve("topk(memory=residul)")
    with pytest.raises(ConfigError, match=r"unknown parameter\(s\) \['ratioo'\].*accepted: .*ratio"):
        C.resolve("topk(ratioo=0.1)")
    with pytest.raises(ConfigError, match="cannot parse"):
        C.resolve("topk(0.1)")
    with pytest.raises(ConfigError, match="compression must be"):
        C.resolve(3.5)
    for bad in ("topk(ratio=0)", "topk(ratio=1.5)", "qsgd(levels=0)", "powersgd(rank=0)", "sketch(bins=1000)",
                "threshold(tau=0.1,ratio=0.1)", "efsignsgd(lr=0)", "signum(momentum=1)", "inceptionn(error_bound=-1)",
                "threshold(ratio=0.1,estimator=cauchy)"):
        with pytest.raises(ConfigError):
            C.resolve(bad)
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("params", [{"compressor": "topk", "compress_ratio": True},
                                    {"compressor": "powersgd", "compress_rank": True},
                                    {"compressor": "powersgd", "start_powerSGD_iter": True},
                                    {"compressor": "qsgd", "quantum_num": True},
                                    {"compressor": "threshold", "threshold": True},
                                    {"compressor": "efsignsgd", "lr": True},
                                    {"compressor": "dgc", "memory": "dgc", "momentum": True},
                                    {"compressor": "terngrad", "clip": "2.5"},
                                    {"compressor": "topk", "memory": "residual", "beta": True},
                                    {"compressor": "topk", "memory": "residual", "gamma": float("nan")},
                                    {"compressor": "powersgd", "orthogonalization_epsilon": True},
                                    {"compressor": "powersgd", "warm_start": "false"},
                                    {"compressor": "efsignsgd", "lr": float("inf")},
                                    {"compressor": "threshold", "threshold": float("inf")},
                                    {"compressor": "topk", "compress_ratio": 10 ** 400},
                                    {"compressor": "randomk", "random_seed": True}])
def test_a_bool_text_or_non_finite_value_for_a_number_is_refused(params):
    """GRACE's params from JSON may hold `true` where a number goes: it is no rank, level count,
    threshold or rate (Python would take it for 1); a number as text is no number either, and an
    Inf or NaN makes every result NaN or zero."""
    with pytest.raises(ConfigError, match="got (True|'2.5'|'false'|nan|inf|1000000)"):
        C.from_params(params)


def test_numpy_numbers_are_numbers():
    built = C.from_params({"compressor": "efsignsgd", "lr": np.float32(0.5), "seed": np.int64(3)})
    assert (built.lr, built.seed) == (0.5, 3)
    assert C.build("qsgd", {"levels": np.int32(15)}).levels == 15


def test_grace_from_params():
    c = C.from_params({"compressor": "topk", "memory": "residual", "communicator": "allgather", "compress_ratio": 0.01})
    assert c.name == "topk" and c.ratio == 0.01 and c.memory.name == "residual"
    assert c.carriers() == ["allgather"]
    assert C.from_params({"compressor": "topk"}).memory.name == "none"       # GRACE's default memory
    q = C.from_params({"compressor": "qsgd", "quantum_num": 63, "communicator": "broadcast"})
    assert q.levels == 63 and q.carriers() == ["allgather"]
    ef = C.from_params({"compressor": "efsignsgd", "memory": "efsignsgd", "lr": 0.05})
    assert ef.lr == 0.05 and ef.memory.lr == 0.05                             # lr shared by both roles
    assert C.from_params({"compressor": "efsignsgd"}).memory.name == "none"
    assert C.build("efsignsgd", {"lr": 0.02}).memory.lr == 0.02               # default memory follows lr
    d = C.from_params({"compressor": "dgc", "memory": "dgc", "momentum": 0.8, "compress_ratio": 0.001,
                       "world_size": 4, "gradient_clipping": False})          # a whole GRACE config
    assert d.memory.momentum == 0.8 and d.ratio == 0.001
    with pytest.raises(ConfigError, match="clip_grad_norm_"):
        C.from_params({"compressor": "dgc", "memory": "dgc", "gradient_clipping": True})
    p = C.from_params({"compressor": "powersgd", "memory": "powersgd", "communicator": "allreduce", "compress_rank": 4})
    assert p.rank == 4 and p.carriers() == ["ring", "switchml"]
    assert C.from_params({"compressor": "threshold", "threshold": 0.2}).tau == 0.2
    assert C.from_params({"compressor": "none"}).name == "none"
    assert C.resolve({"compressor": "topk", "compress_ratio": 0.3}).ratio == 0.3
    with pytest.raises(ConfigError, match="sparse payload.*allreduce.*cannot carry"):
        C.from_params({"compressor": "topk", "communicator": "allreduce"})
    with pytest.raises(ConfigError, match=r"unknown algorithm \(GRACE communicator\) 'carrier-pigeon'"):
        C.from_params({"compressor": "topk", "communicator": "carrier-pigeon"})


def test_pytorch_powersgd_option_names():
    c = C.build("powersgd", {"matrix_approximation_rank": 3, "start_powerSGD_iter": 10, "min_compression_rate": 4,
                             "warm_start": False, "random_seed": 7, "orthogonalization_epsilon": 1e-8})
    assert (c.rank, c.start_iter, c.min_compression_rate, c.warm_start, c.seed) == (3, 10, 4.0, False, 7)


def test_parse():
    assert parse("topk") == ("topk", {}, None)
    assert parse("topk(ratio=1e-3, memory=residual)") == ("topk", {"ratio": 1e-3, "memory": "residual"}, None)
    assert parse("powersgd(warm_start=False, rank=2)") == ("powersgd", {"warm_start": False, "rank": 2}, None)
    assert parse("fp16(powersgd(rank=4))") == ("powersgd", {"rank": 4}, ("fp16", {}, None))


def test_algorithm_compatibility_is_enforced():
    from commlib.backends import KINDS
    topk = C.build("topk")
    with pytest.raises(ConfigError, match="'topk' sends a sparse payload, which algorithm 'ring' cannot carry; "
                                          r"use one of \['omnireduce', 'allgather'\]"):
        topk.check_carrier("ring", "here")
    topk.check_carrier("omnireduce", "here")
    with pytest.raises(ConfigError):
        topk.reduce(torch.ones(4), "t", LocalGroup(1, algorithm="switchml").channel(0), True)
    with pytest.raises(ConfigError):
        C.build("signsgd").reduce(torch.ones(4), "t", LocalGroup(1, algorithm="omnireduce").channel(0), True)
    assert topk.carriers() == ["omnireduce", "allgather"]                 # sparse rides omnireduce first
    assert C.build("topk", algorithm="allgather").carriers() == ["allgather"]
    assert C.build("randomk").carriers() == ["ring", "switchml"]
    assert C.build("signsgd").carriers() == ["allgather"]
    for name, cls in C.compressors().items():
        assert cls.payload in KINDS, name


def test_integer_tensors_rejected():
    with pytest.raises(InvalidTensor, match="floating-point"):
        C.build("topk").reduce(torch.arange(10), "i", LocalGroup(1).channel(0), True)
    with pytest.raises(InvalidTensor):
        C.build("qsgd").compress(np.arange(10), "i")


# --- checkpoints -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["topk", "randomk", "signum", "dgc", "powersgd(rank=2)", "qsgd",
                                  "threshold(ratio=0.05)", "efsignsgd", "natural"])
def test_state_dict_resumes_exactly(spec):
    """Run 3 steps; checkpoint; a fresh compressor loaded from it continues exactly like the original."""
    gen = torch.Generator().manual_seed(10)
    xs = torch.randn(5, 12, 20, generator=gen)
    algorithm = sorted(C.build(*parse(spec)).carriers())[0]
    comm = LocalGroup(1, algorithm=algorithm).channel(0)
    original = C.build(*parse(spec))
    for x in xs[:3]:
        original.reduce(x, "w", comm, True)
    state = original.state_dict()
    torch.save(state, __import__("io").BytesIO())                  # checkpointable with torch.save
    resumed = C.build(*parse(spec))
    resumed.load_state_dict(state)
    for x in xs[3:]:
        assert torch.equal(original.reduce(x, "w", comm, True), resumed.reduce(x, "w", comm, True)), spec


def test_package_state_dict():
    c = C.resolve("topk(ratio=0.5)")
    c.reduce(torch.randn(10), "layer.weight", LocalGroup(1).channel(0), True)
    state = C.state_dict()
    assert "layer.weight" in state["topk(ratio=0.5)"]["memory"]["residuals"]
    C.load_state_dict(state)
    with pytest.raises(ConfigError, match="resolve those specs"):
        C.load_state_dict({"never(resolved=1)": {}})


# --- bit packing -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_bits_roundtrip(bits):
    gen = torch.Generator().manual_seed(bits)
    for n in (0, 1, 7, 8, 9, 1000, 1001):
        codes = torch.randint(0, 2 ** bits, (n,), generator=gen, dtype=torch.uint8)
        packed = packing.pack_bits(codes, bits)
        assert packed.dtype == torch.uint8 and packed.numel() == packing.packed_nbytes(n, bits)
        assert torch.equal(packing.unpack_bits(packed, bits, n).to(torch.uint8), codes)


def test_signs_pack_like_numpy_packbits():
    signs = torch.rand(29, generator=torch.Generator().manual_seed(0)) > 0.5
    assert np.array_equal(packing.pack_bits(signs, 1).numpy(), np.packbits(signs.numpy()))


def test_payload_bytes_roundtrip():
    payload = (torch.arange(5, dtype=torch.int32), torch.zeros(0), torch.tensor([1.5], dtype=torch.float64),
               torch.tensor([1, 2, 3], dtype=torch.uint8), torch.tensor([0.5], dtype=torch.bfloat16))
    back = packing.from_bytes(packing.to_bytes(payload), "cpu")
    assert len(back) == len(payload)
    for a, b in zip(payload, back):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert packing.from_bytes(packing.to_bytes(()), "cpu") == ()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", sorted(C.compressors()))
def test_cuda_matches_cpu_layout(spec):
    x = torch.randn(1000, device="cuda")
    c = C.build(spec)
    payload, ctx = c.compress(x, "w")
    y = c.decompress(payload, ctx)
    assert y.device == x.device and y.shape == x.shape
    for bits in (1, 2, 6):
        codes = torch.randint(0, 2 ** bits, (77,), dtype=torch.uint8)
        assert torch.equal(packing.pack_bits(codes.cuda(), bits).cpu(), packing.pack_bits(codes, bits))


# --- never hang: empty selections, per-rank different and variable sizes ----------------------------------
@pytest.mark.parametrize("algorithm", ["allgather", "omnireduce"])
def test_empty_and_uneven_selections_do_not_hang(algorithm):
    """threshold(tau=1): rank 0 sends nothing, the others send different counts, over several steps."""
    gen = torch.Generator().manual_seed(11)
    inputs = [torch.randn(300, generator=gen) * s for s in (0.1, 0.8, 1.5, 3.0)]
    comps = [C.build("threshold", {"tau": 1.0, "memory": "none"}) for _ in range(4)]
    expected = sum(torch.where(x.abs() > 1.0, x, 0.0) for x in inputs) / 4

    def rank_main(rank, comm):
        return [comps[rank].reduce(inputs[rank], "t", comm, True) for _ in range(3)]

    group = LocalGroup(4, algorithm=algorithm, timeout=10)
    for outs in run_ranks(4, rank_main, group=group, timeout=30):
        for out in outs:
            assert torch.allclose(out, expected, atol=1e-6)
    if algorithm == "allgather":
        sizes = [nbytes for rank, _, _, nbytes in group.log[:4]]
        assert len(set(sizes)) > 1


def test_empty_tensor_skips_communication():
    group = LocalGroup(2, algorithm="allgather", timeout=5)
    comps = [C.build("topk") for _ in range(2)]
    outs = run_ranks(2, lambda r, comm: comps[r].reduce(torch.zeros(0, 3), "e", comm, True), group=group)
    assert all(o.shape == (0, 3) for o in outs) and group.log == []


def test_a_failing_rank_does_not_hang_the_others():
    comps = [C.build("topk") for _ in range(3)]

    def rank_main(rank, comm):
        x = torch.arange(10.0) if rank else torch.arange(10)   # rank 0 passes an integer tensor
        return comps[rank].reduce(x, "w", comm, True)

    with pytest.raises(InvalidTensor):
        run_ranks(3, rank_main, timeout=20)


def test_efsignsgd_scale_follows_its_memory():
    """GRACE's from_params defaults to memory 'none': then nothing was scaled by lr, nothing is divided."""
    x = torch.full((16,), 0.5)
    for params, expected in (({"compressor": "efsignsgd", "lr": 0.1, "memory": "efsignsgd"}, 0.5),
                             ({"compressor": "efsignsgd", "lr": 0.1}, 0.5),
                             ({"compressor": "efsignsgd", "lr": 0.1, "memory": "residual"}, 0.5)):
        out = C.from_params(params).reduce(x, "e", LocalGroup(1).channel(0), True)
        assert torch.allclose(out, torch.full((16,), expected)), params

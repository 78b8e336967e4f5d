"""commlib.dispatch: the one place that turns (policy, caller's arguments, running backends) into a plan."""
import numpy as np
import pytest

from commlib import ConfigError, InvalidTensor, Policy
from commlib.dispatch import TRAFFIC, Dispatcher
from commlib.errors import BackendUnavailable
from commlib.settings import Settings
from commlib.tensors import Staged
from launch import spawn


class FakeBackend:
    def __init__(self, name, dtypes=("float32", "int32"), sparse=False, density=0.5):
        self.name, self.dtypes, self.sparse, self._density = name, tuple(np.dtype(d) for d in dtypes), sparse, density
        self.ops = ("sum",)

    def enabled(self, meta):
        return np.dtype(meta.dtype) in self.dtypes

    def density(self, array):
        return self._density if self.sparse else None   # a dense algorithm measures nothing (Backend.density)


def dispatcher(names=("ring", "switchml", "omnireduce", "allgather"), policy="", unavailable=None, samples=3,
               **backends):
    made = {"ring": FakeBackend("ring", ("float16", "float32", "float64", "int32")),
            "switchml": FakeBackend("switchml"), "omnireduce": FakeBackend("omnireduce", sparse=True, density=0.01),
            "allgather": FakeBackend("allgather")}
    made.update(backends)
    running = {name: made[name] for name in names}
    why = {name: "not started in this test" for name in made if name not in running}
    return Dispatcher(running, dict(why, **(unavailable or {})), Policy.parse(policy),
                      Settings({"auto_sparse_density": 0.25, "auto_trial_samples": samples}, environ={}))


def plan(d, array, name="w", **kwargs):
    return d.plan(name, Staged(array), **kwargs)


BIG = 1 << 14   # float32 values: auto_sparse_min_bytes, the smallest tensor `auto` measures for density


def test_auto_is_density_settled_between_the_sparse_and_the_measured_dense_algorithms():
    p, compressor = plan(dispatcher(), np.zeros(BIG, np.float32))
    assert compressor is None
    assert p.choices == ((0.25, "omnireduce"), (TRAFFIC, "switchml"), (TRAFFIC, "ring")) and p.density == 0.01 \
        and p.algorithm is None and p.side == 0
    p, _ = plan(dispatcher(), np.zeros(BIG - 1, np.float32), name="small")   # its zero blocks save too little
    assert p.choices == ((TRAFFIC, "switchml"), (TRAFFIC, "ring")) and p.density is None, p
    p, _ = plan(dispatcher(("ring", "switchml")), np.zeros(8, np.float32))
    assert p.choices == ((TRAFFIC, "switchml"), (TRAFFIC, "ring")) and p.density is None and p.side is None


def test_auto_with_one_dense_algorithm_or_no_trials_is_decided_locally():
    p, _ = plan(dispatcher(), np.zeros(8, np.float64))    # only the ring takes float64
    assert p.algorithm == "ring"
    p, _ = plan(dispatcher(("ring", "switchml"), samples=0), np.zeros(8, np.float32))
    assert p.choices == ((None, "switchml"),) and p.algorithm == "switchml" and p.density is None


def test_caller_and_policy_choices():
    d = dispatcher(policy="emb.*=omnireduce;big.*[min=1KiB]=ring:fp16;*[density<0.1]=omnireduce;*=ring")
    assert plan(d, np.zeros(8, np.float32), "emb.users")[0].algorithm == "omnireduce"
    p, fp16 = plan(d, np.zeros(1024, np.float32), "big.w")
    assert p.algorithm == "ring" and p.compression == repr(fp16) and fp16.name == "fp16"
    p, _ = plan(d, np.zeros(8, np.float32), "fc.w")
    assert p.choices == ((0.1, "omnireduce"), (None, "ring")) and p.density == 0.01
    assert plan(d, np.zeros(8, np.float32), "emb.users", algorithm="switchml")[0].algorithm == "switchml"
    other = Policy.parse("*=switchml")
    assert plan(d, np.zeros(8, np.float32), "emb.users", policy=other)[0].algorithm == "switchml"


def test_a_density_rule_among_dense_algorithms_is_measured_by_the_sparse_one_running():
    p, _ = plan(dispatcher(policy="*[density<0.1]=ring;*=switchml"), np.zeros(8, np.float32))
    assert p.choices == ((0.1, "ring"), (None, "switchml")) and p.density == 0.01 and p.side == 0, p
    with pytest.raises(ConfigError, match="needs the block density a sparse algorithm"):
        plan(dispatcher(("ring", "switchml"), policy="*[density<0.1]=ring;*=switchml"), np.zeros(8, np.float32))


def test_compressors_ride_the_first_running_carrier_of_their_payload():
    d = dispatcher()
    assert plan(d, np.zeros(8, np.float32), compression="topk(ratio=0.5)")[0].algorithm == "omnireduce"
    assert plan(dispatcher(("ring", "allgather")), np.zeros(8, np.float32),
                compression="topk(ratio=0.5)")[0].algorithm == "allgather"
    assert plan(d, np.zeros(8, np.float32), compression="powersgd(rank=1)")[0].algorithm == "ring"
    assert plan(d, np.zeros(8, np.float32), compression="signsgd")[0].algorithm == "allgather"
    assert plan(d, np.zeros(8, np.float32), compression="topk", algorithm="allgather")[0].algorithm == "allgather"


@pytest.mark.parametrize("kwargs, error, text", [
    ({"algorithm": "bogus"}, ConfigError, "unknown algorithm 'bogus'"),
    ({"algorithm": "allgather"}, ConfigError, "carries compressed or sparse payloads"),
    ({"compression": "topk", "algorithm": "ring"}, ConfigError, "sparse payload, which algorithm 'ring' cannot carry"),
    ({"compression": "signsgd", "algorithm": "omnireduce"}, ConfigError, "use one of \\['allgather'\\]"),
])
def test_impossible_requests_say_what_would_work(kwargs, error, text):
    with pytest.raises(error, match=text):
        plan(dispatcher(), np.zeros(8, np.float32), **kwargs)


def test_unavailable_and_unsupported():
    d = dispatcher(("ring",), unavailable={"switchml": "the switch did not start"})
    with pytest.raises(BackendUnavailable, match="'switchml' is not available: the switch did not start"):
        plan(d, np.zeros(8, np.float32), algorithm="switchml")
    with pytest.raises(BackendUnavailable, match="needs one of \\['allgather'\\]"):
        plan(d, np.zeros(8, np.float32), compression="signsgd")
    with pytest.raises(InvalidTensor, match="does not take float64"):
        plan(dispatcher(), np.zeros(8, np.float64), algorithm="switchml")
    with pytest.raises(InvalidTensor, match="no algorithm here reduces uint8"):
        plan(dispatcher(), np.zeros(8, np.uint8))


def test_min_max_product_go_where_that_reduction_is_done():
    d = dispatcher(policy="*=switchml", ring=dict_backend_with_ops())
    p, _ = plan(d, np.zeros(8, np.float32), op="max")
    assert p.algorithm == "ring" and "the policy's switchml cannot reduce with op=max; ring did" == p.note
    assert plan(d, np.zeros(8, np.float32), op="sum")[0].algorithm == "switchml"
    with pytest.raises(ConfigError, match="algorithm 'switchml' cannot reduce with op=min"):
        plan(d, np.zeros(8, np.float32), op="min", algorithm="switchml")
    with pytest.raises(ConfigError, match="compression 'fp16' cannot reduce with op=product"):
        plan(d, np.zeros(8, np.float32), op="product", compression="fp16")
    with pytest.raises(InvalidTensor, match="no algorithm here reduces float32 with op=min"):
        plan(dispatcher(("switchml",)), np.zeros(8, np.float32), op="min")


def dict_backend_with_ops():
    ring = FakeBackend("ring", ("float16", "float32", "float64", "int32"))
    ring.ops = ("sum", "min", "max", "product")
    return ring


def test_a_plan_no_measurement_decides_is_remembered_per_tensor_and_the_rest_is_not(monkeypatch):
    d = dispatcher(("ring", "switchml"))
    first, _ = plan(d, np.zeros(8, np.float32))
    again, _ = plan(d, np.ones(8, np.float32))
    assert again is first                                          # the same tensor: a lookup
    assert plan(d, np.zeros(9, np.float32))[0] is not first        # another shape: planned anew
    assert plan(d, np.zeros(8, np.float32), algorithm="ring")[0].algorithm == "ring"
    measured = dispatcher()                                        # auto with omnireduce: density decides
    assert plan(measured, np.zeros(BIG, np.float32))[0] is not plan(measured, np.zeros(BIG, np.float32))[0]
    kept = len(d._plans)
    plan(d, np.zeros(8, np.float32), name="once", remember=False)  # an unnamed call: its name never comes again
    assert len(d._plans) == kept
    monkeypatch.setattr("commlib.dispatch.PLANS_KEPT", 3)
    for i in range(10):                                            # a program that makes up names: kept bounded
        plan(d, np.zeros(8, np.float32), name=f"made.up.{i}")
    assert 0 < len(d._plans) <= 3, d._plans


@pytest.mark.multiprocess
def test_a_backend_registered_from_outside_the_package_is_routed_to():
    """One module with @register (tests/workers/toy_backend.py) and nothing else: auto, a policy
    rule and a summable compressor's payload reach it; a dtype it does not take goes elsewhere."""
    for result in spawn(2, "toy_backend.py", timeout=120).check().results():
        tensors = result["tensors"]
        assert {name: t["algorithm"] for name, t in tensors.items()} == \
            {"auto.dense": "toy", "named.dense": "toy", "auto.fp16": "toy", "auto.int64": "ring"}, tensors
        assert all(t["exact"] for t in tensors.values()), tensors
        assert result["toy_calls"] == 3, result

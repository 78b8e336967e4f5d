"""The public API in one process (size 1, no launcher): types, errors, records, timeline."""
import gc
import json
import os
import subprocess
import sys
import weakref

import numpy as np
import pytest
import torch

import commlib
from helpers import single_process


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    single_process(monkeypatch)
    timeline = tmp_path / "trace.json"
    commlib.init(policy="*=ring", timeout_s=5.0, timeline=str(timeline))
    yield timeline
    commlib.shutdown()


def test_not_initialized_says_what_to_do():
    with pytest.raises(commlib.CommError, match="commlib.init"):
        commlib.allreduce(np.ones(2))


def test_environment_overrides_the_policy_keyword(monkeypatch, caplog):
    single_process(monkeypatch)
    monkeypatch.setenv("COMMLIB_POLICY", "*=ring")
    commlib.init(policy="*=omnireduce", timeout_s=5.0)
    try:
        commlib.allreduce(np.ones(3, np.float32), name="x")
        assert commlib.records()["x"]["algorithm"] == "ring"
        with caplog.at_level("WARNING", logger="commlib"):
            commlib.init(policy="*=omnireduce", timeout_s=5.0)   # the same arguments: nothing to say
            assert "called again" not in caplog.text
            commlib.init(policy="*=switchml")
        assert "called again with other arguments" in caplog.text
    finally:
        commlib.shutdown()


def test_density_rule_dispatches_by_measured_density(monkeypatch):
    single_process(monkeypatch)
    commlib.init(policy="grad.*[density<0.05]=omnireduce; *=ring", timeout_s=5.0)
    try:
        sparse = np.zeros(256 * 100, np.float32)
        sparse[:256] = 1.0                               # one block of 100 non-zero
        dense = np.ones(256 * 100, np.float32)
        for name, x in (("grad.sparse", sparse), ("grad.dense", dense), ("other", sparse)):
            np.testing.assert_array_equal(commlib.allreduce(x, name=name), x)
        records = commlib.records()
        assert [records[n]["algorithm"] for n in ("grad.sparse", "grad.dense", "other")] == \
            ["omnireduce", "ring", "ring"], records
        assert records["grad.sparse"]["density"] == pytest.approx(0.01)
        commlib.allreduce(sparse, name="explicit", algorithm="omnireduce")   # measured by the backend itself
        assert commlib.records()["explicit"]["density"] == pytest.approx(0.01)
    finally:
        commlib.shutdown()


def test_types_dtypes_shapes_round_trip(runtime):
    assert commlib.size() == 1 and commlib.rank() == 0
    x = np.arange(12, dtype=np.float64).reshape(3, 4)
    out = commlib.allreduce(x, name="np")
    assert isinstance(out, np.ndarray) and out.dtype == np.float64 and out.shape == (3, 4)
    np.testing.assert_array_equal(out, x)
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    out = commlib.allreduce(t, name="bf16")
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3) and torch.equal(out, t)
    assert torch.equal(commlib.allreduce(torch.tensor(3.0), name="scalar"), torch.tensor(3.0))
    sparse = torch.sparse_coo_tensor([[0, 3]], [1.0, 2.0], (5,))
    summed = commlib.allreduce(sparse, name="sparse", op=commlib.Sum)   # sparse in, sparse out
    assert summed.is_sparse and summed.is_coalesced() and torch.equal(summed.to_dense(), sparse.to_dense())


def test_a_sparse_gradient_is_never_densified_on_its_way(runtime, monkeypatch):
    """An embedding's gradient of 400,000 rows densified at every step made sparse training 3x
    slower (bench_training's sparse workload) with the same results."""
    densified = []
    to_dense = torch.Tensor.to_dense
    monkeypatch.setattr(torch.Tensor, "to_dense", lambda self, *a, **k: densified.append(self.shape) or to_dense(self, *a, **k))
    grad = torch.sparse_coo_tensor([[1, 7]], torch.ones(2, 4), (400_000, 4))
    summed = commlib.allreduce(grad, name="embedding.weight", op=commlib.Sum)
    assert summed.is_sparse and summed._nnz() == 2
    assert densified == [], f"densified on its way: {densified}"


def test_scale_factors(runtime):
    out = commlib.allreduce(np.ones(4, np.float32), name="s", op=commlib.Sum, prescale_factor=0.5, postscale_factor=6)
    np.testing.assert_allclose(out, 3.0)


def test_allreduce_is_differentiable_as_horovods(runtime):
    x = torch.arange(4.0, requires_grad=True)
    y = commlib.allreduce(x * 2, name="d", op=commlib.Sum, postscale_factor=3.0)
    y.sum().backward()                      # backward: the allreduce of ones, with the same scaling
    assert torch.equal(y.detach(), torch.arange(4.0) * 6) and torch.equal(x.grad, torch.full((4,), 6.0))
    assert "d.grad" in commlib.records()
    with torch.no_grad():
        assert commlib.allreduce(x, name="n").grad_fn is None


def test_float16_is_scaled_in_float32_as_horovod_does(runtime):
    x = np.linspace(0.1, 60, 2000).astype(np.float16)
    out = commlib.allreduce(x, name="h", op=commlib.Sum, prescale_factor=1 / 3, postscale_factor=1.1)
    expected = ((x.astype(np.float32) * (1 / 3)).astype(np.float16).astype(np.float32) * 1.1).astype(np.float16)
    np.testing.assert_array_equal(out, expected)   # in float16 arithmetic ~1/3 of them are one step off


def test_async_handles_and_records(runtime):
    handles = [commlib.allreduce_async(np.full(3, i, np.int32), name=f"t{i}", op=commlib.Sum) for i in range(5)]
    assert [commlib.synchronize(h)[0] for h in handles] == list(range(5))
    assert all(commlib.poll(h) for h in handles)
    record = commlib.records()["t3"]
    assert record["algorithm"] == "ring" and record["nbytes"] == 12 and record["run_s"] >= 0


def test_timeline_is_a_chrome_trace(runtime):
    commlib.allreduce(np.ones(3, np.float32), name="traced")
    commlib.shutdown()
    events = json.loads(runtime.read_text())
    row = next(e["tid"] for e in events if e["name"] == "thread_name" and e["args"]["name"] == "traced")
    assert {e["name"] for e in events if e["ph"] == "X" and e["tid"] == row} == {"NEGOTIATE", "QUEUE", "RING", "RESTORE"}


@pytest.mark.parametrize("kwargs, error, text", [
    ({"algorithm": "bogus"}, commlib.ConfigError, "unknown algorithm 'bogus'"),
    ({"op": "median"}, commlib.ConfigError, "use commlib.Sum, Average, Min, Max or Product"),
    ({"op": 2}, commlib.ConfigError, "Adasum is Horovod's own algorithm"),
    ({"algorithm": "allgather"}, commlib.ConfigError, "carries compressed or sparse payloads"),
])
def test_bad_arguments_are_clear_errors(runtime, kwargs, error, text):
    with pytest.raises(error, match=text):
        commlib.allreduce(np.ones(3, np.float32), name="bad", **kwargs)


def test_compression_needs_a_stable_name(runtime):
    with pytest.raises(commlib.ConfigError, match="name= that is the same at every step"):
        commlib.allreduce(np.ones(3, np.float32), compression="topk")


def test_average_of_integers_and_unsupported_types(runtime):
    out = commlib.allreduce(np.array([3, -3], np.int32), name="ints")   # as Horovod's (truncated: basic.py)
    assert out.dtype == np.int32 and out.tolist() == [3, -3], out
    with pytest.raises(commlib.InvalidTensor, match="numpy arrays and torch tensors"):
        commlib.allreduce([1.0, 2.0], name="list")
    with pytest.raises(commlib.InvalidTensor, match="cannot be reduced"):
        commlib.allreduce(np.array(["a"]), name="strings")


def test_unknown_setting(monkeypatch):
    with pytest.raises(commlib.ConfigError, match="unknown setting"):
        commlib.init(fusion_treshold=1)


def test_horovod_alone_under_torchrun_is_an_error_that_says_what_to_do():
    """hvd.init() under torchrun starts a Horovod of one rank per process (Horovod knows only its own
    launchers): commlib must not take that for the job, or every process trains alone as rank 0."""
    code = "import horovod.torch as hvd, commlib; hvd.init(); commlib.init()"
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "ConfigError" in out.stderr and "torchrun started 2" in out.stderr and "horovodrun" in out.stderr, out.stderr


def test_placement_comes_from_the_process_group_and_disagreement_is_an_error(tmp_path):
    """Lightning starts its processes with WORLD_SIZE but no RANK: without a process group that is
    an error (no job of one rank), with one its world is the job's, and a launcher that says
    otherwise is an error too."""
    code = f"""if True:
        import torch.distributed as dist
        from commlib.context import detect
        def refused(environ):
            try:
                detect(environ)
            except Exception as exc:
                return f"{{type(exc).__name__}}: {{exc}}"
        print("no group:", refused({{"WORLD_SIZE": "2", "LOCAL_RANK": "1"}}))
        dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=0, world_size=1)
        print("group:", detect({{"WORLD_SIZE": "2", "LOCAL_RANK": "1"}}).launcher)
        print("launcher:", refused({{"RANK": "1", "WORLD_SIZE": "2"}}))
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines())
    assert lines["no group"].startswith("ConfigError: WORLD_SIZE=2 but no RANK"), lines["no group"]
    assert lines["group"] == "torch.distributed", lines["group"]
    assert lines["launcher"].startswith("ConfigError: torch.distributed says this process is rank 0 of 1, but the "
                                        "launcher (torchrun) says rank 1 of 2"), lines["launcher"]


def test_grouped_allreduce_is_released_and_fused_together(runtime):
    tensors = [np.full(3, i, np.float32) for i in range(6)]
    outs = commlib.grouped_allreduce(tensors, [f"g{i}" for i in range(6)], op=commlib.Sum)
    assert [o.tolist() for o in outs] == [t.tolist() for t in tensors]
    assert {commlib.records()[f"g{i}"]["fused_with"] for i in range(6)} == {5}   # one collective
    with pytest.raises(commlib.ConfigError, match="2 tensors but 1 names"):
        commlib.grouped_allreduce(tensors[:2], ["only"])


def test_a_result_waited_for_inside_inference_mode_or_a_fake_mode_is_a_plain_tensor(runtime):
    """The result is made on the thread that waits (Handle.set): not inside that thread's modes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    handle = commlib.allreduce_async(torch.arange(4.0), name="inference", op=commlib.Sum)
    with torch.inference_mode():
        out = commlib.synchronize(handle)
    assert not out.is_inference(), "an inference tensor: in-place updates outside inference_mode would fail"
    out.add_(1)
    handle = commlib.allreduce_async(torch.arange(4.0), name="fake", op=commlib.Sum)
    with FakeTensorMode():
        inside = commlib.synchronize(handle)
    assert type(inside) is torch.Tensor and commlib.synchronize(handle).tolist() == [0.0, 1.0, 2.0, 3.0], inside


def test_a_grouped_call_fuses_in_its_order_a_new_order_is_negotiated_anew(runtime):
    """A DDP bucket's parameters are views of one buffer; DDP reorders them after its first step.
    In the call's order they fuse in place (no copy) and come back as slices of one result."""
    def views(order):
        flat = np.arange(12, dtype=np.float32)
        return flat, [flat[3 * i:3 * i + 3] for i in range(4)], [f"v{i}" for i in order]

    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [3, 2, 1, 0]):
        flat, parts, names = views(order)
        handles = commlib.grouped_allreduce_async(parts, names, op=commlib.Sum)
        raw = [h.wait(restored=False) for h in handles]
        assert [r.tolist() for r in raw] == [p.tolist() for p in parts], (order, raw)
        assert all(raw[i + 1].ctypes.data == raw[i].ctypes.data + 12 for i in range(3)), \
            f"{order}: the results are not back to back in the call's order"
        assert commlib.records()[names[0]]["bucket"] == f"{names[0]}+3", commlib.records()[names[0]]


def test_the_ring_reduces_a_fused_bucket_where_it_lies_and_never_writes_a_callers_tensor(runtime, monkeypatch):
    """A bucket commlib fused (or prescaled) is its own: the ring's engine reduces it without a copy
    first. A tensor reduced where it lies in the caller's memory (a large one, viewed) is copied, and
    scaling its result leaves the caller's values as they were."""
    engine, scratches = commlib.api.runtime().ctx.engine, []
    allreduce = engine.allreduce
    def spied(array, name, op="sum", scratch=False):
        scratches.append(scratch)
        return allreduce(array, name, op, scratch)
    monkeypatch.setattr(engine, "allreduce", spied)
    small = [torch.full((4,), float(i)) for i in range(3)]
    outs = commlib.grouped_allreduce(small, names=[f"small.{i}" for i in range(3)], postscale_factor=2.0)
    assert [o.tolist() for o in outs] == [[2.0 * i] * 4 for i in range(3)] and \
        [t.tolist() for t in small] == [[float(i)] * 4 for i in range(3)]
    large = torch.arange(float(1 << 15))   # 128 KiB: viewed, not copied, at submission
    for kwargs in ({"postscale_factor": 2.0}, {"prescale_factor": 3.0}):
        out = commlib.allreduce(large, name="large", **kwargs)
        assert torch.equal(out, large * kwargs.get("postscale_factor", 1.0) * kwargs.get("prescale_factor", 1.0))
        assert torch.equal(large, torch.arange(float(1 << 15))), "the caller's tensor was written"
    assert scratches == [True, False, True], scratches   # fused; the caller's memory; prescaled, so commlib's


@pytest.mark.parametrize("reduce", [commlib.allreduce, lambda *args, **kwargs: commlib.synchronize(
    commlib.allreduce_async(*args, **kwargs))], ids=["allreduce", "allreduce_async"])
def test_a_name_submitted_again_in_another_form_is_planned_and_read_anew(runtime, monkeypatch, reduce):
    """A call that repeats a name's last one reuses its plan and metadata (runtime.Repeat), and reads the
    new tensor as it is (layout, negative bit); a change of type, dtype, shape, scaling or autograd
    goes the whole way again (allreduce_async's repeats take a path of their own: Runtime.again)."""
    from commlib.runtime import Repeat, Runtime
    repeated, again = [], Repeat.again
    def counted(*args):
        staged = again(*args)
        repeated.append(staged is not None)
        return staged
    monkeypatch.setattr(Repeat, "again", counted)
    fast, runtime_again = [], Runtime.again
    monkeypatch.setattr(Runtime, "again", lambda *args: fast.append(runtime_again(*args)) or fast[-1])
    base = torch.arange(6.0)
    complex_view = torch.complex(torch.zeros(6), torch.arange(6.0)).conj().imag   # -arange: negative bit
    forms = [(base, {}), (base + 1, {}), (complex_view, {}), (base.double(), {}), (base.reshape(2, 3), {}),
             (base.reshape(3, 2).t(), {}), (base.numpy(), {}), (base.numpy().astype(np.int32), {}), (base + 2, {}),
             (base + 2, {"postscale_factor": 2.0}), (base, {"op": commlib.Sum})]
    for tensor, kwargs in forms * 2:   # and each again, now that another form came last
        out = reduce(tensor, name="again", **kwargs)
        expected = tensor.resolve_neg() * kwargs.get("postscale_factor", 1.0) if torch.is_tensor(tensor) else tensor
        assert type(out) is type(tensor) and out.dtype == tensor.dtype and out.shape == tensor.shape, (tensor, out)
        assert out.tolist() == expected.tolist(), (tensor, kwargs, out)
        assert commlib.records()["again"]["dtype"] == str(tensor.dtype).replace("torch.", "")
    assert sum(repeated) == 6, repeated   # base+1, the negative view, the transpose: twice
    assert sum(h is not None for h in fast) == (0 if reduce is commlib.allreduce else 6), fast
    for op in (1, 1):   # Horovod's Sum, repeated; a bool is not an op, however the last call went
        reduce(base, name="op", op=op)
    with pytest.raises(commlib.ConfigError, match="op=True"):
        reduce(base, name="op", op=True)
    large = torch.ones(1 << 16)   # (viewed, not copied)
    for _ in range(2):
        reduce(large, name="kept")
    gone = weakref.ref(large)
    del large
    gc.collect()
    assert gone() is None, "commlib keeps a tensor it reduced alive"
    x = torch.arange(3.0, requires_grad=True)
    reduce(x.detach(), name="again", op=commlib.Sum)
    y = reduce(x * 2, name="again", op=commlib.Sum)
    y.sum().backward()   # the repeat of a plain tensor's call is differentiable where the tensor asks
    assert y.grad_fn is not None and x.grad.tolist() == [2.0, 2.0, 2.0]


def test_an_algorithm_failing_inside_a_collective_is_a_collective_failure_elastic_recovers_from(runtime):
    """Gloo's timeout on a peer gone mid-step came out as a plain CommError, which hvd.elastic.run does not
    catch: the job ended where Horovod's own would have reset. It is a CollectiveFailure, Horovod's
    HorovodInternalError, its cause chained."""
    from commlib.api import runtime as current
    from horovod.common.exceptions import HorovodInternalError

    def gone(array, name):
        raise RuntimeError("gloo: Timed out waiting 60000ms for send operation to complete")
    current().backends["ring"].allreduce = gone
    with pytest.raises(commlib.CollectiveFailure, match="ring failed on tensor 'x'.*Timed out") as failed:
        commlib.allreduce(np.ones(4, np.float32), name="x")
    assert isinstance(failed.value, HorovodInternalError) and isinstance(failed.value.__cause__, RuntimeError)

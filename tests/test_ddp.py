"""commlib's DDP comm hook (commlib.torch.ddp_comm_hook) in spawned torchrun-style jobs, real
torchrun and Lightning. Ranks write their results as JSON; the assertions are here."""
import ast
import json
import re
import sys

import pytest

import torch

import commlib
from commlib.torch.ddp import CommlibState, _stand_for, _views
from helpers import check_grads, ddp_results, exact, single_process, switchml_bound
from launch import BIN, ROOT, WORKERS, _env, _run, free_port, spawn

pytestmark = pytest.mark.timeout(400)
multiprocess = pytest.mark.multiprocess


def ranks(nprocs, script, tmp_path, *args, timeout=240, env=None):
    """Run tests/workers/<script> on `nprocs` spawned ranks; each rank's JSON result, by rank."""
    spawn(nprocs, script, tmp_path, *args, timeout=timeout, env=env).check()
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nprocs)]


# The scenarios of tests/workers/ddp_grads.py by world size, name: (policy, options). Those of a size
# run one after another in one job, started by the first test that asks for one of them: a job's start
# costs far more than a scenario. Each test then checks its own scenario's result.
SCENARIOS = {
    2: {"ring": ("*=ring", ""), "switchml": ("*=switchml", "float"), "omnireduce": ("*=omnireduce", ""),
        "policy": ("body.*=omnireduce;*.bias=ring;*=switchml", ""), "unused": ("*=ring", "unused,accumulate"),
        "fp16": ("*=ring", "fp16"), "bfloat16": ("*=ring", "bfloat16"), "bf16": ("*=ring", "bf16"),
        "sparse": ("embedding.*=sparse_allgather;*=ring", "sparse"), "gan": ("*=ring", "gan"),
        "ring_per_parameter": ("*=ring", "per_parameter"), "static_view": ("*=ring", "static,view"),
        "measured": ("*[density<0.01]=omnireduce;*=ring", ""), "group": ("*=ring", "group")},
    4: {"ring": ("*=ring", ""), "switchml": ("*=switchml", "float")}}


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    """scenario(nprocs, name): each rank's result of that ddp_grads.py scenario."""
    jobs = {}   # nprocs: the job's folder, or why it failed (raised again, not run again, for each test)

    def results(nprocs, name):
        if nprocs not in jobs:
            out = tmp_path_factory.mktemp(f"ddp_grads_{nprocs}")
            try:
                spawn(nprocs, "ddp_grads.py", out, json.dumps(SCENARIOS[nprocs]), timeout=300).check()
                jobs[nprocs] = out
            except AssertionError as exc:
                jobs[nprocs] = exc
        if isinstance(jobs[nprocs], AssertionError):
            raise jobs[nprocs]
        return ddp_results(jobs[nprocs], name, nprocs)
    return results


def torchrun(nprocs, path, *args, timeout=300):
    """The real `torchrun --nproc-per-node N` on a script under the repository."""
    cmd = [str(BIN / "torchrun"), "--nproc-per-node", str(nprocs), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(ROOT / path), *map(str, args)]
    return _run(cmd, timeout, _env(None))


@multiprocess
@pytest.mark.parametrize("nprocs", [2, pytest.param(4, marks=pytest.mark.long)])
def test_ring_equals_ddp_default_exactly(scenario, nprocs):
    results = scenario(nprocs, "ring")
    check_grads(results, exact)
    assert {tuple(v) for v in results[0]["records"].values()} == {("ring", None)}
    # the first step per parameter; the rebuilt bucket (one rule for all four) whole from the second
    assert results[0]["record_names"] == ["bucket(head.bias+3)"], results[0]["record_names"]
    assert set(results[0]["records"]) == set(results[0]["names"]) | {"bucket(head.bias+3)"}
    # and each parameter's record is its whole bucket's, as current as when they travelled one by one
    assert {results[0]["buckets"][n] for n in results[0]["names"]} == {"bucket(head.bias+3)"}, results[0]["buckets"]


@multiprocess
def test_static_graph_and_gradients_as_bucket_views(scenario):
    """DDP(static_graph=True, gradient_as_bucket_view=True): the gradients are the bucket's memory,
    which the whole bucket's reduction reads and DDP writes the result back into."""
    results = scenario(2, "static_view")
    # static_graph's first step runs DDP's delayed allreduce, whose buckets all say is_last() False
    check_grads(results, exact, uncounted=1)
    assert results[0]["record_names"] == ["bucket(head.bias+3)"], results[0]["record_names"]


@multiprocess
def test_parameters_planned_by_density_travel_whole_once_their_runs_settled_the_ring(scenario):
    """A density rule measures every parameter: DDP's first step per parameter, then whole with the ring
    their runs settled (the same on every rank), exact."""
    results = scenario(2, "measured")
    check_grads(results, exact)
    assert {tuple(v) for v in results[0]["records"].values()} == {("ring", None)}
    assert results[0]["record_names"] == ["bucket(head.bias+3)"], results[0]["record_names"]
    assert {results[0]["buckets"][n] for n in results[0]["names"]} == {"bucket(head.bias+3)"}, results[0]["buckets"]


@multiprocess
def test_a_state_given_ddps_process_group_averages_over_that_group_only(scenario):
    """DDP(process_group=a group of this rank alone) and CommlibState(process_group=the same): each
    rank keeps its own gradients, exactly as DDP's own allreduce over that group leaves them."""
    results = scenario(2, "group")
    for r in results:
        assert "error" not in r, r["error"]
        assert all(s["max_diff"] == 0.0 for s in r["steps"]), (r["rank"], r["steps"])
    assert results[0]["grads"] != results[1]["grads"], "the ranks' gradients were averaged together"


@multiprocess
def test_whole_buckets_off_reduces_per_parameter_at_every_step(scenario):
    results = scenario(2, "ring_per_parameter")
    check_grads(results, exact)
    assert set(results[0]["records"]) == {"body.weight", "body.bias", "head.weight", "head.bias"}
    assert sorted(results[0]["record_names"]) == sorted(results[0]["records"])
    assert not any(bucket.startswith("bucket(") for bucket in results[0]["buckets"].values()), results[0]["buckets"]


@multiprocess
@pytest.mark.parametrize("algorithm, tolerance, nprocs", [
    ("switchml", switchml_bound, 2), pytest.param("switchml", switchml_bound, 4, marks=pytest.mark.long),
    ("omnireduce", exact, 2)])
def test_in_network_algorithms_within_their_bound(scenario, algorithm, tolerance, nprocs):
    """switchml within its quantization bound on normal draws (on the dyadic fixture it is exact);
    omnireduce adds float32 like the ring, so on the dyadic fixture it must match exactly."""
    results = scenario(nprocs, algorithm)
    check_grads(results, tolerance)
    assert {tuple(v) for v in results[0]["records"].values()} == {(algorithm, None)}


@multiprocess
def test_policy_sees_parameter_names_per_bucket(scenario):
    results = scenario(2, "policy")
    check_grads(results, switchml_bound)
    assert results[0]["records"] == {"body.weight": ["omnireduce", None], "body.bias": ["omnireduce", None],
                                     "head.weight": ["switchml", None], "head.bias": ["ring", None]}


@multiprocess
def test_unused_parameters_and_no_sync_accumulation(scenario):
    results = scenario(2, "unused")
    check_grads(results, exact)
    assert "side.weight" in results[0]["records"]


@multiprocess
def test_composes_with_pytorch_fp16_compress_wrapper(scenario):
    """fp16_compress_wrapper(ddp_comm_hook) vs fp16_compress_wrapper(allreduce_hook): both sum
    float16 values, in other orders, so they differ by float16 rounding (2^-11 relative) per add."""
    results = scenario(2, "fp16")
    check_grads(results, lambda n, largest: largest * n * 2.0 ** -11)
    assert {tuple(v) for v in results[0]["records"].values()} == {("ring", None)}


@multiprocess
@pytest.mark.parametrize("option, bits", [("bfloat16", 8), ("bf16", 8), ("sparse", None)])
def test_bfloat16_and_sparse_gradients_as_ddp_reduces_them(scenario, option, bits):
    """A bfloat16 model, the hook inside bf16_compress_wrapper (bfloat16 adds round to 8 bits, in
    other orders than gloo's), and EmbeddingBag(sparse=True) through commlib's row-sparse path
    (exact: each sparse gradient is its own bucket, as DDP makes it)."""
    results = scenario(2, option)
    check_grads(results, exact if bits is None else lambda n, largest: largest * n * 2.0 ** -bits)
    expected = {"embedding.weight": ["sparse_allgather", None]} if option == "sparse" else {}
    assert {n: a for n, a in results[0]["records"].items() if a != ["ring", None]} == expected, results[0]["records"]


@multiprocess
def test_two_models_with_the_same_parameter_names_in_one_backward(scenario):
    """A GAN's generator and discriminator: each state has its own names (the second's prefixed)."""
    results = scenario(2, "gan")
    check_grads(results, exact)
    assert set(results[0]["records"]) == set(results[0]["names"]) | set(results[0]["record_names"])
    assert "body.weight" in results[0]["names"] and "ddp1.body.weight" in results[0]["names"], results[0]["names"]
    assert results[0]["record_names"] == ["bucket(head.bias+3)", "bucket(ddp1.head.bias+3)"], results[0]["record_names"]


@multiprocess
def test_mismatched_shape_in_a_bucket_is_a_clear_error_on_every_rank(tmp_path):
    results = ranks(4, "ddp_mismatch.py", tmp_path, timeout=240)
    for r in results:
        assert r["error"] is not None, f"rank {r['rank']}: backward did not fail"
        message = r["error"]["message"]
        assert "Mismatch" in message and "'head.weight'" in message and "shape" in message, message
        assert "rank 3 gave [5, 16]" in message, message
        assert r["records"] == ["body.bias", "body.weight"], "the bucket's other tensors still reduce"


@multiprocess
@pytest.mark.long   # a fault case: the failing rank exits
@pytest.mark.parametrize("nprocs, failing", [(3, 1), (2, 0)])
def test_a_rank_that_fails_and_exits_gives_the_others_its_error_at_once(tmp_path, nprocs, failing):
    """Its atexit shutdown tells the controller why it leaves: the others, waiting in backward for
    its bucket, get its error (rank and message) within seconds, not a timeout naming a healthy rank."""
    procs = spawn(nprocs, "failing_rank.py", tmp_path, failing, timeout=300)
    assert procs[failing].returncode != 0, procs.output
    for rank in set(range(nprocs)) - {failing}:
        assert procs[rank].returncode == 0, procs.output
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["step"] == 2, r
        assert f"rank {failing} failed and left the job" in r["error"], r["error"]
        assert f"rank {failing}'s own failure in its hook" in r["error"], r["error"]
        assert r["seconds"] < 15, f"rank {rank} waited {r['seconds']:.1f}s for the failed rank's error"


@multiprocess
@pytest.mark.long   # a variant: test_controller checks names that never pair up in a second
def test_parameter_names_that_differ_between_ranks_are_a_mismatch_at_once(tmp_path):
    """The last rank calls its layer `tail`, the others `head` (same shapes): once every rank waits
    for names the others never submit, every rank gets a Mismatch naming the tensors and ranks,
    long before the negotiation timeout (600 s)."""
    results = ranks(3, "ddp_mismatch.py", tmp_path, "names", timeout=240)
    for r in results:
        assert r["error"] is not None, f"rank {r['rank']}: backward did not fail"
        message = r["error"]["message"]
        assert "Mismatch" in message and "do not pair up" in message, message
        assert "ranks 0,1 submitted 'head.bias', 'head.weight' (not rank 2)" in message, message
        assert "rank 2 submitted 'tail.bias', 'tail.weight' (not ranks 0,1)" in message, message
        assert r["seconds"] < 30, f"rank {r['rank']} waited {r['seconds']:.1f}s for the mismatch"


@pytest.mark.long
@multiprocess
def test_commlib_powersgd_reaches_pytorch_powersgd_loss(tmp_path):
    """Same matrix rank, seed, start step and error feedback: the mean loss of the last 10 of 40
    steps within 5% of PyTorch's powerSGD_hook's, and both train."""
    results = ranks(2, "ddp_powersgd.py", tmp_path, 2, 40, timeout=300)
    r = results[0]
    ours, theirs = sum(r["commlib"][-10:]) / 10, sum(r["pytorch"][-10:]) / 10
    assert abs(ours - theirs) <= 0.05 * theirs, f"commlib powersgd {ours:.4f} vs PyTorch's {theirs:.4f}"
    assert ours < 0.7 * r["commlib"][0], r["commlib"]
    assert {alg for alg, _, _ in r["records"].values()} == {"ring"}
    assert all(spec.startswith("powersgd(rank=2") for _, spec, _ in r["records"].values())
    assert max(fused for _, _, fused in r["records"].values()) > 0, "a bucket's tensors were not reduced together"


@multiprocess
@pytest.mark.parametrize("policy, used", [
    # auto keeps the one measured faster, per trial group (the 64 KiB weight is a group of its own)
    (None, [{("ring", None)}, {("switchml", None)}, {("ring", None), ("switchml", None)}]),
    pytest.param("*.weight=fp16;*=ring", [{("ring", "fp16(seed=0, algorithm=None, memory=none)"), ("ring", None)}],
                 marks=pytest.mark.long)])
def test_torchrun_example_trains_through_commlib(policy, used):
    """examples/ddp_torchrun.py under the real torchrun: no configuration, dense gradients go to
    the embedded switch or the ring (`auto`, whichever it measured faster), every step's bucket
    through commlib, the loss falls; with a compressor in the policy too."""
    args = ["--steps", "40"] + (["--policy", policy] if policy else [])
    out = torchrun(2, "examples/ddp_torchrun.py", *args, timeout=300)
    assert out.returncode == 0, out.stdout
    losses = [float(v) for v in re.findall(r"step \d+: loss ([\d.]+)", out.stdout)]
    assert len(losses) == 5 and losses[-1] < 0.5 * losses[0], out.stdout
    found = re.search(r"40 steps, 40 buckets through commlib: (\[.*\])", out.stdout)
    assert found and set(ast.literal_eval(found.group(1))) in used, out.stdout


@pytest.mark.long
@multiprocess
def test_lightning_example_trains_with_the_hook():
    """examples/lightning_ddp.py: Lightning's DDPStrategy with ddp_comm_state/ddp_comm_hook."""
    out = torchrun(2, "examples/lightning_ddp.py", "--steps", "30", "--policy", "*.bias=ring;*=switchml", timeout=300)
    assert out.returncode == 0, out.stdout
    found = re.search(r"lightning: loss ([\d.]+) -> ([\d.]+); 30 steps, (\d+) buckets through commlib: (.*)", out.stdout)
    assert found, out.stdout
    first, last, buckets, used = float(found[1]), float(found[2]), int(found[3]), found[4]
    assert last < 0.8 * first and buckets >= 30, out.stdout
    assert used == "[('ring', None), ('switchml', None)]", out.stdout


@pytest.mark.long
@multiprocess
def test_lightning_own_launcher_forms_the_process_groups_job(tmp_path):
    """`python script.py` with Trainer(devices=2, accelerator="cpu"): Lightning starts rank 1
    without RANK; commlib's job must still be the process group's two ranks, the hook must run on
    CPU (a bucket per step: 4 steps in each of 2 epochs), and both ranks must end with the same weights."""
    out = _run([sys.executable, str(WORKERS / "lightning_launch.py"), str(tmp_path)], 300, _env(None))
    assert out.returncode == 0, out.stdout
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert r["commlib"] == [r["rank"], 2], f"rank {r['rank']}: commlib's job is {r['commlib']} (rank, size)"
        assert r["buckets"] >= 8, f"rank {r['rank']}: only {r['buckets']} buckets went through commlib"
    diff = max(abs(a - b) for a, b in zip(results[0]["weights"], results[1]["weights"]))
    assert diff == 0.0, f"the ranks' weights differ by up to {diff} after training"


def test_state_needs_the_models_named_parameters():
    with pytest.raises(commlib.ConfigError, match="named_parameters"):
        CommlibState([])
    with pytest.raises(commlib.ConfigError, match=r"named_parameters\(\), not parameters\(\)"):
        CommlibState(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(commlib.ConfigError, match="not both"):
        CommlibState(torch.nn.Linear(2, 2).named_parameters(), policy="*=ring", algorithm="ring")


def test_a_bucket_travels_whole_when_one_rule_plans_its_parameters_alike(monkeypatch):
    """From the second step; not with a compressor, rules that tell the parameters apart, or a
    tensor `auto` plans by its measured density (64 KiB or more, omnireduce running)."""
    single_process(monkeypatch)
    commlib.init(timeout_s=5.0)   # the default policy: auto
    small = [("a.weight", torch.nn.Parameter(torch.zeros(8, 8))), ("a.bias", torch.nn.Parameter(torch.zeros(8)))]
    large = small + [("e.weight", torch.nn.Parameter(torch.zeros(200, 100)))]   # 80 KB

    def whole(named, length=None, **options):
        """What the state decides for one bucket of these parameters on DDP's first and second step."""
        state = CommlibState(named, prefix="", **options)
        params = [p for _, p in named]
        buffer = torch.zeros(length or sum(p.numel() for p in params), dtype=params[0].dtype)
        first = state.whole(params, buffer)
        state.iteration = 1
        return first, state.whole(params, buffer)

    try:
        two = ("bucket(a.weight+1)", ["a.weight", "a.bias"])
        three = ("bucket(a.weight+2)", ["a.weight", "a.bias", "e.weight"])
        assert whole(small) == (None, (two, "auto"))
        assert whole(small, policy="*=ring") == (None, (two, "ring"))
        assert whole(large, algorithm="switchml") == (None, (three, "switchml"))
        assert whole(large, policy="*=ring") == (None, (three, "ring"))
        assert whole(large) == (None, None), "auto measures e.weight's density: per parameter"
        half = [(name, torch.nn.Parameter(p.detach().half())) for name, p in small]
        half.append(("e.weight", torch.nn.Parameter(torch.zeros(200, 200, dtype=torch.float16))))   # 80 KB
        assert whole(half) == (None, (three, "auto")), "no sparse algorithm takes float16: nothing to measure"
        brain = [(name, torch.nn.Parameter(p.detach().bfloat16())) for name, p in large]   # e.weight: 40 KB
        assert whole(brain) == (None, None), "bfloat16 travels as float32: e.weight's 80 KB are measured"
        assert whole(small, policy="*.bias=ring;*=switchml") == (None, None)
        assert whole(small, compression="fp16") == (None, None), "compression= alone compresses every step"
        assert whole(small, algorithm="ring", compression="fp16") == (None, None)
        assert whole(small, policy="*=ring", whole_buckets=False) == (None, None)
        assert whole(small[:1], policy="*=ring") == (None, None), "one parameter keeps its own name"
        assert whole(small, length=10, policy="*=ring") == (None, None), "per parameter names the wrong length"
    finally:
        commlib.shutdown()


def test_a_bucket_planned_by_density_travels_whole_once_its_runs_settled_a_dense_algorithm(monkeypatch):
    """`auto` measures e.weight's density: per parameter until the last runs of all three (what the
    controller released, the same on every rank) went to dense algorithms that `auto` no longer tries,
    then whole with the one that carried most of their bytes; per parameter again while one went
    sparse, and every REMEASURE_EVERY-th step to measure anew."""
    from commlib.api import runtime
    from commlib.torch.ddp import REMEASURE_EVERY
    single_process(monkeypatch)
    commlib.init(timeout_s=5.0)   # the default policy: auto
    named = [("a.weight", torch.nn.Parameter(torch.zeros(8, 8))), ("a.bias", torch.nn.Parameter(torch.zeros(8))),
             ("e.weight", torch.nn.Parameter(torch.zeros(200, 100)))]
    params = [p for _, p in named]
    buffer = torch.zeros(sum(p.numel() for p in params))
    state = CommlibState(named, prefix="")
    bucket = ("bucket(a.weight+2)", ["a.weight", "a.bias", "e.weight"])
    kept, trial = {"choice": "ring", "revisit": 500}, {"trial": 7, "candidates": ["switchml", "ring"]}

    def ran(*runs, **fields):
        for (name, _), (algorithm, auto) in zip(named, runs):
            runtime().records[name] = {"algorithm": algorithm, "auto": auto, "nbytes": dict(named)[name].numel() * 4,
                                       "dtype": "float32", "compression": None, **fields}

    try:
        state.iteration = 1
        assert state.whole(params, buffer) is None, "no run yet: per parameter"
        ran(("switchml", trial), ("switchml", trial), ("ring", kept))
        assert state.whole(params, buffer) is None, "auto still tries candidates: per parameter"
        ran(("switchml", kept), ("switchml", kept), ("omnireduce", None))
        assert state.whole(params, buffer) is None, "e.weight went sparse: per parameter"
        ran(("switchml", kept), ("switchml", kept), ("ring", kept), compression="fp16")
        assert state.whole(params, buffer) is None, "another collective's records under those names"
        ran(("switchml", kept), ("switchml", kept), ("ring", kept))
        assert state.whole(params, buffer) == (bucket, "ring"), "e.weight's 80 KB on the ring carry the most bytes"
        assert state.record_names() == ["bucket(a.weight+2)"]
        whole_run = {"algorithm": "ring", "nbytes": buffer.numel() * 4, "dtype": "float32", "compression": None}
        runtime().records[bucket[0]] = whole_run
        _stand_for(*bucket)   # the bucket ran whole: its record is each parameter's, auto's decision kept
        assert runtime().records["e.weight"] == {**whole_run, "auto": kept}, runtime().records["e.weight"]
        own = {**whole_run, "auto": {"choice": "switchml"}}   # a bucket auto planned itself: its own trials
        runtime().records[bucket[0]] = own
        _stand_for(*bucket)
        assert runtime().records["e.weight"] is own
        assert state.whole(params, buffer) == (bucket, "ring"), "whole again after a whole run"
        state.iteration = REMEASURE_EVERY
        assert state.whole(params, buffer) is None, "measured anew every REMEASURE_EVERY steps"
        assert sorted(state.record_names()) == ["a.bias", "a.weight", "e.weight"]
        state.iteration = REMEASURE_EVERY + 1
        assert state.whole(params, buffer) == (bucket, "ring")
    finally:
        commlib.shutdown()


def test_bucket_views_follow_the_buffer_and_refuse_what_they_cannot_split():
    params = [torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(4))]
    buffer = torch.arange(10.0)
    views = _views(buffer, params)
    assert [tuple(v.shape) for v in views] == [(2, 3), (4,)]
    views[1][...] = -1   # views, not copies: results written into them land in the bucket
    assert buffer[6:].tolist() == [-1.0] * 4
    bf16 = torch.arange(10.0, dtype=torch.bfloat16)   # numpy has no bfloat16: torch views
    torch_views = _views(bf16, params)
    torch_views[0].fill_(-2)
    assert [tuple(v.shape) for v in torch_views] == [(2, 3), (4,)] and bf16[:6].tolist() == [-2.0] * 6
    with pytest.raises(commlib.ConfigError, match="keep the buffer's length"):
        _views(torch.zeros(9), params)
    sparse = torch.zeros(2, 3).to_sparse()
    assert _views(sparse, params[:1]) == [sparse]   # a sparse gradient is its own bucket
    with pytest.raises(commlib.ConfigError, match="one parameter's gradient"):
        _views(torch.zeros(10).to_sparse(), params)

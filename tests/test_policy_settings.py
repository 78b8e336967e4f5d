"""Policy parsing and matching, settings resolution, the controller's agreement rules."""
import pytest

from commlib import ConfigError, Policy, Rule
from commlib.controller import check_agreement
from commlib.dispatch import settle
from commlib.policy import Choice, parse_bytes
from commlib.settings import Settings, define


def test_policy_text_rules_in_order():
    p = Policy.parse("embedding.*=omnireduce; *.weight[min=1MiB]=topk(ratio=0.01,memory=residual);"
                     "re:layer\\d+\\.bias=ring:fp16; *[dtype=int32]=switchml; *=ring")
    assert p.choose("embedding.users", 10, "float32") == ("omnireduce", None, ())
    assert p.choose("fc.weight", 2 << 20, "float32") == ("auto", "topk(ratio=0.01,memory=residual)", ())
    assert p.choose("fc.weight", 100, "float32") == ("ring", None, ())          # too small for the topk rule
    assert p.choose("layer12.bias", 100, "float32") == ("ring", "fp16", ())
    assert p.choose("counts", 100, "int32") == ("switchml", None, ())


def test_policy_default_is_auto():
    assert Policy().choose("anything", 1, "float32") == ("auto", None, ())
    assert Policy([Rule("a*", "ring")]).choose("b", 1, "float32") == ("auto", None, ())


def test_density_rules_wait_for_the_measured_density():
    p = Policy.parse("emb.*[density<0.05]=omnireduce; emb.*[density<0.5]=ring; emb.*=switchml; *=auto")
    assert p.choose("emb.users", 100, "float32") == Choice("switchml", None, ((0.05, "omnireduce"), (0.5, "ring")))
    assert p.choose("fc.weight", 100, "float32") == ("auto", None, ())
    assert Policy([Rule("*", "omnireduce", max_density=0.1)]).choose("x", 1, "float32") == (
        "auto", None, ((0.1, "omnireduce"),))
    with pytest.raises(ConfigError, match="fallback"):
        Policy.parse("*[density<0.1]=omnireduce; *=topk").choose("x", 1, "float32")


@pytest.mark.parametrize("text", ["*=bogus", "*=", "noequals", "*[size=3]=ring", "re:(=ring", "*[density<0.1]=auto",
                                  "*[density<2]=omnireduce", "*[density<x]=ring", "*[density<0.1]=ring:fp16",
                                  "*=ring:topk", "*=switchml:signsgd"])
def test_bad_policy_is_a_clear_error(text):
    with pytest.raises(ConfigError):
        Policy.parse(text)


def test_parse_bytes():
    assert parse_bytes("4096") == 4096 and parse_bytes("64KiB") == 65536 and parse_bytes("1MB") == 10 ** 6
    with pytest.raises(ConfigError):
        parse_bytes("lots")


def test_settings_environment_beats_keyword_beats_default(caplog):
    assert Settings().timeout_s == 60.0
    assert Settings(environ={"COMMLIB_TIMEOUT_S": "5"}).timeout_s == 5.0
    assert Settings({"timeout_s": 2}, environ={}).timeout_s == 2
    assert Settings({"timeout_s": 2}, environ={"COMMLIB_TIMEOUT_S": "5"}).timeout_s == 5.0
    with caplog.at_level("WARNING", logger="commlib"):
        Settings(environ={"COMMLIB_TIMOUT_S": "5"})
    assert "COMMLIB_TIMOUT_S" in caplog.text
    with pytest.raises(ConfigError, match="unknown setting"):
        Settings({"timout_s": 2})
    with pytest.raises(ConfigError, match="COMMLIB_FUSION_THRESHOLD"):
        Settings(environ={"COMMLIB_FUSION_THRESHOLD": "big"})
    # a wait a selector cannot take (before: the controller's thread died at start with OverflowError)
    for environ in ({"COMMLIB_TIMEOUT_S": "1e9"}, {"COMMLIB_TIMEOUT_S": "0"}, {"COMMLIB_NEGOTIATION_TIMEOUT_S": "nan"}):
        with pytest.raises(ConfigError, match="must be above 0 and at most 1e"):
            Settings(environ=environ)


def test_settings_are_attributes_that_copy_and_never_hide_a_method():
    import copy
    import pickle

    settings = Settings({"timeout_s": 2}, environ={}).replaced(cycle_time_ms=3.0)
    for twin in (copy.copy(settings), copy.deepcopy(settings), pickle.loads(pickle.dumps(settings))):
        assert (twin.timeout_s, twin.cycle_time_ms) == (2, 3.0), twin
    with pytest.raises(ConfigError, match="would hide Settings.replaced"):
        define("replaced", 1, "a setting named like a method")


def _meta(**kw):
    base = {"name": "w", "shape": [4], "dtype": "float32", "op": "average", "compression": None,
            "choices": [[0.25, "omnireduce"], [None, "switchml"]], "density": 0.5, "prescale": 1.0, "postscale": 1.0}
    base.update(kw)
    return base


def test_agreement_names_the_field_and_ranks():
    assert check_agreement("w", {0: _meta(), 1: _meta()}) is None
    problem = check_agreement("w", {0: _meta(), 1: _meta(dtype="float64"), 2: _meta()})
    assert "'w'" in problem and "dtype" in problem and "rank 1 gave \"float64\"" in problem and "ranks 0,2" in problem
    problem = check_agreement("w", {0: _meta(), 1: _meta(choices=[[None, "ring"]])})
    assert "choices" in problem and "rank 1 gave [[null, \"ring\"]]" in problem
    assert check_agreement("w", {0: _meta(density=0.1), 1: _meta(density=0.9)}) is None   # measured per rank


def test_settle_uses_the_densest_rank():
    choices = [[0.25, "omnireduce"], [None, "switchml"]]
    assert settle(choices, [0.01, 0.02]) == "omnireduce"
    assert settle(choices, [0.01, 0.9]) == "switchml"
    assert settle(choices, [0.01, None]) == "switchml"   # a rank that measured nothing counts as dense
    assert settle([[None, "ring"]], [None, None]) == "ring"
    bands = [[0.05, "omnireduce"], [0.5, "ring"], [None, "switchml"]]
    assert [settle(bands, [d]) for d in (0.01, 0.05, 0.3, 0.9)] == ["omnireduce", "ring", "ring", "switchml"]


def test_registry_finds_every_backend_whatever_was_imported_first():
    import subprocess
    import sys
    code = "import commlib.backends.switchml; from commlib.backends import registry; print(sorted(registry()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "['allgather', 'hotcold', 'omnireduce', 'ring', 'sparse_allgather', 'switchml']", out.stdout + out.stderr


def test_collective_failures_are_horovods_internal_error_without_needing_horovod():
    import subprocess
    import sys
    from horovod.common.exceptions import HorovodInternalError
    import commlib
    for error in (commlib.CommTimeout, commlib.Mismatch, commlib.PeerFailure):
        assert issubclass(error, HorovodInternalError) and issubclass(error, commlib.CommError), error
    assert not issubclass(commlib.ConfigError, HorovodInternalError)   # a user's mistake, not a collective's
    code = ("import sys; sys.modules['horovod'] = None; import commlib; "
            "print(issubclass(commlib.PeerFailure, commlib.CommError), 'horovod' in str(commlib.PeerFailure.__mro__))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "False"], out.stdout + out.stderr

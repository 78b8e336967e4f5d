"""switchml through commlib.init() in real processes (torchrun-style launch), with hard timeouts."""
import pytest

from launch import spawn

from test_switchml_backend import _switch_process, sw

pytestmark = pytest.mark.multiprocess


def check(results, mode, address=None, packet_elems=8192):
    """tests/workers/switchml_worker.py: rank r contributes (r + 1) * x; packets sized by the path
    (loopback: the largest)."""
    for result in results:
        assert result["packet_elems"] == packet_elems, result
        r, n = result["rank"], result["size"]
        total = n * (n + 1) // 2
        embedded = mode == "embedded" and r == 0
        assert result["job_at_init"] and result["embedded"] == [embedded, embedded], result
        for length, sums in result["sums"].items():
            assert sums["dtypes"] == ["int32", "float32"] and sums["int_error"] == 0, (length, sums)
            assert sums["float_error_over_bound"] <= 1.0, (length, sums)
        assert result["avg"] == {"type": "Tensor", "values": [pytest.approx(total / n, abs=1e-5)]}, result
        assert result["half"] == {"dtype": "float16", "values": [total]}, result        # exact small integers
        assert result["half_avg"] == {"dtype": "float16", "values": [40000.0]}, result  # no float16 overflow
        assert result["torch_half"] == {"dtype": "torch.float16", "values": [0.5 * total]}, result
        assert result["received"] > 0 and result["algorithms"] == ["switchml"], result
        # the embedded switch holds the key rank 0 shared through the launcher; the external one has none
        assert result["authenticated"] == (mode == "embedded"), result
        assert address is None or result["switch"] == address, result
        if embedded or mode == "external":   # (a rank beside the embedded switch's cannot know when it stops)
            assert result["answers_after_shutdown"] == (mode == "external"), \
                "shutdown stops the embedded switch, and only that one"


def test_embedded_switch_with_no_setup():
    check(spawn(2, "switchml_worker.py", "embedded", timeout=120).check().results(), "embedded")


def test_configured_switch_in_its_own_process():
    proc, address = _switch_process()
    try:
        ranks = spawn(3, "switchml_worker.py", "external", timeout=120, env={"COMMLIB_SWITCH_ADDR": address, "COMMLIB_AUTHENTICATE": "0"})
        check(ranks.check().results(), "external", address)
        status = sw.SwitchClient(address).status()
        assert status["jobs"] == {} and status["free_slots"] == status["slots"]   # the job ended cleanly
        assert sw.SwitchClient(address).counters()["switch"]["pkts_recv"] > 0
    finally:
        proc.kill()

"""switchml through commlib.init() in real processes (torchrun-style launch), with hard timeouts."""
import pytest

from launch import spawn

from test_switchml_backend import _switch_process, sw

pytestmark = pytest.mark.multiprocess


def test_embedded_switch_with_no_setup():
    ranks = spawn(2, "switchml_worker.py", "embedded", timeout=120).check()
    assert all(f"OK {r}" in p.stdout for r, p in enumerate(ranks)), ranks.output


def test_configured_switch_in_its_own_process():
    proc, address = _switch_process()
    try:
        ranks = spawn(3, "switchml_worker.py", "external", timeout=120,
                      env={"COMMLIB_SWITCH_ADDR": address}).check()
        assert all(f"OK {r} {address}" in p.stdout for r, p in enumerate(ranks)), ranks.output
        status = sw.SwitchClient(address).status()
        assert status["jobs"] == {} and status["free_slots"] == status["slots"]   # the job ended cleanly
        assert sw.SwitchClient(address).counters()["switch"]["rx"] > 0
    finally:
        proc.kill()

"""switchml through commlib.init() in real processes (torchrun-style launch), with hard timeouts."""
import pytest

from helpers import check_switchml, switch_process, sw
from launch import spawn

pytestmark = pytest.mark.multiprocess


def test_embedded_switch_with_no_setup():
    check_switchml(spawn(2, "switchml_worker.py", "embedded", timeout=120).check().results(), "embedded")


def test_configured_switch_in_its_own_process():
    proc, address = switch_process()
    try:
        ranks = spawn(3, "switchml_worker.py", "external", timeout=120, env={"COMMLIB_SWITCH_ADDR": address, "COMMLIB_AUTHENTICATE": "0"})
        check_switchml(ranks.check().results(), "external", address)
        status = sw.SwitchClient(address).status()
        assert status["jobs"] == {} and status["free_slots"] == status["slots"]   # the job ended cleanly
        assert sw.SwitchClient(address).counters()["switch"]["pkts_recv"] > 0
    finally:
        proc.kill()

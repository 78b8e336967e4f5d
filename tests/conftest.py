"""Fixtures shared by several test files (tests/helpers.py has the shared functions). The tests
import `launch` and `helpers` from this folder, `benchmarks.*` from the repository root: both are on
the path through pyproject.toml's `pythonpath`."""
import pytest

from helpers import Job, sw


@pytest.fixture
def switch():
    """A SwitchML software switch in this process (testing mode: its counters and hooks)."""
    server = sw.SwitchServer("127.0.0.1", 0, slots=256, slot_group=4, testing=True).start()
    yield server
    server.stop()


@pytest.fixture
def job2(switch):
    """Two worker sockets of this process registered at `switch` as one job."""
    job = Job(switch, 2)
    yield job
    job.close()

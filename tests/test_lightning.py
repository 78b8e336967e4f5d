"""Lightning as its users run it: `python train.py`, Lightning starting the ranks itself (no RANK in
the environment; issue 23, item 1), on CPU, with commlib's backend (the hook's case is in
test_ddp.py), and where a launcher and the process group disagree."""
import subprocess
import sys

import pytest

import commlib
from commlib.context import detect
from commlib.errors import ConfigError
from commlib.testing import results
from launch import ROOT, WORKERS, _env

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def test_lightnings_own_launcher_with_the_commlib_backend():
    done = subprocess.run([sys.executable, str(WORKERS / "lightning_backend.py")], capture_output=True, text=True,
                          timeout=240, cwd=ROOT, env=_env(None))
    assert done.returncode == 0, done.stdout + done.stderr
    for result in results(done.stdout, 2):
        assert result["size"] == 2 and result["commlib_size"] == 2 and result["backend"] == "commlib", result
        assert result["same_on_all_ranks"] and result["trained"], result
        assert "switchml" in result["algorithms"], result


def test_world_size_without_rank_or_process_group_is_refused():
    """What Lightning's children see before fit: WORLD_SIZE=2, LOCAL_RANK, no RANK and no group yet."""
    with pytest.raises(ConfigError, match="WORLD_SIZE=2 but no RANK in the environment"):
        detect({"WORLD_SIZE": "2", "LOCAL_RANK": "1"})


def test_a_launcher_that_disagrees_with_the_process_group_is_refused(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        assert detect({}).size == 1
        with pytest.raises(ConfigError, match=r"torch.distributed says this process is rank 0 of 1, but the launcher "
                                              r"\(torchrun\) says rank 1 of 2"):
            detect({"RANK": "1", "WORLD_SIZE": "2"})
    finally:
        dist.destroy_process_group()


def test_a_job_started_before_the_process_group_refuses_to_reduce(monkeypatch):
    """commlib.init() before torch.distributed (a one-rank job), then a world of 2: the next call says so."""
    import numpy as np
    import torch.distributed as dist
    commlib.init(policy="*=ring")
    try:
        commlib.allreduce(np.ones(2, np.float32), name="before")
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        with pytest.raises(ConfigError, match="commlib's job says this process is rank 0 of 1, but torch.distributed"):
            commlib.allreduce(np.ones(2, np.float32), name="after")
    finally:
        monkeypatch.undo()
        commlib.shutdown()

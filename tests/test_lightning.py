"""Lightning as its users run it: `python train.py`, Lightning starting the ranks itself (no RANK in
the environment; issue 23, item 1), on CPU, with commlib's comm hook or commlib's backend."""
import subprocess
import sys

import pytest

import commlib
from commlib.context import detect
from commlib.errors import ConfigError
from commlib.testing import results
from launch import ROOT, WORKERS, _env

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def lightning(mode):
    done = subprocess.run([sys.executable, str(WORKERS / "lightning_ddp.py"), mode], capture_output=True, text=True,
                          timeout=240, cwd=ROOT, env=_env(None))
    assert done.returncode == 0, done.stdout + done.stderr
    return results(done.stdout, 2)


@pytest.mark.parametrize("mode, backend", [("hook", "gloo"), ("backend", "commlib")])
def test_lightnings_own_launcher_gives_a_job_of_every_rank(mode, backend):
    for result in lightning(mode):
        assert result["size"] == 2 and result["commlib_size"] == 2 and result["backend"] == backend, result
        assert result["same_on_all_ranks"] and result["trained"], result
        assert "switchml" in result["algorithms"], result


def test_world_size_without_rank_or_process_group_is_refused():
    """What Lightning's children see before fit: WORLD_SIZE=2, LOCAL_RANK, no RANK and no group yet."""
    with pytest.raises(ConfigError, match="WORLD_SIZE=2 but no RANK and no torch.distributed process group"):
        detect({"WORLD_SIZE": "2", "LOCAL_RANK": "1"})


def test_a_launcher_that_disagrees_with_the_process_group_is_refused(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        assert detect({}).size == 1
        with pytest.raises(ConfigError, match="torchrun environment .* says rank 1 of 2 but torch.distributed"):
            detect({"RANK": "1", "WORLD_SIZE": "2"})
    finally:
        dist.destroy_process_group()


def test_the_ddp_hook_refuses_a_one_rank_job_started_before_the_process_group(monkeypatch):
    """commlib.init() before torch.distributed (a one-rank job), then DDP's world of 2: the hook says so."""
    import torch.distributed as dist
    from commlib.torch.ddp import _check_world
    commlib.init()
    try:
        _check_world()   # no process group: nothing to disagree with
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        with pytest.raises(ConfigError, match="commlib's job has 1 ranks but DDP's process group 2"):
            _check_world()
    finally:
        commlib.shutdown()

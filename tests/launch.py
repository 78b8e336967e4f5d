"""Launch N ranks of a worker script and fail loudly (never hang) when one misbehaves.

`spawn` starts plain processes with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT),
`horovodrun` and `mpirun` go through the real launchers. Every launch has a hard timeout after
which the whole process group is killed and the test fails with the ranks' output.
"""
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from commlib.testing import results

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"
BIN = Path(sys.executable).parent
# the ranks inherit it: a hang's SIGABRT (_dump_stacks) prints their stacks and leaves no core files
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks(list):
    """The finished processes; `.output` is everything they printed, `.results()` what each rank
    reported (commlib.testing.report)."""

    @property
    def output(self):
        return "\n".join(f"--- rank {i} (exit {p.returncode}) ---\n{p.stdout}" for i, p in enumerate(self))

    def check(self):
        bad = [i for i, p in enumerate(self) if p.returncode != 0]
        assert not bad, f"ranks {bad} failed:\n{self.output}"
        return self

    def results(self, silent=()):
        return results(self.output, len(self), silent)


def _dump_stacks(pids, launched=None):
    """Every Python thread's stack of these processes and their children, or (`launched`: the ranks'
    command line, a launcher's pids) of those children that run it, each to its own stderr (the ranks
    run with PYTHONFAULTHANDLER, which prints them on SIGABRT): a hang's output says where each rank was."""
    procs = []
    for pid in pids:
        try:
            parent = psutil.Process(pid)
            procs += [parent] + parent.children(recursive=True)
        except psutil.Error:
            pass
    for proc in procs:
        try:
            if launched is None or " ".join(proc.cmdline()).startswith(launched):
                proc.send_signal(signal.SIGABRT)
        except psutil.Error:
            pass
    time.sleep(3)   # for the dumps to reach the launcher's pipes


def _run(cmd, timeout, env):
    """Run one launcher command in its own process group; on timeout dump the ranks' stacks and kill the group."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _dump_stacks([proc.pid], launched=" ".join(cmd[cmd.index(sys.executable):]))
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(map(str, cmd))} hung past its {timeout}s timeout; output:\n{out}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


def _target(script):
    """A worker script in tests/workers, or '-m package.module'."""
    return ["-m", script[2:].strip()] if script.startswith("-m") else [str(WORKERS / script)]


def _env(extra):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    env.update({k: str(v) for k, v in (extra or {}).items()})
    return env


def spawn(nprocs, script, *args, timeout=120, env=None):
    """Start `nprocs` ranks of tests/workers/<script> (or a path) with torchrun's environment."""
    port = free_port()
    procs = []
    for rank in range(nprocs):
        rank_env = _env(env)
        rank_env.update(RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank),
                        LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, *_target(script), *map(str, args)],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=rank_env, cwd=ROOT, start_new_session=True))
    results = Ranks()
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out))
    except subprocess.TimeoutExpired:
        _dump_stacks([proc.pid for proc in procs if proc.poll() is None])
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        outs = [proc.communicate()[0] for proc in procs]
        raise AssertionError(f"{script} with {nprocs} ranks hung past {timeout}s:\n" +
                             "\n".join(f"--- rank {i} ---\n{o}" for i, o in enumerate(outs))) from None
    return results


def horovodrun(nprocs, script, *args, timeout=180, env=None, mpi=False):
    """Run tests/workers/<script> under the real `horovodrun -np N` (Gloo by default)."""
    # Gloo's 30 s default recv timeout trips when 4 ranks share 2 busy cores; the test's own hard
    # timeout still bounds the job (horovod issues #1374, #2015 recommend raising it)
    cmd = [str(BIN / "horovodrun"), "-np", str(nprocs), "-H", f"localhost:{nprocs}", "--gloo-timeout-seconds", "120",
           "--mpi-args=--allow-run-as-root --oversubscribe" if mpi else "--gloo",
           sys.executable, *_target(script), *map(str, args)]
    if mpi:
        cmd.insert(5, "--mpi")
    return _run(cmd, timeout, _env(env))


def mpirun(nprocs, script, *args, timeout=180, env=None):
    """Run tests/workers/<script> under OpenMPI's mpirun (no horovod involved)."""
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(nprocs),
           "-x", "PYTHONUNBUFFERED", "-x", "PATH", "-x", "OMP_NUM_THREADS",
           *[a for k in (env or {}) for a in ("-x", k)],
           sys.executable, *_target(script), *map(str, args)]
    return _run(cmd, timeout, _env(env))

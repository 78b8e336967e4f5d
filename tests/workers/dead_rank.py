"""One rank of a switchml job on a keyed external switch (COMMLIB_SWITCH_ADDR, COMMLIB_SWITCH_KEY_FILE)
in which rank 0 dies (SIGKILL) after the first tensor: nothing of rank 0 unregisters the job. The
other ranks stay alive, their keepalives going, and report whether the switch still lists the job
after argv[1] seconds (tests/test_trust_control.py checks that it does not: any rank's death ends it)."""
import os
import signal
import sys
import time

import numpy as np

import commlib
from commlib.switch.switchml import SwitchClient
from commlib.testing import report

wait_s = float(sys.argv[1])
commlib.init(policy="*=switchml")
r, n = commlib.rank(), commlib.size()
got = commlib.allreduce(np.full(1000, r + 1, np.int32), name="x", op=commlib.Sum, algorithm="switchml")
job = commlib.backend_stats()["switchml"]["job"]
report(rank=r, sum_ok=bool((got == n * (n + 1) // 2).all()), job=job)
if r == 0:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(wait_s)                       # this rank lives on: its keepalive thread still runs
jobs = SwitchClient(os.environ["COMMLIB_SWITCH_ADDR"]).status()["jobs"]
report(rank=r, sum_ok=True, job=job, jobs_after=sorted(jobs))
os._exit(0)                              # the job's controller (rank 0) is gone: no orderly shutdown

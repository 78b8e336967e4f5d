"""Error paths, one per mode; every rank checks that it raised the right, clear error.

mismatch: rank 1 reduces a tensor of the wrong shape -> Mismatch on every rank naming both shapes.
timeout:  rank 1 never submits a tensor -> CommTimeout on the others naming rank 1, within the timeout.
dead:     rank 1 exits abruptly -> PeerFailure on the others naming rank 1.
settings: rank 1 has another fusion_threshold -> Mismatch at init on every rank naming it.
noinit:   (under horovodrun) rank 1 joins Horovod but never calls commlib.init() -> CommTimeout at
          init on the others, within the timeout, instead of waiting forever in Horovod's broadcast.
"""
import os
import sys
import time

import numpy as np

import commlib

mode = sys.argv[1]
if mode == "settings":
    rank = int(os.environ["RANK"])
    try:
        commlib.init(policy="*=ring", timeout_s=4.0, fusion_threshold=1024 if rank == 1 else 4096)
        raise SystemExit("no error raised")
    except commlib.Mismatch as exc:
        assert "fusion_threshold: [4096, 1024, 4096]" in str(exc), str(exc)
        print("SETTINGS-OK", rank, exc)
        sys.exit(0)
if mode == "noinit":
    import horovod.torch as hvd
    hvd.init()
    start = time.monotonic()
    if hvd.rank() == 1:
        time.sleep(10.0)
    else:
        try:
            commlib.init(policy="*=ring", timeout_s=4.0)
            raise SystemExit("no error raised")
        except commlib.CommTimeout as exc:
            elapsed = time.monotonic() - start
            assert "commlib.init()" in str(exc) and elapsed < 4.0 + 3.0, (elapsed, str(exc))
            print("NOINIT-OK", hvd.rank(), f"{elapsed:.1f}s", exc)
    print("NOINIT-DONE", hvd.rank(), flush=True)
    os._exit(0)   # Horovod still waits inside the broadcast rank 1 never joined: skip its teardown
commlib.init(policy="*=ring", timeout_s=4.0, negotiation_timeout_s=4.0, stall_warning_s=2.0)
r, n = commlib.rank(), commlib.size()
commlib.allreduce(np.ones(3, np.float32), name="warmup")

if mode == "mismatch":
    shape = 5 if r == 1 else 4
    start = time.monotonic()
    try:
        commlib.allreduce(np.ones(shape, np.float32), name="grad.w")
        raise SystemExit("no error raised")
    except commlib.Mismatch as exc:
        msg = str(exc)
        assert "'grad.w'" in msg and "shape" in msg and "rank 1 gave [5]" in msg, msg
        assert time.monotonic() - start < 4.0, f"took {time.monotonic() - start:.1f}s, past the 4s timeout"
        print("MISMATCH-OK", r, msg)
elif mode == "timeout":
    start = time.monotonic()
    if r == 1:
        time.sleep(6.0)            # never calls: stays alive past the others' timeout
        print("TIMEOUT-OK", r)
    else:
        try:
            commlib.allreduce(np.ones(4, np.float32), name="late")
            raise SystemExit("no error raised")
        except commlib.CommTimeout as exc:
            elapsed = time.monotonic() - start
            assert "'late'" in str(exc) and "not by rank 1" in str(exc), str(exc)
            assert elapsed < 4.0 + 3.0, f"took {elapsed:.1f}s for a 4s timeout"
            print("TIMEOUT-OK", r, f"{elapsed:.1f}s", exc)
elif mode == "dead":
    if r == 1:
        os._exit(3)
    try:
        time.sleep(0.5)
        commlib.allreduce(np.ones(4, np.float32), name="after_death")
        raise SystemExit("no error raised")
    except commlib.PeerFailure as exc:
        assert "rank 1" in str(exc), str(exc)
        print("DEAD-OK", r, exc)
        sys.stdout.flush()
        os._exit(0)   # skip interpreter teardown of a process group whose peer is gone
commlib.shutdown()

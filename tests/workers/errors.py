"""Error paths, one per mode; every rank reports which error it raised, its message and how long it
took (commlib.testing.report), and the test checks them.

mismatch: rank 1 reduces a tensor of the wrong shape -> Mismatch on every rank naming both shapes.
timeout:  rank 1 never submits a tensor -> CommTimeout on the others naming rank 1, within the timeout.
dead:     rank 1 exits abruptly -> PeerFailure on the others naming rank 1.
settings: rank 1 has another fusion_threshold -> Mismatch at init on every rank naming it.
refused:  rank 1's tensor is refused before it is submitted (a bool tensor, a float8 one) -> the same
          InvalidTensor on every rank at once (default timeouts), and the job goes on; a tensor
          refused on every rank can be submitted again under its name at once.
resized:  every rank resizes its tensors while they are in flight: a small one may be (its values were
          copied at submission), a large one torch refuses to resize; every sum is exact.
noinit:   (under horovodrun) rank 1 joins Horovod but never calls commlib.init() -> CommTimeout at
          init on the others, within the timeout, instead of waiting forever in Horovod's broadcast.
"""
import os
import sys
import time

import numpy as np

import commlib
from commlib.testing import report


def outcome(fn):
    """fn's error (None if it raised none), its message and the time it took."""
    start = time.monotonic()
    try:
        fn()
        error, message = None, ""
    except commlib.CommError as exc:
        error, message = type(exc).__name__, str(exc)
    return dict(error=error, message=message, elapsed_s=round(time.monotonic() - start, 2))


def attempt(rank, fn):
    report(rank=rank, **outcome(fn))


mode = sys.argv[1]
if mode == "settings":
    rank = int(os.environ["RANK"])
    attempt(rank, lambda: commlib.init(policy="*=ring", timeout_s=4.0, fusion_threshold=1024 if rank == 1 else 4096))
    sys.exit(0)
if mode == "noinit":
    import horovod.torch as hvd
    hvd.init()
    if hvd.rank() == 1:
        time.sleep(10.0)
        report(rank=1, error=None, message="never called commlib.init()", elapsed_s=10.0)
    else:
        attempt(hvd.rank(), lambda: commlib.init(policy="*=ring", timeout_s=4.0))
    os._exit(0)   # Horovod still waits inside the broadcast rank 1 never joined: skip its teardown
if mode == "refused":   # the default timeouts: a rank waiting for the refused tensor would wait 600 s
    commlib.init(policy="*=ring")
    r = commlib.rank()
    refused = outcome(lambda: commlib.allreduce(np.ones(4, np.bool_ if r == 1 else np.float32), name="grad.w"))
    after = commlib.allreduce(np.ones(4, np.float32), name="after", op=commlib.Sum)
    import torch   # a dtype numpy has no counterpart of: refused the same way, not a TypeError on rank 1 alone
    float8 = outcome(lambda: commlib.allreduce(torch.ones(4, dtype=torch.float8_e4m3fn if r == 1 else torch.float32),
                                               name="grad.f8"))
    after_float8 = commlib.allreduce(np.ones(4, np.float32), name="after.f8", op=commlib.Sum)
    # refused on every rank, then the same name submitted again at once: the controller's late notice
    # of the refusal must not fail the new tensor
    everyone = outcome(lambda: commlib.allreduce(np.ones(4, np.bool_), name="again"))["error"]
    again = commlib.allreduce(np.ones(4, np.float32), name="again", op=commlib.Sum)
    report(rank=r, after=after.tolist(), everyone=everyone, again=again.tolist(), float8=float8,
           after_float8=after_float8.tolist(), **refused)
    commlib.shutdown()
    sys.exit(0)
commlib.init(policy="*=ring", timeout_s=4.0, negotiation_timeout_s=4.0, stall_warning_s=2.0)
r, n = commlib.rank(), commlib.size()
commlib.allreduce(np.ones(3, np.float32), name="warmup")

if mode == "mismatch":
    attempt(r, lambda: commlib.allreduce(np.ones(5 if r == 1 else 4, np.float32), name="grad.w"))
elif mode == "timeout":
    if r == 1:
        time.sleep(6.0)            # never calls: stays alive past the others' timeout
        report(rank=r, error=None, message="slept", elapsed_s=6.0)
    else:
        attempt(r, lambda: commlib.allreduce(np.ones(4, np.float32), name="late"))
elif mode == "resized":
    import torch
    small, large = torch.full((1000,), float(r + 1)), torch.full((1 << 20,), float(r + 1))
    handles = [commlib.allreduce_async(small, name="small", op=commlib.Sum),
               commlib.allreduce_async(large, name="large", op=commlib.Sum)]
    small.resize_(1 << 20)   # allowed: what the backends read was copied at submission
    try:
        large.resize_(1 << 22)
        refused = "resized"
    except RuntimeError as exc:   # its memory is what the backends read
        refused = str(exc)
    sums = [sorted(set(commlib.synchronize(h).tolist())) for h in handles]
    report(rank=r, sums=sums, refused=refused)
elif mode == "dead":
    if r == 1:
        os._exit(3)
    time.sleep(0.5)
    attempt(r, lambda: commlib.allreduce(np.ones(4, np.float32), name="after_death"))
    os._exit(0)   # skip interpreter teardown of a process group whose peer is gone
commlib.shutdown()

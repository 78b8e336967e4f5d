"""One job on the embedded default with colocated omnireduce aggregators (keyed with the job's secret),
and a ring allreduce of a marker the test looks for on the wire. Reports what a sniffer must not
find: the job's secret, and the omnireduce job key with the public nonce it is derived from."""
import numpy as np

import commlib
from commlib import api
from commlib.testing import report

MARKER = np.arange(1000, dtype=np.float32) + 271828.0   # values no set-up message holds

commlib.init(policy="*=omnireduce")
got = commlib.allreduce(np.arange(4096, dtype=np.float32), name="dense", op=commlib.Sum)
marker = commlib.allreduce(MARKER * (commlib.rank() == 0), name="marker", op=commlib.Sum, algorithm="ring")
runtime = api._runtime
omnireduce = runtime.backends["omnireduce"]
report(rank=commlib.rank(), exact=bool(np.array_equal(got, commlib.size() * np.arange(4096, dtype=np.float32))),
       marker_back=bool(np.array_equal(marker, MARKER)), secret=runtime.ctx.secret.hex(),
       nonce=omnireduce._nonce, job_key=omnireduce._key.hex(), algorithms=sorted(
           {r["algorithm"] for r in commlib.records().values()}))
commlib.shutdown()

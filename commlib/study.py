"""The IMC'20 study of a job with one setting: `COMMLIB_STUDY=DIR` (or commlib.init(study=DIR)).

While the job runs every rank writes its timeline to DIR/trace.<rank>.json (commlib.timeline). At
commlib.shutdown() the ranks agree that their traces are closed, and once the job closed, rank 0
merges the traces it can read into DIR/trace.json (Perfetto, chrome://tracing) and analyzes it: DIR/breakdown.txt is
`python -m commlib.analyze`'s table (worker queue, processing, transfer and the server's share per
algorithm and size band; the daemons' shares; the update skew of sparse tensors) and its PNG plots
lie beside it. On a cluster without a shared DIR, rank 0 sees only its host's traces: the note at the
top of breakdown.txt names the ranks whose traces are elsewhere, to be copied in and analyzed by hand.
"""
import contextlib
import io
import logging
import os
import socket

from commlib.errors import ConfigError
from commlib.settings import define

log = logging.getLogger("commlib")

define("study", "", "folder for the IMC'20 study of this job: every rank's timeline while it runs, and at "
       "shutdown the merged trace, the breakdown table (breakdown.txt) and plots (commlib.study)")


def trace_path(settings):
    """The timeline this rank writes: the study's, else the `timeline` setting's ('' for none)."""
    if not settings.study:
        return settings.timeline
    if settings.timeline:
        raise ConfigError(f"both study={settings.study!r} and timeline={settings.timeline!r} are set: the study "
                          f"writes its own timeline (DIR/trace.<rank>.json); set one of them")
    os.makedirs(settings.study, exist_ok=True)
    return os.path.join(settings.study, "trace.{rank}.json")   # every rank its own (commlib.timeline)


def gather(ctx):
    """At shutdown, once every rank closed its trace: where each rank's trace lies (an exchange, so
    before the job's connections close). Rank 0 gets (folder, size, [[host, bytes] per rank]), the
    others None; `report` then does the slow part, after the job closed."""
    folder = ctx.settings.study
    if not folder:
        return None
    path = _rank_trace(folder, ctx.rank)
    where = ctx.exchange("study/traces", [socket.gethostname(), os.path.getsize(path) if os.path.exists(path) else -1])
    return (folder, ctx.size, where) if ctx.rank == 0 else None


def report(found):
    """Rank 0: merge the traces it can read and analyze them into the study's folder. Returns the
    path of breakdown.txt."""
    from commlib import analyze, timeline   # late: plotting libraries only when a study is asked for
    folder, size, where = found
    readable = [rank for rank, (_, nbytes) in enumerate(where)
                if nbytes >= 0 and os.path.exists(_rank_trace(folder, rank))
                and os.path.getsize(_rank_trace(folder, rank)) >= nbytes]
    missing = sorted(set(range(size)) - set(readable))
    merged = os.path.join(folder, "trace.json")
    timeline.write(merged, timeline.merge([_rank_trace(folder, rank) for rank in readable]))
    text = io.StringIO()
    if missing:
        text.write(f"Ranks {missing} wrote their traces on their own hosts "
                   f"({sorted({where[r][0] for r in missing})}): copy their {folder}/trace.<rank>.json here and run "
                   f"`python -m commlib.analyze {folder}/trace.*.json --out {folder}`.\n\n")
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        analyze.main([merged, "--out", folder])
    breakdown = os.path.join(folder, "breakdown.txt")
    with open(breakdown, "w") as f:
        f.write(text.getvalue())
    log.info("commlib: the study of this job is in %s (breakdown.txt, trace.json, plots)", folder)
    return breakdown


def _rank_trace(folder, rank):
    return os.path.join(folder, f"trace.{rank}.json")

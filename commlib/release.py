"""What the controller releases to every rank's executor: one `Release` per tensor, in order."""
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Release:
    """Run tensor `name` with `algorithm`: every rank got the same, in the same order."""
    name: str
    algorithm: str
    estimate: dict = None   # the traffic model's, when it settled the algorithm
    counts: list = None     # row-sparse: every rank's row count, for the allgather
    bit: int = None         # its bit in the controller's response cache, when cached
    joined: dict = None     # ranks that joined (commlib.join) and run a stand-in: {"ranks", "shape", "dtype", ...}
    auto: dict = None       # `auto`'s trials (commlib.trials): a trial's id, or the kept choice and times

    def wire(self):
        """Its JSON form on the controller's channel (Release(**wire) reads it back)."""
        return {key: value for key, value in asdict(self).items() if value is not None}

"""Traffic models: bytes each worker sends and receives to reduce one row-sparse tensor with each
algorithm, from what every rank measured (its touched rows, a sketch of them for the union).
`auto` for sparse tensors takes the algorithm whose busiest direction moves the fewest bytes
(a full-duplex link: time ~ max(up, down)); commlib.records() shows the estimate and the choice.

Per worker, N ranks, n_r own rows, U rows in the union, b bytes per row, S bytes of the whole table
with a presence count per row:
  sparse_allgather  commlib's ring allgather pads every rank's payload to the largest one, P_max =
                    8 + n_max (8 + b): up = down = (N - 1) P_max
  omnireduce        q = block bytes + 40 (header), o_r own blocks, V union blocks (row-aligned):
                    up = o_me q + V q (N-1)/N (its colocated aggregator's results),
                    down = V q + mean(o) q (N-1)/N (the others' blocks for its columns)
  switchml          up = down = S (the switch sums)
  ring (and others) up = down = 2 S (N-1)/N
"""
from commlib.sparse import union_size

HEADER = 40   # omnireduce's per-packet header (switch/csrc/omnireduce.h)


def estimate(stats, algorithms):
    """{algorithm: {"up", "down"} bytes per worker, "union_rows": U, "choice": algorithm} for the
    candidates in `algorithms` (in preference order: the first of equal cost wins). `stats`: every
    rank's {"rows", "sketch", "nrows", "width", "itemsize", and for omnireduce "block", "blocks",
    "block_sketch", "group_blocks"}."""
    n = len(stats)
    first = stats[0]
    rows = [s["rows"] for s in stats]
    row_bytes = first["width"] * first["itemsize"]
    table = first["nrows"] * (first["width"] + 1) * first["itemsize"]
    out = {"union_rows": round(union_size([s["sketch"] for s in stats], rows))}
    for algorithm in algorithms:
        if algorithm == "sparse_allgather":
            up = down = (n - 1) * (8 + max(rows) * (8 + row_bytes))
        elif algorithm == "omnireduce":
            q = first["block"] * first["itemsize"] + HEADER
            per = first["group_blocks"]
            own = [s["blocks"] * per for s in stats]
            union = union_size([s["block_sketch"] for s in stats], [s["blocks"] for s in stats]) * per
            mean = sum(own) / n
            up = max(own) * q + union * q * (n - 1) / n
            down = union * q + mean * q * (n - 1) / n
        elif algorithm == "switchml":
            up = down = table
        else:
            up = down = 2 * table * (n - 1) / n
        out[algorithm] = {"up": int(up), "down": int(down)}
    out["choice"] = min(algorithms, key=lambda a: max(out[a]["up"], out[a]["down"]))
    return out

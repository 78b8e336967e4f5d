"""Traffic models: bytes each worker sends and receives to reduce one row-sparse tensor with each
algorithm, from what every rank measured (its touched rows, a sketch of them for the union).
`auto` for sparse tensors takes the algorithm whose busiest direction moves the fewest bytes
(a full-duplex link: time ~ max(up, down)); commlib.records() shows the estimate and the choice.
The formulas live here; each backend's `traffic` (backends/base.py) applies its own.

Per worker, N ranks, n_r own rows, U rows in the union, b bytes per row, S bytes of the whole table
with a presence count per row:
  sparse_allgather  commlib's ring allgather pads every rank's payload to the largest one, P_max =
                    8 + n_max (4 + b) (int32 indices, where the table allows): up = down = (N - 1) P_max
  omnireduce        row blocks (omnireduce_rows_per_block whole rows each, one by default); a
                    packet of a block costs q = block bytes + h, a header-only one h (header and
                    MAC: an authenticated job, the default; the IP/UDP headers come once per GSO
                    batch), a result s more (its server stamp); the constants are
                    commlib.switch.omnireduce_model's, from omnireduce.h; o_r own blocks, V
                    union blocks, C columns. Every worker bootstraps every column (C packets,
                    header-only when zero), gets C + V results and acknowledges every A-th round it
                    is silent in; its colocated aggregator serves C/N columns: it gets the others'
                    packets for them and sends them their results. What a worker and its own
                    aggregator exchange stays on the host, so every term crosses the link (N-1)/N:
                    R = V (q + s) + C (h + s) (results),
                    up = ((o_me q + C h + (C + V - o_me) h / A) + R) (N-1)/N,
                    down = (R + (mean(o) q + C h + (C + V - mean(o)) h / A)) (N-1)/N
  hotcold           once the ranks agreed on K hot rows (a window of counts: before the first one
                    K = 0 and it costs what its cold carrier costs, so auto never prefers it):
                    the slab of K (w + 1) values through switchml (up = down = slab; ring: 2 slab
                    (N-1)/N) plus the cold rows, c_r per rank, through the allgather as above (or
                    omnireduce's row blocks, from the cold rows' own stats). With presence counts
                    (hotcold_presence): K counts (K / (32 // bits) int32 words) and a slab of the
                    M hot rows two or more ranks touch (w values each), and the cold rows are
                    rank r's rows outside the hot set and its hot rows no other rank touched (M
                    and those from the sketches of every rank's hot rows)
  switchml          up = down = S (the switch sums)
  ring (and others) up = down = 2 S (N-1)/N
  bound             what no exact algorithm can go below: a worker must receive, for every row some
                    OTHER rank touched, at least that row's values (its sum depends on them; a row
                    only it touched it already knows), so down >= |union of the others' rows| w
                    itemsize for the busiest worker. allgather / bound is the most any algorithm,
                    hot/cold included, can gain over the sparse allgather on a link-bound call.
"""
import numpy as np

from commlib.sparse import others_union_sizes, payload_bytes, presence_words, sketch, union_size


def estimate(stats, models):
    """{algorithm: {"up", "down"} bytes per worker, "union_rows": U, "bound": the fewest bytes any
    exact algorithm delivers to the busiest worker, "choice": algorithm} for the candidates in
    `models` ({algorithm: its Backend.traffic}, in preference order: the first of equal cost wins). `stats`: every
    rank's {"rows", "sketch", "nrows", "width", "itemsize", for omnireduce "omnireduce": its row
    blocks (omnireduce_stats), for hotcold "hotcold": {"hot_k", "presence", "hot", "cold_algorithm", "cold",
    with presence "hot_rows" and "hot_sketch",
    and "omnireduce" for a cold omnireduce}}."""
    first = stats[0]
    rows = [s["rows"] for s in stats]
    sketches = [s["sketch"] for s in stats]
    out = {"union_rows": round(union_size(sketches, rows)),
           "bound": int(max(others_union_sizes(sketches, rows)) * first["width"] * first["itemsize"])}
    for algorithm, model in models.items():
        cost = model(stats)
        out[algorithm] = {key: int(value) for key, value in cost.items()}
    out["choice"] = min(models, key=lambda a: max(out[a]["up"], out[a]["down"]))
    return out


def table_bytes(stats):
    """S: the whole table with a presence count per row."""
    first = stats[0]
    return first["nrows"] * (first["width"] + 1) * first["itemsize"]


def allgather(stats):
    """The padded ring allgather of every rank's (rows, values), each way per worker."""
    first = stats[0]
    up = (len(stats) - 1) * payload_bytes(max(s["rows"] for s in stats), first["width"] * first["itemsize"],
                                          first["nrows"])
    return {"up": up, "down": up}


def omnireduce_stats(slots, rows, columns):
    """What the model needs of one rank's row blocks: `slots` the tensor's commlib.sparse.RowSlots,
    `rows` its unique touched rows, `columns` the job's column count."""
    groups = np.unique(slots.touched_blocks(rows))
    return {"block": slots.block, "group_blocks": slots.group // slots.block, "blocks": int(groups.size),
            "block_sketch": sketch(groups), "columns": min(columns, slots.size // slots.block)}


def omnireduce(stats, itemsize):
    """(up, down) bytes per worker of omnireduce's row blocks (colocated aggregators)."""
    from commlib.switch import omnireduce_model as wire   # the C extension's constants: only where omnireduce runs
    n, first = len(stats), stats[0]
    h, stamp = wire.HEADER + wire.MAC, wire.STAMP
    q = first["block"] * itemsize + h
    per, columns = first["group_blocks"], first["columns"]
    own = [s["blocks"] * per for s in stats]
    union = union_size([s["block_sketch"] for s in stats], [s["blocks"] for s in stats]) * per
    results = union * (q + stamp) + columns * (h + stamp)

    def uploads(blocks):   # a worker's data, bootstrap and acknowledgements
        return blocks * q + columns * h + (columns + union - blocks) * h / wire.ACK_EVERY

    share = (n - 1) / n
    return (uploads(max(own)) + results) * share, (results + uploads(sum(own) / n)) * share


def hot_slab(stats, first):
    """(bytes of the hot/cold split's slab and presence counts, every rank's cold row count): what
    its hot and its cold carriers then move (backends/hotcold.py)."""
    n, mine = len(stats), stats[0]
    cold = [s["cold"] for s in stats]
    if mine["presence"]:   # the hot rows two or more ranks touch, from every rank's sketch of its hot rows
        hot_rows = [s["hot_rows"] for s in stats]
        sketches = [s["hot_sketch"] for s in stats]
        union = union_size(sketches, hot_rows)
        only = [min(r, union - o) for r, o in zip(hot_rows, others_union_sizes(sketches, hot_rows))]
        slab = presence_words(mine["hot_k"], n) * 4 + (union - sum(only)) * first["width"] * first["itemsize"]
        cold = [c + round(x) for c, x in zip(cold, only)]   # a hot row only one rank touched goes cold
    else:
        slab = mine["hot_k"] * (first["width"] + 1) * first["itemsize"]
    return slab, cold

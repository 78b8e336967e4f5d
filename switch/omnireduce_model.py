"""Traffic models of OmniReduce, per worker and tensor (for tests and benchmarks).

`paper_model`: the OmniReduce paper's (Fei et al., SIGCOMM'21): a worker uploads its own non-zero blocks plus 4 bytes
of metadata per block and downloads every block of the union.
`wire_model`: what commlib's UDP protocol puts on the wire without loss, to the byte: one header
per packet (the paper's 4 bytes of `next` included) and, on an authenticated job, its MAC,
header-only packets for all-zero bootstrap blocks and results, each result's stamp (the
aggregator's share of the round, for the latency breakdown), and the silent workers' ACK every
ACK_EVERY rounds. commlib.traffic's omnireduce model counts with the same constants.
"""
import numpy as np

from commlib._native import lib

# switch/csrc/omnireduce.h's
HEADER = lib.OMR_HDR_BYTES
MAC = lib.OMR_MAC_BYTES          # the packet MAC of an authenticated job: its nonce counter and tag
STAMP = lib.OMR_STAMP_BYTES      # on every result
ACK_EVERY = lib.OMR_ACK_EVERY    # a silent worker acknowledges every this many rounds


def paper_model(own_blocks, union_blocks, block_bytes):
    """(upload, download) bytes of the model in OMNIREDUCE.md."""
    return own_blocks * (block_bytes + 4), union_blocks * block_bytes


def wire_model(masks, nelems, block, columns, itemsize=4, authenticated=True):
    """Exact bytes per worker [(sent, received)] for per-worker block masks (lossless run)."""
    header = HEADER + (MAC if authenticated else 0)   # what every packet carries besides the block
    masks = [np.asarray(m, dtype=bool) for m in masks]
    n, nb = len(masks), masks[0].size
    ncols = min(columns, nb)
    last = nelems - (nb - 1) * block                  # elements in the last block

    def payload(b):
        return (last if b == nb - 1 else block) * itemsize

    sent, recv = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    stack = np.stack(masks)
    for j in range(ncols):
        col = stack[:, j::ncols]                     # workers x blocks of this column
        blocks = np.arange(j, nb, ncols)
        # bootstrap: everyone sends the first block, a bare header when it is zero
        sent += header + col[:, 0] * payload(j)
        recv += header + STAMP + (payload(j) if col[:, 0].any() else 0)
        union = np.nonzero(col[:, 1:].any(axis=0))[0] + 1   # later rounds, in order
        for k, pos in enumerate(union, start=1):         # round k: block blocks[pos]
            # after result k-1 (count = k) the contributors send, the others may ACK
            contributors = col[:, pos]
            sent += contributors * (header + payload(blocks[pos]))
            if k % ACK_EVERY == 0:
                sent += ~contributors * header
            recv += header + STAMP + payload(blocks[pos])
    return list(zip(sent.tolist(), recv.tolist()))

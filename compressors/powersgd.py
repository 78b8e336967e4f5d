"""powersgd: rank-r approximation by one power iteration per step (Vogels et al.), with PyTorch
PowerSGD's semantics: P = M Q, allreduce P, orthogonalize, Q = M^T P, allreduce Q / N, M ~ P Q^T,
Q warm-started from the last step, error feedback against the averaged approximation."""
import torch

from commlib.compressors.base import (UNCHANGED, Compressor, Ctx, allreduce_all, as_torch, finite, is_int, is_number,
                                      register, work_dtype)
from commlib.errors import ConfigError


def orthogonalize(m, epsilon=0.0):
    """Orthonormal columns spanning m's (a zero column stays zero instead of becoming NaN)."""
    if m.shape[1] == 1:
        return m / (m.norm() + epsilon).clamp_min(torch.finfo(m.dtype).tiny)
    return torch.linalg.qr(m).Q


@register
class PowerSGD(Compressor):
    """Tuning guide (the options of torch.distributed's PowerSGDState):

    rank (matrix_approximation_rank): 1 is often enough; 2-4 recovers accuracy on hard models;
      bytes per step are (rows + cols) * rank instead of rows * cols.
    start_iter (start_powerSGD_iter): plain allreduce for each tensor's first start_iter steps;
      PyTorch recommends ~10% of training (its default is 1000); commlib's default 0 compresses
      at once, like GRACE.
    min_compression_rate: a matrix is compressed only if (rows + cols) * rank * rate < rows * cols
      (PyTorch's 2); smaller matrices and every 1-D tensor go through a plain allreduce.
    warm_start: reuse last step's Q (one power iteration per step accumulates into a good basis);
      False draws a fresh Q each step.
    orthogonalization_epsilon: added to norms (PyTorch's default 0).
    The initial Q comes from a generator seeded by (seed, name): identical on every rank, as it
    must be since the P's of all ranks are summed. Error feedback is the powersgd memory
    (default; memory=none turns it off). Input is viewed as (shape[0], -1).
    """
    name = "powersgd"
    payload = "summable"
    default_memory = "powersgd"
    state_attrs = Compressor.state_attrs + ("qs",)

    def __init__(self, rank=1, start_iter=0, min_compression_rate=2.0, warm_start=True,
                 orthogonalization_epsilon=0.0, **common):
        super().__init__(**common)
        if not (is_int(rank) and rank >= 1):
            raise ConfigError(f"powersgd rank must be an int >= 1, got {rank!r}")
        if not (is_int(start_iter) and start_iter >= 0):
            raise ConfigError(f"powersgd start_iter must be an int >= 0, got {start_iter!r}")
        if not (is_number(min_compression_rate) and min_compression_rate > 0):
            raise ConfigError(f"powersgd min_compression_rate must be > 0, got {min_compression_rate!r}")
        self.rank, self.start_iter, self.min_compression_rate = rank, start_iter, float(min_compression_rate)
        if not isinstance(warm_start, bool):   # bool("false") is True
            raise ConfigError(f"powersgd warm_start must be true or false, got {warm_start!r}")
        if not (is_number(orthogonalization_epsilon) and orthogonalization_epsilon >= 0):
            raise ConfigError(f"powersgd orthogonalization_epsilon must be >= 0, got {orthogonalization_epsilon!r}")
        self.warm_start, self.orthogonalization_epsilon = warm_start, float(orthogonalization_epsilon)
        self.qs = {}   # tensor name -> (cols, rank) Q of the last step

    def compresses(self, shape):
        """PyTorch's rule: a matrix view whose low-rank factors are min_compression_rate times smaller."""
        if len(shape) < 2:
            return False
        rows, cols = shape[0], int(torch.Size(shape[1:]).numel())
        return (rows + cols) * self.rank * self.min_compression_rate < rows * cols

    def initial_q(self, m, name, step):
        """This step's orthonormal (cols, rank) Q: last step's (warm start), else drawn from a generator
        seeded by (seed, name): identical on every rank, as it must be since the P's of all ranks are summed."""
        rank = min(self.rank, *m.shape)   # as PyTorch's hook: no more columns than the matrix has rank
        q = self.qs.get(name) if self.warm_start else None
        if q is None or q.shape != (m.shape[1], rank):
            g = self.generator(name, "cpu", shared=True, step=0 if self.warm_start else step)
            q = torch.randn(m.shape[1], rank, generator=g, dtype=torch.float64)
        return orthogonalize(q.to(m), self.orthogonalization_epsilon)

    # GRACE's single-rank compress/decompress: payload (P, Q) for a compressed matrix, else the tensor
    def compress(self, tensor, name="tensor"):
        x, _ = as_torch(tensor, self.name)
        step = self.steps.get(name, 0)
        self.steps[name] = step + 1
        ctx = Ctx(tuple(x.shape), x.dtype, x.device, x.numel(), name, step)
        if not ctx.numel:
            return (), ctx
        w = x.to(ctx.work)
        if step < self.start_iter or not self.compresses(ctx.shape):
            return (w.reshape(-1),), ctx
        m = w.reshape(ctx.shape[0], -1)
        p = orthogonalize(m @ self.initial_q(m, name, step), self.orthogonalization_epsilon)
        q = self.qs[name] = m.T @ p
        return (p.reshape(-1), q.reshape(-1)), ctx

    def decompress(self, payload, ctx):
        if len(payload) == 2:
            p = payload[0].view(ctx.shape[0], -1)
            return (p @ payload[1].view(-1, p.shape[1]).T).view(ctx.shape).to(ctx.dtype)
        return super().decompress(payload, ctx)

    def decode(self, payload, ctx):
        return payload[0]

    def reduce_bucket(self, tensors, names, channel, average):
        """Two allreduces for the whole bucket, as PyTorch's PowerSGD hook: the tensors sent whole and
        every matrix's P = M Q in the first, every Q = M^T P (after orthogonalizing P) in the second."""
        channel = self._checked(channel)
        inputs = [as_torch(t, self.name) for t in tensors]
        plain, low_rank = [], []   # (index, flat tensor), (index, name, M, Q)
        with torch.no_grad():
            for i, ((x, _), name) in enumerate(zip(inputs, names)):
                if not x.numel():
                    continue
                step = self.steps.get(name, 0)
                self.steps[name] = step + 1
                w = x.to(work_dtype(x.dtype))
                if step < self.start_iter or not self.compresses(tuple(x.shape)):
                    plain.append((i, w.reshape(-1)))
                else:
                    memory = self.memory if finite(w) else UNCHANGED
                    m = memory.compensate(w.reshape(x.shape[0], -1), name)
                    low_rank.append((i, name, m, self.initial_q(m, name, step), memory))
            ps = [m @ q for _, _, m, q, _ in low_rank]
            sums = allreduce_all(channel, [w for _, w in plain] + [p.reshape(-1) for p in ps])
            outs = {i: total / channel.size if average else total for (i, _), total in zip(plain, sums)}
            ps = [orthogonalize(total.view(p.shape), self.orthogonalization_epsilon)
                  for total, p in zip(sums[len(plain):], ps)]
            qs = allreduce_all(channel, [(m.T @ p).reshape(-1) for (_, _, m, _, _), p in zip(low_rank, ps)])
            for (i, name, m, q, memory), p, total in zip(low_rank, ps, qs):
                q = total.view(q.shape) / channel.size
                approx = p @ q.T
                if finite(q):   # the same on every rank: one rank's Inf or NaN reaches every rank's P and Q
                    self.qs[name] = q
                    memory.update(m, name, self, None, None, approx)
                outs[i] = approx if average else approx * channel.size
            return [restore(outs[i]) if i in outs else restore(x.clone()) for i, (x, restore) in enumerate(inputs)]

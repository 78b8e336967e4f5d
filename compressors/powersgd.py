"""powersgd: rank-r approximation by one power iteration per step (Vogels et al.), with PyTorch
PowerSGD's semantics: P = M Q, allreduce P, orthogonalize, Q = M^T P, allreduce Q / N, M ~ P Q^T,
Q warm-started from the last step, error feedback against the averaged approximation."""
import torch

from commlib.compressors.base import Compressor, Ctx, allreduce, as_torch, check_algorithm, register, work_dtype
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
        if not (isinstance(rank, int) and rank >= 1):
            raise ConfigError(f"powersgd rank must be an int >= 1, got {rank!r}")
        if not (isinstance(start_iter, int) and start_iter >= 0):
            raise ConfigError(f"powersgd start_iter must be an int >= 0, got {start_iter!r}")
        if not min_compression_rate > 0:
            raise ConfigError(f"powersgd min_compression_rate must be > 0, got {min_compression_rate!r}")
        self.rank, self.start_iter, self.min_compression_rate = rank, start_iter, float(min_compression_rate)
        self.warm_start, self.orthogonalization_epsilon = bool(warm_start), float(orthogonalization_epsilon)
        self.qs = {}   # tensor name -> (cols, rank) Q of the last step

    def compresses(self, shape):
        """PyTorch's rule: a matrix view whose low-rank factors are min_compression_rate times smaller."""
        if len(shape) < 2:
            return False
        rows, cols = shape[0], int(torch.Size(shape[1:]).numel())
        return (rows + cols) * self.rank * self.min_compression_rate < rows * cols

    def factorize(self, m, name, step, sum_ranks, size):
        """(P, Q) with M ~ P Q^T, Q averaged over ranks; sum_ranks sums a tensor over ranks."""
        q = self.qs.get(name) if self.warm_start else None
        if q is None or q.shape != (m.shape[1], self.rank):
            seed_step = step if not self.warm_start else 0
            g = self.generator(name, "cpu", shared=True, step=seed_step)
            q = torch.randn(m.shape[1], self.rank, generator=g, dtype=torch.float64)
        q = orthogonalize(q.to(m), self.orthogonalization_epsilon)
        p = orthogonalize(sum_ranks(m @ q), self.orthogonalization_epsilon)
        q = sum_ranks(m.T @ p) / size
        self.qs[name] = q
        return p, q

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
        p, q = self.factorize(w.reshape(ctx.shape[0], -1), name, step, lambda t: t, 1)
        return (p.reshape(-1), q.reshape(-1)), ctx

    def decompress(self, payload, ctx):
        if len(payload) == 2:
            p = payload[0].view(ctx.shape[0], -1)
            return (p @ payload[1].view(-1, p.shape[1]).T).view(ctx.shape).to(ctx.dtype)
        return super().decompress(payload, ctx)

    def decode(self, payload, ctx):
        return payload[0]

    def reduce(self, tensor, name, comm, average):
        check_algorithm(self, comm.algorithm)
        x, restore = as_torch(tensor, self.name)
        if x.numel() == 0:
            return restore(x.clone())
        self.comm_rank = comm.rank
        step = self.steps.get(name, 0)
        self.steps[name] = step + 1
        with torch.no_grad():
            w = x.to(work_dtype(x.dtype))
            if step < self.start_iter or not self.compresses(tuple(x.shape)):
                out = allreduce(comm, w.reshape(-1))
                return restore(out / comm.size if average else out)
            m = self.memory.compensate(w.reshape(x.shape[0], -1), name)
            p, q = self.factorize(m, name, step, lambda t: allreduce(comm, t.reshape(-1)).view(t.shape), comm.size)
            approx = p @ q.T
            self.memory.update(m, name, self, None, None, approx)
            return restore(approx if average else approx * comm.size)

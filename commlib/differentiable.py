"""Allreduce as a differentiable op on torch tensors, as Horovod's is: the gradient of an allreduce
is the allreduce of the incoming gradient with the same op and scaling (each rank's output
depends on every rank's input in the same way)."""
import sys


def wants_grad(tensor):
    """Does autograd need the allreduce of this tensor on its tape?"""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled()


def attach(tensor, out, reduce_grad):
    """`out` (the reduced tensor) on autograd's tape as a function of `tensor`; backward applies
    reduce_grad(grad) (the same allreduce, named after the forward's)."""
    return _allreduce_function().apply(tensor, _Box(out, reduce_grad))


class _Box:
    """Carries the forward's result and the backward reduction past autograd's argument handling."""

    def __init__(self, out, reduce_grad):
        self.out, self.reduce_grad = out, reduce_grad


_FUNCTION = None


def _allreduce_function():
    global _FUNCTION
    if _FUNCTION is None:   # torch is imported only by users who pass torch tensors
        import torch

        class Allreduce(torch.autograd.Function):
            @staticmethod
            def forward(ctx, tensor, box):
                ctx.reduce_grad = box.reduce_grad
                return box.out

            @staticmethod
            def backward(ctx, grad):
                return ctx.reduce_grad(grad.contiguous()), None
        _FUNCTION = Allreduce
    return _FUNCTION

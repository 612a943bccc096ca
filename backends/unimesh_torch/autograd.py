"""The torch backend's autograd pieces: the ``TorchFunctionMode`` that carries JAX's
check_vma tags (which mesh axes a value varies along) through every torch operation of a
program, and the ``torch.autograd.Function`` s of its collectives' rules and of
``DTensor.from_local`` with a spec built in advance. Each class is made once, on first use
(``functools.cache``): torch is imported only then."""

from __future__ import annotations

import functools
from typing import Any

from unimesh.grad_rules import INVARIANT, VMA

from .runtime import import_dist, import_torch

__all__ = ["BLOCK", "LEAF", "NONE", "OPS", "VMA", "dtensor", "from_local_function",
           "move_function", "vjp_function", "vma_mode"]  # fmt: skip

LEAF = "_unimesh_leaf"  # on a DTensor value_and_grad made: the plain leaf of its local block
BLOCK = "_unimesh_block"  # on a shard_map result: the block it was made from
NONE = INVARIANT


@functools.cache
def vma_mode() -> Any:
    """The TorchFunctionMode class of :meth:`TorchBackend.vma_mode`."""
    torch = import_torch()
    from torch.overrides import TorchFunctionMode

    tensor = torch.Tensor
    grad_enabled = torch.is_grad_enabled

    def scan(values: Any, acc: list[Any]) -> None:
        """Into ``acc`` = [union of the tensors' axes, the first tensor's axes, whether two
        tensors differ, whether one needs a gradient], for tensors in lists/tuples too."""
        for v in values:
            if isinstance(v, tensor):
                have = getattr(v, VMA, NONE)
                if acc[1] is None:
                    acc[1] = have
                elif have != acc[1]:
                    acc[2] = True
                if have:
                    acc[0] = acc[0] | have
                if v.requires_grad:
                    acc[3] = True
            elif isinstance(v, (list, tuple)):
                scan(v, acc)

    class VmaMode(TorchFunctionMode):
        def __init__(self, env: Any) -> None:
            super().__init__()
            self.env = env

        def lift(self, v: Any, vma: frozenset[str]) -> Any:
            """``v`` (or the tensors in a list/tuple) made varying along all of ``vma``."""
            if isinstance(v, tensor):
                have = getattr(v, VMA, NONE)
                if have != vma and v.requires_grad:
                    return self.env.pvary(v, vma - have)
                return v
            if isinstance(v, (list, tuple)):
                return type(v)(self.lift(u, vma) for u in v)
            return v

        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            # the common case (tensors and scalars as positional arguments): scan's work
            # inline, as a call and an accumulator per torch operation cost measurably
            vma = first = NONE
            tensors = differ = grad = False
            for v in args:
                if isinstance(v, tensor):
                    have = getattr(v, VMA, NONE)
                    if not tensors:
                        tensors, first = True, have
                    elif have is not first and have != first:
                        differ = True
                    if have and have is not vma:
                        vma = have if not vma else vma | have
                    if v.requires_grad:
                        grad = True
                elif isinstance(v, (list, tuple)):
                    break
            else:
                if not kwargs:
                    if not vma:
                        return func(*args)
                    if differ and grad and grad_enabled():  # a pvary is needed somewhere
                        args = tuple(self.lift(a, vma) for a in args)
                    return tag_all(func(*args), vma)
            acc: list[Any] = [NONE, None, False, False]
            scan(args, acc)
            if kwargs:
                scan(kwargs.values(), acc)
            else:
                kwargs = {}
            vma = acc[0]
            if not vma:
                return func(*args, **kwargs)
            if acc[2] and acc[3] and grad_enabled():  # a pvary is needed somewhere
                args = tuple(self.lift(a, vma) for a in args)
                kwargs = {k: self.lift(v, vma) for k, v in kwargs.items()}
            return tag_all(func(*args, **kwargs), vma)

    def tag_all(out: Any, vma: frozenset[str]) -> Any:
        """``out`` (a tensor, or tensors in a list/tuple) tagged with ``vma``."""
        if isinstance(out, tensor):
            setattr(out, VMA, vma)
        elif isinstance(out, (list, tuple)):
            for o in out:
                if isinstance(o, tensor):
                    setattr(o, VMA, vma)
        return out

    return VmaMode


OPS = {
    "sum": lambda: import_dist().ReduceOp.SUM,
    "max": lambda: import_dist().ReduceOp.MAX,
    "min": lambda: import_dist().ReduceOp.MIN,
}


@functools.cache
def vjp_function() -> Any:
    """One ``torch.autograd.Function`` running a forward and a backward given per call."""
    torch = import_torch()

    class Vjp(torch.autograd.Function):  # type: ignore[name-defined,misc]
        @staticmethod
        def forward(ctx: Any, x: Any, fwd: Any, bwd: Any) -> Any:
            ctx.bwd = bwd
            y = fwd(x)
            return y.view_as(y) if y is x else y

        @staticmethod
        def backward(ctx: Any, ct: Any) -> Any:
            return ctx.bwd(ct), None, None

    return Vjp


def dtensor(local: Any, spec: Any, requires_grad: bool) -> Any:
    """The DTensor of ``local`` with a spec built in advance: the constructor
    ``DTensor.from_local`` ends in, without building the spec on every call. Outside
    torch.compile, only its ``__new__`` (torch's C constructor): ``DTensor.__init__`` does
    nothing there but pass through two wrappers for dynamo and export (1.4 us a call)."""
    from torch.distributed.tensor import DTensor

    if import_torch().compiler.is_compiling():
        return DTensor(local, spec, requires_grad=requires_grad)  # type: ignore[no-untyped-call]
    return DTensor.__new__(DTensor, local, spec, requires_grad=requires_grad)


@functools.cache
def from_local_function() -> Any:
    """``DTensor.from_local``'s autograd function for a spec built in advance: the gradient
    of the block is the cotangent's local tensor, laid out as the result (a Partial result's
    cotangent is made Replicate, as ``from_local`` does)."""
    torch = import_torch()
    from torch.distributed.tensor import DTensor, Replicate

    class FromLocal(torch.autograd.Function):  # type: ignore[name-defined,misc]
        @staticmethod
        def forward(ctx: Any, block: Any, spec: Any) -> Any:
            ctx.spec = spec
            ctx.set_materialize_grads(False)
            return dtensor(block.view_as(block), spec, requires_grad=block.requires_grad)

        @staticmethod
        def backward(ctx: Any, ct: Any) -> Any:
            if isinstance(ct, DTensor):
                want = tuple(Replicate() if p.is_partial() else p for p in ctx.spec.placements)
                if tuple(ct.placements) != want:
                    ct = ct.redistribute(ctx.spec.mesh, want)
                ct = ct.to_local()
            return ct, None

    return FromLocal


@functools.cache
def move_function() -> Any:
    """The ``torch.autograd.Function`` of a reshard's move (``move_with_gradient``)."""
    torch = import_torch()
    from torch.autograd.function import once_differentiable

    class Move(torch.autograd.Function):  # type: ignore[misc,name-defined]
        """A reshard's move of this rank's blocks; its backward is the reverse move."""

        @staticmethod
        def forward(ctx: Any, meta: Any, anchor: Any, *blocks: Any) -> Any:
            devices, forward, _, box = meta
            out = forward(dict(zip(devices, blocks)))
            box["out"] = sorted(out)
            ctx.meta = meta
            ctx.shapes = [(out[d].shape, out[d].dtype, out[d].device) for d in box["out"]]
            ctx.anchor = (anchor.dtype, anchor.device)
            kept = {id(b) for b in blocks}
            return tuple(
                out[d].view_as(out[d]) if id(out[d]) in kept else out[d] for d in box["out"]
            )

        @staticmethod
        @once_differentiable  # the reverse move is not itself recorded: no double backward
        def backward(ctx: Any, *grads: Any) -> Any:
            devices, _, backward, box = ctx.meta
            torch = import_torch()
            cts = {
                d: g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
                for d, g, (shape, dtype, device) in zip(box["out"], grads, ctx.shapes)
            }
            with torch.no_grad():
                got = backward(cts)
            dtype, device = ctx.anchor
            return (None, torch.zeros(0, dtype=dtype, device=device), *(got[d] for d in devices))

    return Move

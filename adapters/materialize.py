"""materialize: evaluate a WeightExpr with torch. Never mutates an input tensor."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from adapters.torchnames import dtype_of
from fxpure.weights import (
    Cast,
    Concat,
    FoldBatchNorm,
    PadTo,
    Permute,
    Reshape,
    Slice,
    Source,
    SumOver,
    WeightExpr,
    sources,
)

Eval = Callable[[WeightExpr], torch.Tensor]


def _fold_bn(e: FoldBatchNorm, ev: Eval) -> torch.Tensor:
    w = ev(e.weight)
    f32 = torch.float32

    def opt(x: WeightExpr | None, fill: float, n: int) -> torch.Tensor:
        return ev(x).to(f32) if x is not None else torch.full((n,), fill, dtype=f32)

    var = ev(e.var).to(f32)
    oc = var.shape[0]
    scale = opt(e.gamma, 1.0, oc) * torch.rsqrt(var + e.eps)
    if e.part == "bias":
        bias = (opt(e.bias, 0.0, oc) - ev(e.mean).to(f32)) * scale + opt(e.beta, 0.0, oc)
        return bias.to(w.dtype)
    k = (1,) * (w.dim() - 2)
    w32 = w.to(f32)
    if not e.transposed:
        return (w32 * scale.reshape(oc, 1, *k)).to(w.dtype)
    # transposed weight: (IC, OC/g, ...) with output channel g*(OC/g)+j at [g*(IC/g)+i, j]
    g = e.groups
    grouped = w32.reshape(g, w.shape[0] // g, w.shape[1], *w.shape[2:])
    return (grouped * scale.reshape(g, 1, w.shape[1], *k)).reshape(w.shape).to(w.dtype)


def _pad_to(e: PadTo, ev: Eval) -> torch.Tensor:
    x = ev(e.x)
    dim = e.dim % x.dim()
    size = x.shape[dim]
    padded = -(-size // e.multiple) * e.multiple
    out = x.new_zeros((*x.shape[:dim], padded, *x.shape[dim + 1 :]))
    out.narrow(dim, 0, size).copy_(x)
    return out


def _sum_over(e: SumOver, ev: Eval) -> torch.Tensor:
    dtype = dtype_of(e.dtype)
    return ev(e.x).to(dtype).sum(dim=e.dims, dtype=dtype)


_RULES: Mapping[type, Callable[[Any, Eval], torch.Tensor]] = {
    Permute: lambda e, ev: ev(e.x).permute(e.dims),
    Reshape: lambda e, ev: ev(e.x).reshape(e.shape),
    Slice: lambda e, ev: ev(e.x).narrow(e.dim, e.start, e.stop - e.start),
    PadTo: _pad_to,
    SumOver: _sum_over,
    Cast: lambda e, ev: ev(e.x).to(dtype_of(e.dtype)),
    Concat: lambda e, ev: torch.cat([ev(x) for x in e.xs], dim=e.dim),
    FoldBatchNorm: _fold_bn,
}


def materialize(
    expr: WeightExpr,
    tensors: Mapping[str, torch.Tensor],
    memo: dict[WeightExpr, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Evaluate ``expr``; ``Source(key)`` reads ``tensors[key]``. The result owns its storage."""
    cache: dict[WeightExpr, torch.Tensor] = {} if memo is None else memo

    def ev(e: WeightExpr) -> torch.Tensor:
        if e in cache:
            return cache[e]
        with torch.no_grad():
            value = tensors[e.key].detach() if isinstance(e, Source) else _RULES[type(e)](e, ev)
        cache[e] = value
        return value

    result = ev(expr)
    owned = result.contiguous()
    ptrs = {tensors[k].untyped_storage().data_ptr() for k in sources(expr)}
    if owned.untyped_storage().data_ptr() in ptrs:
        owned = owned.clone()
    return owned

"""materialize: evaluate a WeightExpr with torch. Never mutates an input tensor."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from adapters.torchnames import dtype_of
from fxpure.weights import (
    Cast,
    Concat,
    Fill,
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
Memo = dict[object, torch.Tensor]


def _fold_bn(e: FoldBatchNorm, ev: Eval, memo: dict[object, torch.Tensor]) -> torch.Tensor:
    w = ev(e.weight)
    f32 = torch.float32
    var = ev(e.var).to(f32)
    oc = var.shape[0]
    key = ("scale", e.var, e.gamma, e.eps)
    scale = memo.get(key)
    if scale is None:
        scale = memo[key] = (
            torch.rsqrt(var + e.eps) if e.gamma is None else ev(e.gamma).to(f32) * torch.rsqrt(var + e.eps)
        )
    if e.part == "bias":
        bias = -ev(e.mean).to(f32) if e.bias is None else ev(e.bias).to(f32) - ev(e.mean).to(f32)
        bias = bias * scale
        return (bias if e.beta is None else bias + ev(e.beta).to(f32)).to(w.dtype)
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


_RULES: Mapping[type, Callable[[Any, Eval, Memo], torch.Tensor]] = {
    Permute: lambda e, ev, _: ev(e.x).permute(e.dims),
    Reshape: lambda e, ev, _: ev(e.x).reshape(e.shape),
    Slice: lambda e, ev, _: ev(e.x).narrow(e.dim, e.start, e.stop - e.start),
    PadTo: lambda e, ev, _: _pad_to(e, ev),
    SumOver: lambda e, ev, _: _sum_over(e, ev),
    Cast: lambda e, ev, _: ev(e.x).to(dtype_of(e.dtype)),
    Concat: lambda e, ev, _: torch.cat([ev(x) for x in e.xs], dim=e.dim),
    Fill: lambda e, _, __: torch.full(e.shape, e.value, dtype=dtype_of(e.dtype)),
    FoldBatchNorm: _fold_bn,
}


def materialize(expr: WeightExpr, tensors: Mapping[str, torch.Tensor], memo: Memo | None = None) -> torch.Tensor:
    """Evaluate ``expr``; ``Source(key)`` reads ``tensors[key]``. The result owns its storage.

    Pass one ``memo`` to several calls to compute shared sub-expressions once.
    """
    cache: Memo = {} if memo is None else memo

    def ev(e: WeightExpr) -> torch.Tensor:
        if isinstance(e, Source):
            return tensors[e.key].detach()
        value = cache.get(e)
        if value is None:
            value = cache[e] = _RULES[type(e)](e, ev, cache)
        return value

    with torch.no_grad():
        owned = ev(expr).contiguous()
    ptrs = {tensors[k].untyped_storage().data_ptr() for k in sources(expr)}
    if owned.untyped_storage().data_ptr() in ptrs:
        owned = owned.clone()
    return owned

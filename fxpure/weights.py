"""WeightExpr: a small closed algebra of derived constants, with spec inference.

Expressions are structural values: equal expressions denote one tensor, so a
rewrite that derives the same weight twice gets one constant. Nothing here
computes data; ``adapters.materialize`` does, once, for live constants only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeAlias, final

from returns.result import Failure, Result, Success

from fxpure.reasons import BadExpr
from fxpure.snapshot import Dim, TensorSpec

FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64"})


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class Source:
    """An existing constant, by the name of the node that holds it."""

    key: str
    spec: TensorSpec


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class Permute:
    """``x.permute(dims)``; inverse: the inverse permutation."""

    x: WeightExpr
    dims: tuple[int, ...]


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class Reshape:
    """``x.reshape(shape)``; inverse: reshape back."""

    x: WeightExpr
    shape: tuple[int, ...]


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class Slice:
    """``x`` narrowed to ``start:stop`` along ``dim``."""

    x: WeightExpr
    dim: int
    start: int
    stop: int


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class PadTo:
    """``x`` zero-padded at the end of ``dim`` to a multiple of ``multiple``."""

    x: WeightExpr
    dim: int
    multiple: int


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class SumOver:
    """``x`` summed over ``dims`` (dropped), accumulated and returned as ``dtype``."""

    x: WeightExpr
    dims: tuple[int, ...]
    dtype: str


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class Cast:
    """``x.to(dtype)``."""

    x: WeightExpr
    dtype: str


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class Concat:
    """``torch.cat(xs, dim)``."""

    xs: tuple[WeightExpr, ...]
    dim: int


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class Fill:
    """A new tensor of ``shape`` holding ``value`` everywhere (e.g. a per-tensor scale per channel)."""

    shape: tuple[int, ...]
    value: float
    dtype: str


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class FoldBatchNorm:
    """Conv weight or bias with an eval-mode batch norm folded in.

    ``part="weight"``: ``w * gamma / sqrt(var + eps)`` per output channel, laid
    out for a (transposed, grouped) conv weight. ``part="bias"``:
    ``(b - mean) * gamma / sqrt(var + eps) + beta``. Computed in float32 and
    cast back to the weight's dtype. Missing gamma/beta/bias mean 1/0/0.
    """

    part: Literal["weight", "bias"]
    weight: WeightExpr
    bias: WeightExpr | None
    mean: WeightExpr
    var: WeightExpr
    gamma: WeightExpr | None
    beta: WeightExpr | None
    eps: float
    transposed: bool
    groups: int


WeightExpr: TypeAlias = Source | Permute | Reshape | Slice | PadTo | SumOver | Cast | Concat | Fill | FoldBatchNorm


def _bad(detail: str) -> Result[TensorSpec, BadExpr]:
    return Failure(BadExpr(node="<expr>", detail=detail))


def _static(spec: TensorSpec) -> tuple[int, ...] | None:
    dims = tuple(d for d in spec.shape if isinstance(d, int))
    return dims if len(dims) == len(spec.shape) else None


def _norm_dim(dim: int, rank: int) -> int | None:
    d = dim + rank if dim < 0 else dim
    return d if 0 <= d < rank else None


def out_channels(weight: TensorSpec, *, transposed: bool, groups: int) -> Dim:
    """Output channels of a conv weight (OC, IC/g, ...) or transposed (IC, OC/g, ...).

    >>> out_channels(TensorSpec(shape=(8, 2, 3, 3), dtype="float32"), transposed=True, groups=2)
    4
    """
    if not transposed:
        return weight.shape[0]
    d = weight.shape[1]
    return d * groups if isinstance(d, int) else d


def _permute(e: Permute) -> Result[TensorSpec, BadExpr]:
    def go(s: TensorSpec) -> Result[TensorSpec, BadExpr]:
        if sorted(e.dims) != list(range(len(s.shape))):
            return _bad(f"permute {e.dims} does not fit rank {len(s.shape)}")
        return Success(TensorSpec(shape=tuple(s.shape[d] for d in e.dims), dtype=s.dtype))

    return infer_spec(e.x).bind(go)


def _reshape(e: Reshape) -> Result[TensorSpec, BadExpr]:
    def go(s: TensorSpec) -> Result[TensorSpec, BadExpr]:
        n = 1
        for d in e.shape:
            n *= d
        if _static(s) is None or n != s.numel:
            return _bad(f"cannot reshape {s.shape} to {e.shape}")
        return Success(TensorSpec(shape=e.shape, dtype=s.dtype))

    return infer_spec(e.x).bind(go)


def _slice(e: Slice) -> Result[TensorSpec, BadExpr]:
    def go(s: TensorSpec) -> Result[TensorSpec, BadExpr]:
        d = _norm_dim(e.dim, len(s.shape))
        size = s.shape[d] if d is not None else None
        if d is None or not isinstance(size, int) or not 0 <= e.start <= e.stop <= size:
            return _bad(f"slice {e.start}:{e.stop} on dim {e.dim} does not fit {s.shape}")
        shape = s.shape[:d] + (e.stop - e.start,) + s.shape[d + 1 :]
        return Success(TensorSpec(shape=shape, dtype=s.dtype))

    return infer_spec(e.x).bind(go)


def _pad_to(e: PadTo) -> Result[TensorSpec, BadExpr]:
    def go(s: TensorSpec) -> Result[TensorSpec, BadExpr]:
        d = _norm_dim(e.dim, len(s.shape))
        size = s.shape[d] if d is not None else None
        if d is None or not isinstance(size, int) or e.multiple < 1:
            return _bad(f"cannot pad dim {e.dim} of {s.shape} to a multiple of {e.multiple}")
        padded = -(-size // e.multiple) * e.multiple
        return Success(TensorSpec(shape=s.shape[:d] + (padded,) + s.shape[d + 1 :], dtype=s.dtype))

    return infer_spec(e.x).bind(go)


def _sum_over(e: SumOver) -> Result[TensorSpec, BadExpr]:
    def go(s: TensorSpec) -> Result[TensorSpec, BadExpr]:
        dims = {_norm_dim(d, len(s.shape)) for d in e.dims}
        if None in dims:
            return _bad(f"sum over {e.dims} does not fit rank {len(s.shape)}")
        shape = tuple(x for i, x in enumerate(s.shape) if i not in dims)
        return Success(TensorSpec(shape=shape, dtype=e.dtype))

    return infer_spec(e.x).bind(go)


def _cast(e: Cast) -> Result[TensorSpec, BadExpr]:
    return infer_spec(e.x).map(lambda s: TensorSpec(shape=s.shape, dtype=e.dtype))


def _concat(e: Concat) -> Result[TensorSpec, BadExpr]:
    specs: list[TensorSpec] = []
    for x in e.xs:
        r = infer_spec(x)
        if isinstance(r, Failure):
            return r
        specs.append(r.unwrap())
    if not specs:
        return _bad("concat of nothing")
    first = specs[0]
    d = _norm_dim(e.dim, len(first.shape))
    if d is None:
        return _bad(f"concat dim {e.dim} does not fit rank {len(first.shape)}")
    rest = [s.shape[:d] + s.shape[d + 1 :] for s in specs]
    sizes = [s.shape[d] for s in specs]
    if any(r != rest[0] for r in rest) or any(s.dtype != first.dtype for s in specs):
        return _bad("concat of mismatched shapes or dtypes")
    if not all(isinstance(x, int) for x in sizes):
        return _bad("concat along a symbolic dim")
    total = sum(x for x in sizes if isinstance(x, int))
    return Success(TensorSpec(shape=first.shape[:d] + (total,) + first.shape[d + 1 :], dtype=first.dtype))


def _fold_bn(e: FoldBatchNorm) -> Result[TensorSpec, BadExpr]:
    def go(w: TensorSpec) -> Result[TensorSpec, BadExpr]:
        oc = out_channels(w, transposed=e.transposed, groups=e.groups)
        if _static(w) is None or not isinstance(oc, int):
            return _bad(f"fold needs a static weight shape, got {w.shape}")
        if e.transposed and w.shape[0] % e.groups != 0:
            return _bad(f"weight {w.shape} does not split into {e.groups} groups")
        if w.dtype not in FLOAT_DTYPES:
            return _bad(f"fold needs a floating weight, got {w.dtype}")
        for part in (e.bias, e.mean, e.var, e.gamma, e.beta):
            r = infer_spec(part) if part is not None else Success(TensorSpec(shape=(oc,), dtype=w.dtype))
            if isinstance(r, Failure):
                return r
            if r.unwrap().shape != (oc,):
                return _bad(f"per-channel operand {r.unwrap().shape} does not match {oc} channels")
        shape = w.shape if e.part == "weight" else (oc,)
        return Success(TensorSpec(shape=shape, dtype=w.dtype))

    return infer_spec(e.weight).bind(go)


def infer_spec(expr: WeightExpr) -> Result[TensorSpec, BadExpr]:
    """Shape and dtype of an expression, or why it is ill-typed; pure, no data.

    >>> w = Source(key="w", spec=TensorSpec(shape=(4, 3), dtype="int8"))
    >>> infer_spec(PadTo(x=Permute(x=w, dims=(1, 0)), dim=0, multiple=4)).unwrap().shape
    (4, 4)
    """
    match expr:
        case Source():
            return Success(expr.spec)
        case Permute():
            return _permute(expr)
        case Reshape():
            return _reshape(expr)
        case Slice():
            return _slice(expr)
        case PadTo():
            return _pad_to(expr)
        case SumOver():
            return _sum_over(expr)
        case Cast():
            return _cast(expr)
        case Concat():
            return _concat(expr)
        case Fill():
            return Success(TensorSpec(shape=expr.shape, dtype=expr.dtype))
        case FoldBatchNorm():
            return _fold_bn(expr)


def sources(expr: WeightExpr) -> frozenset[str]:
    """Keys of the existing constants an expression reads.

    >>> s = TensorSpec(shape=(2,), dtype="float32")
    >>> sorted(sources(Concat(xs=(Source(key="a", spec=s), Source(key="b", spec=s)), dim=0)))
    ['a', 'b']
    """
    match expr:
        case Source():
            return frozenset({expr.key})
        case Permute() | Reshape() | Slice() | PadTo() | SumOver() | Cast():
            return sources(expr.x)
        case Concat():
            return frozenset().union(*(sources(x) for x in expr.xs))
        case Fill():
            return frozenset()
        case FoldBatchNorm():
            parts = (expr.weight, expr.bias, expr.mean, expr.var, expr.gamma, expr.beta)
            return frozenset().union(*(sources(p) for p in parts if p is not None))


def children(expr: WeightExpr) -> tuple[WeightExpr, ...]:
    """The expressions ``expr`` is computed from, in field order."""
    match expr:
        case Source() | Fill():
            return ()
        case Permute() | Reshape() | Slice() | PadTo() | SumOver() | Cast():
            return (expr.x,)
        case Concat():
            return expr.xs
        case FoldBatchNorm():
            parts = (expr.weight, expr.bias, expr.mean, expr.var, expr.gamma, expr.beta)
            return tuple(p for p in parts if p is not None)


def subexpressions(expr: WeightExpr) -> frozenset[WeightExpr]:
    """``expr`` and every expression inside it.

    >>> s = Source(key="w", spec=TensorSpec(shape=(4,), dtype="int8"))
    >>> subexpressions(Cast(x=s, dtype="float32")) == {s, Cast(x=s, dtype="float32")}
    True
    """
    seen: set[WeightExpr] = set()
    todo = [expr]
    while todo:
        e = todo.pop()
        if e not in seen:
            seen.add(e)
            todo.extend(children(e))
    return frozenset(seen)


def inverse(expr: WeightExpr, y: WeightExpr) -> Result[WeightExpr, BadExpr]:
    """Given ``y`` equal to ``expr``'s value, an expression for ``expr.x``.

    Exact inverses exist for the layout ops (Permute, Reshape, PadTo); the rest
    lose information and fail.

    >>> w = Source(key="w", spec=TensorSpec(shape=(3, 5), dtype="int8"))
    >>> padded = PadTo(x=w, dim=0, multiple=4)
    >>> infer_spec(inverse(padded, padded).unwrap()).unwrap().shape
    (3, 5)
    """
    match expr:
        case Permute():
            back = tuple(sorted(range(len(expr.dims)), key=lambda i: expr.dims[i]))
            return Success(Permute(x=y, dims=back))
        case Reshape() | PadTo():
            inner = expr.x
            return infer_spec(inner).bind(lambda s: _undo_shape(expr, y, s))
        case _:
            return Failure(BadExpr(node="<expr>", detail=f"{type(expr).__name__} has no inverse"))


def _undo_shape(expr: Reshape | PadTo, y: WeightExpr, s: TensorSpec) -> Result[WeightExpr, BadExpr]:
    dims = _static(s)
    if dims is None:
        return Failure(BadExpr(node="<expr>", detail=f"cannot invert over symbolic shape {s.shape}"))
    if isinstance(expr, Reshape):
        return Success(Reshape(x=y, shape=dims))
    d = _norm_dim(expr.dim, len(dims))
    if d is None:
        return Failure(BadExpr(node="<expr>", detail=f"dim {expr.dim} does not fit {dims}"))
    return Success(Slice(x=y, dim=d, start=0, stop=dims[d]))


def unpack(expr: WeightExpr, y: WeightExpr) -> Result[tuple[WeightExpr, WeightExpr], BadExpr]:
    """Peel the layout ops (Permute, Reshape, PadTo) off ``expr``, whose value is ``y``: the inner
    expression and one that recomputes it from ``y``. Evaluating both proves a packing lossless.

    >>> w = Source(key="w", spec=TensorSpec(shape=(6, 1, 3, 3), dtype="int8"))
    >>> packed = PadTo(x=Reshape(x=Permute(x=w, dims=(2, 3, 1, 0)), shape=(3, 3, 6)), dim=2, multiple=4)
    >>> inner, back = unpack(packed, Source(key="packed", spec=infer_spec(packed).unwrap())).unwrap()
    >>> inner == w, infer_spec(back).unwrap().shape
    (True, (6, 1, 3, 3))
    """
    if not isinstance(expr, Permute | Reshape | PadTo):
        return Success((expr, y))
    inner = expr.x
    return inverse(expr, y).bind(lambda x: unpack(inner, x))

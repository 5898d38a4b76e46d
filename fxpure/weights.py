"""WeightExpr: a small closed algebra of derived constants, with spec inference.

A rule author composes derived weights from this vocabulary and writes no adapter
code: layout (``Permute``, ``Reshape``, ``Unsqueeze``, ``Slice``, ``PadTo``, ``Concat``),
reductions (``SumOver``, ``MaxOver``), ``Cast``, constants (``Fill``), elementwise arithmetic
(``Binary`` add/sub/mul/div/maximum/minimum and the bitwise and/or/xor and shifts, with
broadcasting, ``Unary`` sqrt/rsqrt/neg/reciprocal/abs/sign), the matrix product (``MatMul``) and
``Quantize``/``Dequantize`` with per-tensor or per-channel parameters, and ``Within``, a
precondition on the values of its operand (which the adapter checks on the data). Folds are
built from these (:func:`fold_batch_norm`).

Expressions are structural values: equal expressions denote one tensor, so a rewrite
that derives the same weight twice gets one constant, and a subexpression shared by
several constants is computed once. Nothing here computes data;
``adapters.materialize`` does, once, for live constants only.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from operator import attrgetter
from typing import Literal, TypeAlias, final, get_args

from returns.result import Failure, Result, Success

from fxpure.reasons import BadExpr
from fxpure.snapshot import SMALL_VALUES, Dim, TensorSpec

FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64"})
INT_DTYPES = frozenset({"int8", "uint8", "int16", "int32", "int64"})
DTYPES = FLOAT_DTYPES | INT_DTYPES | {"bool"}  # what an expression computes in, spelled as torch names them
INT_RANGES: Mapping[str, tuple[int, int]] = {
    "int8": (-(2**7), 2**7 - 1),
    "uint8": (0, 2**8 - 1),
    "int16": (-(2**15), 2**15 - 1),
    "int32": (-(2**31), 2**31 - 1),
    "int64": (-(2**63), 2**63 - 1),
}
BinaryOp: TypeAlias = Literal[
    "add",
    "sub",
    "mul",
    "div",
    "maximum",
    "minimum",
    "bitwise_and",
    "bitwise_or",
    "bitwise_xor",
    "shift_left",
    "shift_right",
]
BITWISE = frozenset({"bitwise_and", "bitwise_or", "bitwise_xor", "shift_left", "shift_right"})
"""The ``Binary`` ops of integers (and, but for the shifts, of bools), as torch's ``bitwise_*`` computes them."""
UnaryOp: TypeAlias = Literal["sqrt", "rsqrt", "neg", "reciprocal", "abs", "sign"]
_BINARY_OPS, _UNARY_OPS = frozenset(get_args(BinaryOp)), frozenset(get_args(UnaryOp))
# the node of a BadExpr about an expression alone; a rule's planner relocates it at its anchor
EXPR_NODE = "<expr>"


# each expression class's fields, read in one call (keys are built for every hash and comparison)
_FIELDS: dict[type, Callable[[object], tuple[object, ...]]] = {}


class _Expr:
    """Structural equality with the hash computed once: expressions are dictionary keys all along
    a rewrite (one constant per distinct expression, one evaluation per shared subexpression), and
    a recomputed hash would walk the whole tree each time."""

    __slots__ = ("_hash", "_leaves", "_sources", "_spec")
    _hash: int
    _spec: TensorSpec | BadExpr  # infer_spec's answer, kept once computed
    _sources: frozenset[str]  # sources' answer, kept once computed
    _leaves: frozenset[Source]  # source_exprs' answer, kept once computed

    def _key(self) -> tuple[object, ...]:
        cls = type(self)
        get = _FIELDS.get(cls)
        if get is None:
            # a tuple: every expression (a dataclass) has two fields or more
            get = _FIELDS[cls] = attrgetter(*vars(cls)["__dataclass_fields__"])
        return (cls, *get(self))

    def __hash__(self) -> int:
        try:
            return self._hash
        except AttributeError:
            h = hash(self._key())
            object.__setattr__(self, "_hash", h)
            return h

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, _Expr) or type(other) is not type(self) or hash(self) != hash(other):
            return False
        return self._key() == other._key()


@final
@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Source(_Expr):
    """An existing constant, by the name of the node that holds it."""

    key: str
    spec: TensorSpec


@final
@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Permute(_Expr):
    """``x.permute(dims)``; inverse: the inverse permutation."""

    x: WeightExpr
    dims: tuple[int, ...]


@final
@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Reshape(_Expr):
    """``x.reshape(shape)``; inverse: reshape back."""

    x: WeightExpr
    shape: tuple[int, ...]


@final
@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Unsqueeze(_Expr):
    """``x.unsqueeze(dim)``: a new dim of size 1 (for broadcasting, or a conv1d weight as conv2d)."""

    x: WeightExpr
    dim: int


@final
@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Slice(_Expr):
    """``x`` narrowed to ``start:stop`` along ``dim``."""

    x: WeightExpr
    dim: int
    start: int
    stop: int


@final
@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class PadTo(_Expr):
    """``x`` zero-padded at the end of ``dim`` to a multiple of ``multiple``."""

    x: WeightExpr
    dim: int
    multiple: int


@final
@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class SumOver(_Expr):
    """``x`` summed over ``dims`` (one or more, each once; dropped), accumulated and returned as ``dtype``."""

    x: WeightExpr
    dims: tuple[int, ...]
    dtype: str


@final
@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class MaxOver(_Expr):
    """The greatest element of ``x`` over ``dims`` (one or more, each once; dropped), in ``x``'s dtype
    (torch's ``amax``): with ``Unary("abs")``, a per-channel quantization scale ``amax(|w|) / 127``."""

    x: WeightExpr
    dims: tuple[int, ...]


@final
@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Cast(_Expr):
    """``x.to(dtype)``. A float cast to an integer dtype must hold values that dtype holds once
    truncated: torch leaves the others undefined (300.0 or NaN as int8), and the adapter declines
    such a plan ``value-range``."""

    x: WeightExpr
    dtype: str


@final
@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Concat(_Expr):
    """``torch.cat(xs, dim)``."""

    xs: tuple[WeightExpr, ...]
    dim: int


@final
@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Fill(_Expr):
    """A new tensor of ``shape`` holding ``value`` everywhere (a whole number in range for an integer
    ``dtype``); ``shape=()`` is a scalar."""

    shape: tuple[int, ...]
    value: float
    dtype: str

    def _key(self) -> tuple[object, ...]:
        # -0.0 == 0.0 in Python, but not as a tensor (1 / x): the sign is part of the value
        v = self.value  # (an int's sign without a float of it: one past float64's range has none)
        sign = math.copysign(1.0, v) if isinstance(v, float) else -1.0 if v < 0 else 1.0
        return (Fill, self.shape, v, sign, self.dtype)


@final
@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Binary(_Expr):
    """Elementwise ``a (op) b`` with numpy broadcasting; both operands of one dtype (``Cast`` first),
    a floating one to ``div``. ``maximum`` and ``minimum`` are torch's (a NaN in either operand is
    the result): ``maximum`` with a ``Fill`` floors a value, ``minimum`` caps it, and the two clamp it.
    The :data:`BITWISE` ops take integers (``bitwise_and``, ``_or`` and ``_xor`` bools too) and are
    torch's ``bitwise_*``: two's complement, so ``w & 15`` is an int4 value's nibble, and ``a << 4 |
    b`` packs two; ``shift_left`` by a negative amount or the dtype's width or more is 0,
    ``shift_right`` so fills with the sign (arithmetic for signed dtypes)."""

    op: BinaryOp
    a: WeightExpr
    b: WeightExpr


@final
@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Unary(_Expr):
    """Elementwise ``op(x)``; sqrt, rsqrt and reciprocal need a floating ``x``, neg, abs and sign a
    numeric one (not bool)."""

    op: UnaryOp
    x: WeightExpr


@final
@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class MatMul(_Expr):
    """The matrix product ``a @ b`` (torch's ``mm``; ``mv`` for a vector ``b``): ``a`` of shape
    ``(m, k)`` by ``b`` of shape ``(k, n)``, giving ``(m, n)``, or by a vector ``(k,)``, giving
    ``(m,)`` (a bias through a weight: ``W2 @ b1``). Both operands of one numeric dtype (``Cast``
    first; not bool), and computed in it, as torch's CPU kernel computes it: an integer product
    wraps, a float16 one is rounded to float16 (a rule that wants float32 accumulation casts its
    operands to float32 and the product back)."""

    a: WeightExpr
    b: WeightExpr


@final
@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Quantize(_Expr):
    """``clamp(round(x * (1 / scale)) + zero_point, quant_min, quant_max)`` as ``dtype`` (torch's
    ``quantize_per_channel`` and ``quantize_per_tensor.tensor``; the clamp exact, also at the ends
    of int32's range; a NaN before the cast, of ``x`` or of ``0 / 0``: the adapter declines
    ``value-range``), in a range ``dtype`` holds; ``axis=None``: one scale and zero point (shape
    ``()`` or ``(1,)``), else one per index of dim ``axis``."""

    x: WeightExpr
    scale: WeightExpr
    zero_point: WeightExpr
    axis: int | None
    quant_min: int
    quant_max: int
    dtype: str


@final
@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Dequantize(_Expr):
    """``(x - zero_point) * scale`` as ``dtype``; parameters laid out as for :class:`Quantize`."""

    x: WeightExpr
    scale: WeightExpr
    zero_point: WeightExpr
    axis: int | None
    dtype: str = "float32"


@final
@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Within(_Expr):
    """``x`` itself, on the condition that every value of it lies in ``[low, high]``: a precondition
    on the DATA of a constant, which planning cannot see (the int4 values a packing puts in a nibble,
    say). The adapter computes every new constant before it applies anything, and declines a plan
    one of whose ``Within`` fails (``value-range``, at ``plan.<constant>``; NaN is in no range), so
    nothing is wrapped or clamped silently. A planner that writes one declares ``value-range`` among
    its codes (``rule(..., codes=("value-range",))``).

    >>> w = Source(key="w", spec=TensorSpec(shape=(4, 8), dtype="int8"))
    >>> infer_spec(Within(x=w, low=-8, high=7)).unwrap()
    TensorSpec(shape=(4, 8), dtype='int8')
    """

    x: WeightExpr
    low: float
    high: float


WeightExpr: TypeAlias = (
    Source
    | Permute
    | Reshape
    | Unsqueeze
    | Slice
    | PadTo
    | SumOver
    | MaxOver
    | Cast
    | Concat
    | Fill
    | Binary
    | Unary
    | MatMul
    | Quantize
    | Dequantize
    | Within
)


Inferred: TypeAlias = TensorSpec | BadExpr
"""A spec, or why there is none (plain values: inference runs on every derived weight of every plan)."""


def _bad(detail: str) -> BadExpr:
    return BadExpr(node=EXPR_NODE, detail=detail)


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


def _permute(e: Permute, s: TensorSpec) -> Inferred:
    if sorted(e.dims) != list(range(len(s.shape))):
        return _bad(f"permute {e.dims} does not fit rank {len(s.shape)}")
    return TensorSpec(shape=tuple(s.shape[d] for d in e.dims), dtype=s.dtype)


def _sizes(shape: tuple[object, ...]) -> bool:
    """Every size a whole number, none negative (a symbolic size has no tensor to make)."""
    return all(type(d) is int and d >= 0 for d in shape)


def _reshape(e: Reshape, s: TensorSpec) -> Inferred:
    if _static(s) is None or not _sizes(e.shape) or math.prod(e.shape) != s.numel:
        return _bad(f"cannot reshape {s.shape} to {e.shape}")
    return TensorSpec(shape=e.shape, dtype=s.dtype)


def _unsqueeze(e: Unsqueeze, s: TensorSpec) -> Inferred:
    d = _norm_dim(e.dim, len(s.shape) + 1)
    if d is None:
        return _bad(f"unsqueeze at {e.dim} does not fit rank {len(s.shape)}")
    return TensorSpec(shape=(*s.shape[:d], 1, *s.shape[d:]), dtype=s.dtype)


def _slice(e: Slice, s: TensorSpec) -> Inferred:
    d = _norm_dim(e.dim, len(s.shape))
    size = s.shape[d] if d is not None else None
    if d is None or not isinstance(size, int) or not 0 <= e.start <= e.stop <= size:
        return _bad(f"slice {e.start}:{e.stop} on dim {e.dim} does not fit {s.shape}")
    return TensorSpec(shape=(*s.shape[:d], e.stop - e.start, *s.shape[d + 1 :]), dtype=s.dtype)


def _pad_to(e: PadTo, s: TensorSpec) -> Inferred:
    d = _norm_dim(e.dim, len(s.shape))
    size = s.shape[d] if d is not None else None
    if d is None or not isinstance(size, int) or e.multiple < 1:
        return _bad(f"cannot pad dim {e.dim} of {s.shape} to a multiple of {e.multiple}")
    padded = -(-size // e.multiple) * e.multiple
    return TensorSpec(shape=(*s.shape[:d], padded, *s.shape[d + 1 :]), dtype=s.dtype)


def _sum_over(e: SumOver | MaxOver, s: TensorSpec) -> Inferred:
    what = "sum" if isinstance(e, SumOver) else "max"
    dims = {_norm_dim(d, len(s.shape)) for d in e.dims}
    if None in dims or not e.dims or len(dims) != len(e.dims):  # torch sums all of () and refuses a repeat
        return _bad(f"{what} over {e.dims} does not fit rank {len(s.shape)}")
    if isinstance(e, SumOver) and e.dtype not in DTYPES:
        return _bad(f"sum as {e.dtype!r}")
    if isinstance(e, MaxOver) and any(s.shape[d] == 0 for d in dims if d is not None):  # (a sum of nothing is 0)
        return _bad(f"max over {e.dims} of the empty dims of {s.shape}")
    dtype = e.dtype if isinstance(e, SumOver) else s.dtype
    return TensorSpec(shape=tuple(x for i, x in enumerate(s.shape) if i not in dims), dtype=dtype)


def _concat(e: Concat) -> Inferred:
    specs: list[TensorSpec] = []
    for x in e.xs:
        r = _spec_of(x)
        if isinstance(r, BadExpr):
            return r
        specs.append(r)
    if not specs:
        return _bad("concat of nothing")
    first = specs[0]
    d = _norm_dim(e.dim, len(first.shape))
    if d is None:
        return _bad(f"concat dim {e.dim} does not fit rank {len(first.shape)}")
    if any(len(s.shape) != len(first.shape) for s in specs):
        return _bad(f"concat of ranks {sorted({len(s.shape) for s in specs})}")
    rest = [s.shape[:d] + s.shape[d + 1 :] for s in specs]
    sizes = [s.shape[d] for s in specs]
    if any(r != rest[0] for r in rest) or any(s.dtype != first.dtype for s in specs):
        return _bad("concat of mismatched shapes or dtypes")
    if not all(isinstance(x, int) for x in sizes):
        return _bad("concat along a symbolic dim")
    total = sum(x for x in sizes if isinstance(x, int))
    return TensorSpec(shape=(*first.shape[:d], total, *first.shape[d + 1 :]), dtype=first.dtype)


def broadcast(a: tuple[Dim, ...], b: tuple[Dim, ...]) -> tuple[Dim, ...] | None:
    """The numpy broadcast of two shapes, or None when they do not broadcast.

    >>> broadcast((8, 1, 3), (4, 1)), broadcast((2,), (3,))
    ((8, 4, 3), None)
    """
    out: list[Dim] = []
    for i in range(1, max(len(a), len(b)) + 1):
        x, y = a[-i] if i <= len(a) else 1, b[-i] if i <= len(b) else 1
        if x != y and x != 1 and y != 1:
            return None
        out.append(y if x == 1 else x)
    return tuple(reversed(out))


def _operands(a: WeightExpr, b: WeightExpr) -> tuple[TensorSpec, TensorSpec] | BadExpr:
    """The specs of two operands, or the first one's failure."""
    sa, sb = _spec_of(a), _spec_of(b)
    return sa if isinstance(sa, BadExpr) else sb if isinstance(sb, BadExpr) else (sa, sb)


def _binary(e: Binary) -> Inferred:
    if e.op not in _BINARY_OPS:  # (a hand-written plan's slip the type checker would catch)
        return _bad(f"no binary op {e.op!r}")
    specs = _operands(e.a, e.b)
    if isinstance(specs, BadExpr):
        return specs
    sa, sb = specs
    shape = broadcast(sa.shape, sb.shape)
    if sa.dtype != sb.dtype:
        return _bad(f"{e.op} of {sa.dtype} and {sb.dtype} (cast one first)")
    if e.op == "div" and sa.dtype not in FLOAT_DTYPES:  # torch divides integers into floats
        return _bad(f"div of {sa.dtype} (cast to a float first)")
    if e.op == "sub" and sa.dtype == "bool":  # torch refuses it
        return _bad("sub of bool")
    if e.op in BITWISE and (sa.dtype in FLOAT_DTYPES or (e.op.startswith("shift") and sa.dtype == "bool")):
        return _bad(f"{e.op} of {sa.dtype} (needs an integer dtype{'' if e.op.startswith('shift') else ' or bool'})")
    if shape is None:
        return _bad(f"{e.op} of shapes {sa.shape} and {sb.shape} that do not broadcast")
    return TensorSpec(shape=shape, dtype=sa.dtype)


def _matmul(e: MatMul) -> Inferred:
    specs = _operands(e.a, e.b)
    if isinstance(specs, BadExpr):
        return specs
    sa, sb = specs
    if len(sa.shape) != 2 or len(sb.shape) not in (1, 2):
        return _bad(f"matmul of ranks {len(sa.shape)} and {len(sb.shape)} (a matrix by a matrix or a vector)")
    if sa.dtype != sb.dtype:
        return _bad(f"matmul of {sa.dtype} and {sb.dtype} (cast one first)")
    if sa.dtype == "bool":  # torch's CPU kernel refuses it
        return _bad("matmul of bool")
    if sa.shape[1] != sb.shape[0]:
        return _bad(f"matmul of shapes {sa.shape} and {sb.shape}: inner sizes differ")
    return TensorSpec(shape=(sa.shape[0], *sb.shape[1:]), dtype=sa.dtype)


def _unary(e: Unary, s: TensorSpec) -> Inferred:
    if e.op not in _UNARY_OPS:
        return _bad(f"no unary op {e.op!r}")
    numeric = e.op in ("neg", "abs", "sign")
    if (not numeric or s.dtype == "bool") and s.dtype not in FLOAT_DTYPES:  # torch refuses -bool
        return _bad(f"{e.op} of {s.dtype} (needs a {'numeric' if numeric else 'floating'} dtype)")
    return s


def _qparams(x: TensorSpec, e: Quantize | Dequantize) -> BadExpr | None:
    for role, part in (("scale", e.scale), ("zero point", e.zero_point)):
        r = _spec_of(part)
        if isinstance(r, BadExpr):
            return r
        shape = r.shape
        if e.axis is None and shape not in ((), (1,)):
            return BadExpr(node=EXPR_NODE, detail=f"per-tensor {role} of shape {shape}")
        d = _norm_dim(e.axis, len(x.shape)) if e.axis is not None else None
        if e.axis is not None and (d is None or shape != (x.shape[d],)):
            return BadExpr(node=EXPR_NODE, detail=f"{role} of shape {shape} for axis {e.axis} of {x.shape}")
    return None


def _a_float(value: float) -> bool:
    """A number a float64 holds (or rounds to): not an int past float64's range, 2**1100 say."""
    try:
        float(value)
    except (OverflowError, TypeError, ValueError):
        return False
    return True


def _fits(low: float, high: float, dtype: str) -> bool:
    """Both values are whole numbers the integer ``dtype`` holds, in order."""
    lo, hi = INT_RANGES[dtype]
    return lo <= low <= high <= hi and float(low).is_integer() and float(high).is_integer()


def _quantize(e: Quantize, s: TensorSpec) -> Inferred:
    if s.dtype not in FLOAT_DTYPES or e.dtype not in INT_DTYPES or not _fits(e.quant_min, e.quant_max, e.dtype):
        return _bad(f"quantize {s.dtype} to {e.dtype} in [{e.quant_min}, {e.quant_max}]")
    err = _qparams(s, e)
    return err if err is not None else TensorSpec(shape=s.shape, dtype=e.dtype)


def _dequantize(e: Dequantize, s: TensorSpec) -> Inferred:
    if s.dtype not in INT_DTYPES or e.dtype not in FLOAT_DTYPES:
        return _bad(f"dequantize {s.dtype} to {e.dtype}")
    err = _qparams(s, e)
    return err if err is not None else TensorSpec(shape=s.shape, dtype=e.dtype)


def infer_spec(expr: WeightExpr) -> Result[TensorSpec, BadExpr]:
    """Shape and dtype of an expression, or why it is ill-typed; pure, no data.

    >>> w = Source(key="w", spec=TensorSpec(shape=(4, 3), dtype="int8"))
    >>> infer_spec(PadTo(x=Permute(x=w, dims=(1, 0)), dim=0, multiple=4)).unwrap().shape
    (4, 4)
    >>> infer_spec(Binary(op="mul", a=w, b=Fill(shape=(), value=2.0, dtype="float32"))).failure().message
    'mul of int8 and float32 (cast one first)'
    >>> wt = Permute(x=w, dims=(1, 0))
    >>> infer_spec(MatMul(a=w, b=wt)).unwrap().shape, infer_spec(MatMul(a=w, b=w)).failure().message
    ((4, 4), 'matmul of shapes (4, 3) and (4, 3): inner sizes differ')
    """
    try:
        spec = _spec_of(expr)
        hash(expr)  # (a field of another type: a list for a shape)
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError) as e:
        return Failure(_bad(f"malformed expression ({e})"))
    return Success(spec) if isinstance(spec, TensorSpec) else Failure(spec)


def _spec_of(expr: WeightExpr) -> Inferred:
    """``infer_spec`` as a plain value, computed once per expression."""
    try:
        return expr._spec
    except AttributeError:
        spec = _infer(expr)
        object.__setattr__(expr, "_spec", spec)
        return spec


def _infer(expr: WeightExpr) -> Inferred:
    if isinstance(expr, Source):
        return expr.spec if isinstance(expr.spec, TensorSpec) else _bad(f"source {expr.key} has no spec")
    if isinstance(expr, Fill):
        v = expr.value
        if (
            not _sizes(expr.shape)
            or expr.dtype not in DTYPES
            or (expr.dtype in INT_DTYPES and not _fits(v, v, expr.dtype))
            or not _a_float(v)
        ):
            return _bad(f"fill of shape {expr.shape} with {v!r} as {expr.dtype}")
        return TensorSpec(shape=expr.shape, dtype=expr.dtype)
    if isinstance(expr, Concat):
        return _concat(expr)
    if isinstance(expr, Binary):
        return _binary(expr)
    if isinstance(expr, MatMul):
        return _matmul(expr)
    s = _spec_of(expr.x)  # every other expression is computed from one ``x``
    if isinstance(s, BadExpr):
        return s
    match expr:
        case Cast():
            return (
                TensorSpec(shape=s.shape, dtype=expr.dtype) if expr.dtype in DTYPES else _bad(f"cast to {expr.dtype!r}")
            )
        case Permute():
            return _permute(expr, s)
        case Reshape():
            return _reshape(expr, s)
        case Unsqueeze():
            return _unsqueeze(expr, s)
        case Slice():
            return _slice(expr, s)
        case PadTo():
            return _pad_to(expr, s)
        case SumOver() | MaxOver():
            return _sum_over(expr, s)
        case Unary():
            return _unary(expr, s)
        case Quantize():
            return _quantize(expr, s)
        case Dequantize():
            return _dequantize(expr, s)
        case Within():
            bounds = (expr.low, expr.high)
            if not all(isinstance(b, int | float) and not isinstance(b, bool) for b in bounds):
                return _bad(f"a range of {type(expr.low).__name__} and {type(expr.high).__name__}, no numbers")
            if not all(_a_float(b) for b in bounds):
                return _bad(f"a range [{expr.low}, {expr.high}] past any float's")
            if not expr.low <= expr.high:  # (NaN bounds too: no value lies between them)
                return _bad(f"a range [{expr.low}, {expr.high}] no value lies in")
            real = s.dtype != "bool" and not s.dtype.startswith("complex")  # (values a range orders)
            return s if real else _bad(f"a range of {s.dtype} values")


def children(expr: WeightExpr) -> tuple[WeightExpr, ...]:
    """The expressions ``expr`` is computed from, in field order.

    >>> s = Source(key="w", spec=TensorSpec(shape=(4,), dtype="float32"))
    >>> children(Binary(op="add", a=s, b=Unary(op="neg", x=s))) == (s, Unary(op="neg", x=s))
    True
    """
    out: list[WeightExpr] = []
    for value in expr._key()[1:]:  # the fields' values, in order
        if isinstance(value, tuple):
            out.extend(v for v in value if isinstance(v, WeightExpr))
        elif isinstance(value, WeightExpr):
            out.append(value)
    return tuple(out)


def int_values(expr: WeightExpr) -> tuple[int, ...] | None:
    """The data of a derived constant that fills an integer vector (or scalar) with one value, as
    ``ConstantInfo.values`` holds a captured one's (zero points, say); None for anything else.

    >>> int_values(Fill(shape=(3,), value=0.0, dtype="int64")), int_values(Fill(shape=(3,), value=0.0, dtype="float32"))
    ((0, 0, 0), None)
    """
    if not isinstance(expr, Fill) or not expr.dtype.startswith(("int", "uint")) or len(expr.shape) > 1:
        return None
    n = math.prod(expr.shape)
    return (int(expr.value),) * n if n <= SMALL_VALUES else None


def _stored(value: float, fmt: str) -> float:
    """``value`` rounded to the float format ``fmt`` (struct's ``d``, ``f``, ``e``), inf beyond it."""
    try:
        (out,) = struct.unpack(fmt, struct.pack(fmt, value))
    except OverflowError:
        return math.copysign(math.inf, value)
    return float(out)


def known_values(expr: WeightExpr) -> tuple[int | float, ...] | None:
    """What ``ConstantInfo.values`` would hold of the constant ``expr`` derives, were it captured:
    :func:`int_values`, or the number a 0-d float ``Fill`` stores (as its dtype rounds it; None
    for bfloat16 or NaN; one out of the dtype's range is infinite, as torch stores it).

    >>> f16, vector = Fill(shape=(), value=0.1, dtype="float16"), Fill(shape=(2,), value=1.0, dtype="float32")
    >>> known_values(f16), known_values(vector), known_values(Fill(shape=(), value=-1e9, dtype="float16"))
    ((0.0999755859375,), None, (-inf,))
    """
    if not isinstance(expr, Fill) or expr.shape != () or expr.dtype not in ("float64", "float32", "float16"):
        return int_values(expr)
    if expr.dtype == "float64":
        stored = expr.value
    else:  # torch makes a float16 number a float32 one first, then rounds that: two roundings
        stored = _stored(expr.value, "f")
        stored = _stored(stored, "e") if expr.dtype == "float16" else stored
    return (float(stored),) if stored == stored else None


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


# expressions whose every element is one of their operands' (or a fill, or a pad's zero)
_MOVES = (Source, Permute, Reshape, Unsqueeze, Slice, PadTo, Cast, Concat, Fill, Within)


def moves_data(expr: WeightExpr) -> bool:
    """True when ``expr`` computes nothing from its sources' values: it lays them out (permute,
    reshape, slice, pad, concat), casts them, or fills; an inf it holds is one a source holds, at
    another place. Arithmetic (and quantization) is not.

    >>> w = Source(key="w", spec=TensorSpec(shape=(4, 3), dtype="float32"))
    >>> moves_data(PadTo(x=Permute(x=w, dims=(1, 0)), dim=0, multiple=4)), moves_data(Unary(op="neg", x=w))
    (True, False)
    """
    return all(isinstance(e, _MOVES) for e in subexpressions(expr))


def sources(expr: WeightExpr) -> frozenset[str]:
    """Keys of the existing constants an expression reads.

    >>> s = TensorSpec(shape=(2,), dtype="float32")
    >>> sorted(sources(Concat(xs=(Source(key="a", spec=s), Source(key="b", spec=s)), dim=0)))
    ['a', 'b']
    """
    try:
        return expr._sources  # (kept: a rewrite asks for each new constant's, whose subexpressions repeat)
    except AttributeError:
        keys = frozenset(s.key for s in source_exprs(expr))
        object.__setattr__(expr, "_sources", keys)
        return keys


def source_exprs(expr: WeightExpr) -> frozenset[Source]:
    """The ``Source`` expressions ``expr`` reads (a key read as two specs is two of them).

    >>> s = Source(key="w", spec=TensorSpec(shape=(2,), dtype="float32"))
    >>> source_exprs(Binary(op="mul", a=s, b=Unary(op="neg", x=s))) == {s}
    True
    """
    try:
        return expr._leaves  # (kept: an adapter checks each new constant's, whose subexpressions repeat)
    except AttributeError:
        found = (
            frozenset((expr,)) if isinstance(expr, Source) else frozenset().union(*map(source_exprs, children(expr)))
        )
        object.__setattr__(expr, "_leaves", found)
        return found


def as_dtype(x: WeightExpr, dtype: str) -> WeightExpr:
    """``x`` cast to ``dtype``; ``x`` itself when it already has it (a cast to its own dtype is a copy):
    what a fold computing in ``work_dtype`` writes for each operand and for its result.

    >>> w = Source(key="w", spec=TensorSpec(shape=(2,), dtype="float16"))
    >>> as_dtype(w, "float32") == Cast(x=w, dtype="float32"), as_dtype(w, "float16") is w
    (True, True)
    """
    spec = _spec_of(x)
    return x if isinstance(spec, TensorSpec) and spec.dtype == dtype else Cast(x=x, dtype=dtype)


def work_dtype(dtype: str) -> str:
    """The dtype a fold computes a ``dtype`` weight in: float64 for float64, else float32 (float16
    and bfloat16 are widened, then cast back).

    >>> work_dtype("float16"), work_dtype("float64")
    ('float32', 'float64')
    """
    return "float64" if dtype == "float64" else "float32"


def _bn_scale(var: WeightExpr, gamma: WeightExpr | None, eps: float, work: str) -> WeightExpr:
    """``gamma / sqrt(var + eps)`` in ``work`` (no ``gamma``: 1)."""
    scale: WeightExpr = Unary(
        op="rsqrt", x=Binary(op="add", a=as_dtype(var, work), b=Fill(shape=(), value=eps, dtype=work))
    )
    return scale if gamma is None else Binary(op="mul", a=as_dtype(gamma, work), b=scale)


def batch_norm_affine(
    *, mean: WeightExpr, var: WeightExpr, gamma: WeightExpr | None, beta: WeightExpr | None, eps: float, dtype: str
) -> tuple[WeightExpr, WeightExpr]:
    """An eval batch norm as ``x * scale + shift`` per channel, for a rule that writes it as
    arithmetic or as a depthwise conv: ``scale = gamma / sqrt(var + eps)``, ``shift = beta - mean *
    scale``, each computed in ``work_dtype(dtype)`` and cast to ``dtype``, of shape ``(C,)``; a
    missing gamma or beta means 1 or 0. (In float16 or bfloat16, ``x * scale + shift`` rounds
    ``x * scale`` where the batch norm subtracts the mean first: for an input far from zero against
    its spread, the result loses precision the batch norm keeps.)

    >>> vec = lambda k: Source(key=k, spec=TensorSpec(shape=(4,), dtype="float16"))
    >>> scale, shift = batch_norm_affine(mean=vec("m"), var=vec("v"), gamma=None, beta=vec("b"), eps=1e-5,
    ...                                  dtype="float16")
    >>> infer_spec(scale).unwrap() == infer_spec(shift).unwrap() == TensorSpec(shape=(4,), dtype="float16")
    True
    """
    work = work_dtype(dtype)
    scale = _bn_scale(var, gamma, eps, work)
    moved = Binary(op="mul", a=as_dtype(mean, work), b=scale)
    shift = Unary(op="neg", x=moved) if beta is None else Binary(op="sub", a=as_dtype(beta, work), b=moved)
    return as_dtype(scale, dtype), as_dtype(shift, dtype)


def fold_batch_norm(
    *,
    weight: WeightExpr,
    bias: WeightExpr | None,
    mean: WeightExpr,
    var: WeightExpr,
    gamma: WeightExpr | None,
    beta: WeightExpr | None,
    eps: float,
    transposed: bool = False,
    groups: int = 1,
) -> Result[tuple[WeightExpr, WeightExpr], BadExpr]:
    """Weight and bias of a conv (or linear: ``transposed=False``, ``groups=1``) with an eval batch
    norm over its output channels folded in. ``s = gamma / sqrt(var + eps)``; weight ``W * s``
    per output channel (laid out for a transposed, grouped weight too), bias ``(b - mean) * s + beta``.
    Computed in ``work_dtype`` (float32; float64 for a float64 weight) and cast back to the weight's
    dtype; missing gamma, beta, bias mean 1, 0, 0.

    >>> spec = TensorSpec(shape=(4, 2, 3, 3), dtype="float16")
    >>> vec = lambda k: Source(key=k, spec=TensorSpec(shape=(4,), dtype="float16"))
    >>> w, b = fold_batch_norm(weight=Source(key="w", spec=spec), bias=None, mean=vec("m"), var=vec("v"),
    ...                        gamma=None, beta=None, eps=1e-5).unwrap()
    >>> infer_spec(w).unwrap() == spec, infer_spec(b).unwrap().shape, infer_spec(b).unwrap().dtype
    (True, (4,), 'float16')
    """
    spec = infer_spec(weight)
    if isinstance(spec, Failure):
        return Failure(spec.failure())
    w = spec.unwrap()
    dims = _static(w)
    oc = out_channels(w, transposed=transposed, groups=groups) if len(w.shape) >= 2 else None
    if dims is None or not isinstance(oc, int) or len(dims) < 2 or dims[0] % groups:
        return Failure(BadExpr(node=EXPR_NODE, detail=f"cannot fold into a weight of shape {w.shape}"))
    work = work_dtype(w.dtype)
    scale = _bn_scale(var, gamma, eps, work)
    ones = (1,) * (len(dims) - 2)
    if transposed:  # (IC, OC/g, ...): output channel g*(OC/g)+j sits at [g*(IC/g)+i, j]
        grouped = Reshape(x=as_dtype(weight, work), shape=(groups, dims[0] // groups, *dims[1:]))
        per_out = Reshape(x=scale, shape=(groups, 1, dims[1], *ones))
        folded: WeightExpr = Reshape(x=Binary(op="mul", a=grouped, b=per_out), shape=dims)
    else:
        folded = Binary(op="mul", a=as_dtype(weight, work), b=Reshape(x=scale, shape=(oc, *(1,) * (len(dims) - 1))))
    shifted: WeightExpr = (
        Unary(op="neg", x=as_dtype(mean, work))
        if bias is None
        else Binary(op="sub", a=as_dtype(bias, work), b=as_dtype(mean, work))
    )
    new_bias: WeightExpr = Binary(op="mul", a=shifted, b=scale)
    if beta is not None:
        new_bias = Binary(op="add", a=new_bias, b=as_dtype(beta, work))
    return Success((as_dtype(folded, w.dtype), as_dtype(new_bias, w.dtype)))


def inverse(expr: WeightExpr, y: WeightExpr) -> Result[WeightExpr, BadExpr]:
    """Given ``y`` equal to ``expr``'s value, an expression for ``expr.x``.

    Exact inverses exist for the layout ops (Permute, Reshape, Unsqueeze, PadTo); the
    rest lose information and fail.

    >>> w = Source(key="w", spec=TensorSpec(shape=(3, 5), dtype="int8"))
    >>> padded = PadTo(x=w, dim=0, multiple=4)
    >>> infer_spec(inverse(padded, padded).unwrap()).unwrap().shape
    (3, 5)
    """
    match expr:
        case Permute():
            back = tuple(sorted(range(len(expr.dims)), key=lambda i: expr.dims[i]))
            return Success(Permute(x=y, dims=back))
        case Reshape() | PadTo() | Unsqueeze():
            inner = expr.x
            return infer_spec(inner).bind(lambda s: _undo_shape(expr, y, s))
        case _:
            return Failure(BadExpr(node=EXPR_NODE, detail=f"{type(expr).__name__} has no inverse"))


def _undo_shape(expr: Reshape | PadTo | Unsqueeze, y: WeightExpr, s: TensorSpec) -> Result[WeightExpr, BadExpr]:
    dims = _static(s)
    if dims is None:
        return Failure(BadExpr(node=EXPR_NODE, detail=f"cannot invert over symbolic shape {s.shape}"))
    if not isinstance(expr, PadTo):
        return Success(Reshape(x=y, shape=dims))
    d = _norm_dim(expr.dim, len(dims))
    if d is None:
        return Failure(BadExpr(node=EXPR_NODE, detail=f"dim {expr.dim} does not fit {dims}"))
    return Success(Slice(x=y, dim=d, start=0, stop=dims[d]))


def unpack(expr: WeightExpr, y: WeightExpr) -> Result[tuple[WeightExpr, WeightExpr], BadExpr]:
    """Peel the layout ops (Permute, Reshape, Unsqueeze, PadTo) off ``expr``, whose value is ``y``:
    the inner expression and one that recomputes it from ``y``.

    >>> w = Source(key="w", spec=TensorSpec(shape=(6, 1, 3, 3), dtype="int8"))
    >>> packed = PadTo(x=Reshape(x=Permute(x=w, dims=(2, 3, 1, 0)), shape=(3, 3, 6)), dim=2, multiple=4)
    >>> inner, back = unpack(packed, Source(key="packed", spec=infer_spec(packed).unwrap())).unwrap()
    >>> inner == w, infer_spec(back).unwrap().shape
    (True, (6, 1, 3, 3))
    """
    if not isinstance(expr, Permute | Reshape | PadTo | Unsqueeze):
        return Success((expr, y))
    inner = expr.x
    return inverse(expr, y).bind(lambda x: unpack(inner, x))

"""evaluate: a ``WeightExpr`` computed in plain Python (no torch, no numpy), for planner tests.

A rule's torch-free test can check the NUMBERS its plan derives, not only their specs: give each
``Source`` a value as nested lists (what ``tensor.tolist()`` returns; a 0-d value is a bare
number) and get the constant's value back the same way.

>>> from fxpure.testing import evaluate, spec
>>> from fxpure.weights import Binary, Fill, Quantize, Source
>>> w = Source(key="w", spec=spec(2, 2))
>>> evaluate(Binary(op="mul", a=w, b=Fill(shape=(), value=0.1, dtype="float32")), {"w": [[1, 2], [3, 4]]}).unwrap()
[[0.10000000149011612, 0.20000000298023224], [0.30000001192092896, 0.4000000059604645]]
>>> one = Fill(shape=(), value=0.5, dtype="float32")
>>> q = Quantize(x=w, scale=one, zero_point=one, axis=None, quant_min=-128, quant_max=127, dtype="int8")
>>> evaluate(q, {"w": [[0.25, 0.75], [-100.0, 100.0]]}).unwrap()
[[0, 2], [-128, 127]]

It computes as the adapter's torch does on a CPU, value by value: each result rounded to its dtype
(float16 and bfloat16 through float32, as torch computes them), integers wrapping, quantization
rounding half to even, NaN through ``maximum`` (the sign of a zero through ``maximum`` or ``minimum``
is the one torch's kernel keeps, which depends on its path). Sums and matrix products add exactly
(each product as torch makes it) and round once, where torch adds in the dtype (float32 for
float32) in its own order: a long or cancelling float32 sum can differ by more than a rounding, and
one whose partial sums pass float32's range is inf or NaN in torch and finite here. Roots are
rounded correctly; torch's float32 ``sqrt`` may be a unit off (``sqrt(67.0)``). Values are given by
the name of the node holding each (``Source.key``), not by a state dict's keys.

A failure is a value: ``bad-weight-expr`` for an ill-typed expression, or a value missing or not
of its ``Source``'s spec; ``value-range`` where a ``Within``'s operand holds a value outside its
range, a float is cast to an integer dtype that does not hold it once truncated (torch leaves 300.0
or NaN as int8 undefined), or a quantization meets NaN where it casts (``0 / 0``), as the adapter
declines the plan. What else the adapter checks of the values it computes is not checked here: a
new constant that is not finite, or flushed below float32's smallest normal, is a success here and
declined there (``non-finite-weight``, ``weight-underflow``).
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import TypeAlias, get_args

from returns.result import Failure, Result, Success

from fxpure.reasons import BadExpr, Declined, Reason
from fxpure.weights import (
    EXPR_NODE,
    FLOAT_DTYPES,
    INT_RANGES,
    Binary,
    Cast,
    Concat,
    Dequantize,
    Fill,
    MatMul,
    MaxOver,
    PadTo,
    Permute,
    Quantize,
    Reshape,
    Slice,
    Source,
    SumOver,
    Unary,
    Unsqueeze,
    WeightExpr,
    Within,
    _stored,  # (a float rounded to a struct format, inf beyond it: as known_values rounds)
    broadcast,
    infer_spec,
)

Number: TypeAlias = bool | int | float
Nested: TypeAlias = Number | list["Nested"]
"""A value as ``tensor.tolist()`` gives it: nested lists, row-major; a 0-d value a bare number."""


class _Fails(Exception):
    """Why evaluation stops (raised inside, returned as a failure)."""

    def __init__(self, reason: Reason) -> None:
        self.reason = reason


def _bad(detail: str) -> _Fails:
    return _Fails(BadExpr(node=EXPR_NODE, detail=detail))


class _T:
    """A tensor: its shape, its values flat in row-major order, and its dtype."""

    __slots__ = ("data", "dtype", "shape")

    def __init__(self, shape: tuple[int, ...], data: list[Number], dtype: str) -> None:
        self.shape, self.data, self.dtype = shape, data, dtype


_EXPRS = get_args(WeightExpr)


def evaluate(expr: WeightExpr, values: Mapping[str, object]) -> Result[Nested, Reason]:
    """The value of ``expr``, each ``Source`` read from ``values`` by its key (nested lists or a
    number, or anything with ``tolist()``; a float source's numbers are rounded to its dtype, an
    integer or bool one's must be whole numbers it holds). TypeError for an ``expr`` that is no
    expression or ``values`` that are no mapping (a bug in the caller, as for ``rewrite``)."""
    if not isinstance(expr, _EXPRS):
        raise TypeError(f"evaluate takes a WeightExpr, not {expr!r}")
    if not isinstance(values, Mapping):
        raise TypeError(f"evaluate takes the values by source key (a mapping), not {type(values).__name__}")
    spec = infer_spec(expr)
    if not isinstance(spec, Success):
        return Failure(spec.failure())
    memo: dict[WeightExpr, _T] = {}
    sizes: dict[str, int] = {}

    def ev(e: WeightExpr) -> _T:
        if e not in memo:
            memo[e] = _source(e, values, sizes) if isinstance(e, Source) else _computed(e, ev)
        return memo[e]

    try:
        out = ev(expr)
    except _Fails as f:
        return Failure(f.reason)
    return Success(_nested(out.shape, out.data))


# --- numbers of a dtype ------------------------------------------------------------------------------


def _bfloat16(value: float) -> float:
    """A float32 value rounded to bfloat16 (its upper 16 bits), to nearest, ties to even."""
    if value != value:
        return value
    (bits,) = struct.unpack("<I", struct.pack("<f", value))
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return float(struct.unpack("<f", struct.pack("<I", bits))[0])


def _rounded(value: float, dtype: str) -> float:
    """``value`` as a number of the float ``dtype`` holds (float16 and bfloat16 through float32)."""
    if dtype == "float64":
        return value
    f32 = _stored(value, "f")
    if dtype == "float32":
        return f32
    return _stored(f32, "e") if dtype == "float16" else _bfloat16(f32)


def _int_float(value: int, dtype: str) -> float:
    """An integer as the float ``dtype`` holds it, rounded once (to float32 first, as torch makes
    float16 and bfloat16 of it): past 2**53, ``float()`` would round it a first time to float64."""
    if dtype == "float64" or abs(value) < 2**53:
        try:
            return _rounded(float(value), dtype)
        except OverflowError:  # (past float64's range)
            return math.inf if value > 0 else -math.inf
    n = abs(value).bit_length() - 24  # float32 keeps 24 significant bits: to nearest, ties to even
    q, r = divmod(abs(value), 1 << n)
    q += r > 1 << (n - 1) or (r == 1 << (n - 1) and q & 1)
    try:
        return _rounded(float(q << n) if value > 0 else -float(q << n), dtype)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _wrapped(value: int, dtype: str) -> int:
    lo, hi = INT_RANGES[dtype]
    return (value - lo) % (hi - lo + 1) + lo


def _to(value: Number, dtype: str) -> Number:
    """``value`` cast to ``dtype`` as torch casts it; _Fails where torch leaves the result undefined."""
    if dtype == "bool":
        return bool(value)
    if dtype in FLOAT_DTYPES:
        return _int_float(value, dtype) if type(value) is int else _rounded(float(value), dtype)
    if isinstance(value, float):
        lo, hi = INT_RANGES[dtype]
        if not (math.isfinite(value) and lo <= math.trunc(value) <= hi):
            raise _bad(f"{value!r} as {dtype} is undefined (torch computes whatever its CPU does)")
        return math.trunc(value)
    return _wrapped(int(value), dtype)


def _zero(dtype: str) -> Number:
    return False if dtype == "bool" else 0.0 if dtype in FLOAT_DTYPES else 0


# --- values in and out -------------------------------------------------------------------------------


def _flat(value: object) -> tuple[tuple[int, ...], list[object]]:
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        value = tolist()
    if not isinstance(value, list | tuple):
        return (), [value]
    parts = [_flat(v) for v in value]
    if any(p[0] != parts[0][0] for p in parts):
        raise _bad(f"a ragged value {value!r}")
    inner = parts[0][0] if parts else ()
    return (len(parts), *inner), [x for _, xs in parts for x in xs]


def _source(e: Source, values: Mapping[str, object], sizes: dict[str, int]) -> _T:
    if e.key not in values:  # (the usual slip: a state dict's key for the node's name)
        raise _bad(f"no value for the source {e.key} (values are given by the name of the node holding each)")
    if e.spec.dtype not in (*FLOAT_DTYPES, *INT_RANGES, "bool"):
        raise _bad(f"the source {e.key} is {e.spec.dtype}, which evaluate does not compute")
    try:
        shape, flat = _flat(values[e.key])
    except _Fails:
        raise
    except Exception as ex:  # (a meta tensor's tolist, say)
        raise _bad(f"the value of {e.key} cannot be read: {type(ex).__name__}: {ex}") from ex
    if not flat and len(shape) < len(e.spec.shape):  # an empty list for a (0, 3) value, say
        shape = (*shape, *(d if isinstance(d, int) else 0 for d in e.spec.shape[len(shape) :]))
    fits = len(shape) == len(e.spec.shape) and all(
        n == d if isinstance(d, int) else sizes.setdefault(d, n) == n for n, d in zip(shape, e.spec.shape, strict=False)
    )
    if not fits:
        raise _bad(f"the value of {e.key} has shape {shape}, its spec {e.spec.shape}")
    return _T(shape, [_given(x, e.spec.dtype, e.key) for x in flat], e.spec.dtype)


def _given(x: object, dtype: str, key: str) -> Number:
    if not isinstance(x, bool | int | float):
        raise _bad(f"the value of {key} holds {x!r}, no number")
    if dtype in FLOAT_DTYPES:
        v = _to(x, dtype)
        if type(x) is int and math.isinf(v):  # (torch refuses such an int for a float tensor)
            raise _bad(f"the value of {key} holds {x!r}, which {dtype} does not hold")
        return v
    whole = isinstance(x, bool | int) or x.is_integer()
    if dtype == "bool" and x in (0, 1) and whole:
        return bool(x)
    if dtype != "bool" and whole and INT_RANGES[dtype][0] <= x <= INT_RANGES[dtype][1]:
        return int(x)
    raise _bad(f"the value of {key} holds {x!r}, which {dtype} does not hold")


def _nested(shape: tuple[int, ...], data: Sequence[Number]) -> Nested:
    if not shape:
        return data[0]
    step = len(data) // shape[0] if shape[0] else 0
    return [_nested(shape[1:], data[i * step : (i + 1) * step]) for i in range(shape[0])]


# --- layout ------------------------------------------------------------------------------------------


def _strides(shape: Sequence[int]) -> list[int]:
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= d
    return out[::-1]


def _gather(x: _T, shape: tuple[int, ...], strides: Sequence[int], offset: int = 0) -> list[Number]:
    """The values of ``x`` at ``offset + sum(i_k * strides_k)`` for every index of ``shape``, in order."""
    data = x.data
    return [data[offset + sum(map(int.__mul__, i, strides))] for i in itertools.product(*map(range, shape))]


def _dim(d: int, rank: int) -> int:
    return d % rank if rank else 0


def _permute(x: _T, dims: tuple[int, ...]) -> _T:
    st = _strides(x.shape)
    shape = tuple(x.shape[d] for d in dims)
    return _T(shape, _gather(x, shape, [st[d] for d in dims]), x.dtype)


def _slice(x: _T, dim: int, start: int, stop: int) -> _T:
    d = _dim(dim, len(x.shape))
    st = _strides(x.shape)
    shape = (*x.shape[:d], stop - start, *x.shape[d + 1 :])
    return _T(shape, _gather(x, shape, st, start * st[d]), x.dtype)


def _joined(parts: Sequence[_T], dim: int) -> _T:
    first = parts[0]
    d = _dim(dim, len(first.shape))
    outer = math.prod(first.shape[:d])
    runs = [math.prod(p.shape[d:]) for p in parts]  # each part's values at one index of the dims before ``d``
    data = [v for i in range(outer) for p, n in zip(parts, runs, strict=True) for v in p.data[i * n : (i + 1) * n]]
    shape = (*first.shape[:d], sum(p.shape[d] for p in parts), *first.shape[d + 1 :])
    return _T(shape, data, first.dtype)


def _pad_to(x: _T, dim: int, multiple: int) -> _T:
    d = _dim(dim, len(x.shape))
    shape = (*x.shape[:d], -x.shape[d] % multiple, *x.shape[d + 1 :])
    return _joined([x, _T(shape, [_zero(x.dtype)] * math.prod(shape), x.dtype)], d)


# --- arithmetic ----------------------------------------------------------------------------------------


def _div(a: float, b: float) -> float:
    try:
        return a / b
    except ZeroDivisionError:
        return math.nan if a == 0 or a != a else math.copysign(math.inf, a) * math.copysign(1.0, b)


def _maximum(a: Number, b: Number) -> Number:
    if a != a or b != b:  # NaN in either is the result
        return a if a != a else b
    return a if a >= b else b


def _minimum(a: Number, b: Number) -> Number:
    if a != a or b != b:
        return a if a != a else b
    return a if a <= b else b


_FLOAT_OPS: Mapping[str, Callable[[float, float], float]] = {
    "add": float.__add__,
    "sub": float.__sub__,
    "mul": float.__mul__,
    "div": _div,
}


def _width(dtype: str) -> int:
    lo, hi = INT_RANGES[dtype]
    return (hi - lo + 1).bit_length() - 1


_INT_OPS: Mapping[str, Callable[[int, int], int]] = {
    "add": int.__add__,
    "sub": int.__sub__,
    "mul": int.__mul__,
    "bitwise_and": int.__and__,  # (Python's ints are two's complement to these ops, as torch's are)
    "bitwise_or": int.__or__,
    "bitwise_xor": int.__xor__,
}
_BOOL_OPS: Mapping[str, Callable[[Number, Number], Number]] = {  # (torch's: add is or, mul is and)
    "add": lambda a, b: bool(a or b),
    "mul": lambda a, b: bool(a and b),
    "maximum": lambda a, b: bool(a or b),
    "minimum": lambda a, b: bool(a and b),
    "bitwise_and": lambda a, b: bool(a and b),
    "bitwise_or": lambda a, b: bool(a or b),
    "bitwise_xor": lambda a, b: bool(a) != bool(b),
}


def _op(op: str, dtype: str) -> Callable[[Number, Number], Number]:
    """``op`` on two values of ``dtype``, its result held in ``dtype`` (rounded, or wrapped)."""
    if dtype == "bool":
        return _BOOL_OPS[op]
    if op in ("maximum", "minimum"):
        return _maximum if op == "maximum" else _minimum
    if dtype in FLOAT_DTYPES:
        f = _FLOAT_OPS[op]
        return lambda a, b: _rounded(f(float(a), float(b)), dtype)
    bits = _width(dtype)
    if op == "shift_left":  # by a negative amount or the width or more: 0, as torch computes it
        return lambda a, b: _wrapped(int(a) << int(b), dtype) if 0 <= int(b) < bits else 0
    if op == "shift_right":  # (so: the sign filled)
        return lambda a, b: int(a) >> (int(b) if 0 <= int(b) < bits else bits)
    g = _INT_OPS[op]
    return lambda a, b: _wrapped(g(int(a), int(b)), dtype)


def _broadcast_strides(shape: tuple[int, ...], out: tuple[int, ...]) -> list[int]:
    lead = len(out) - len(shape)
    return [0] * lead + [0 if n == 1 else s for n, s in zip(shape, _strides(shape), strict=True)]


def _binary(op: str, a: _T, b: _T) -> _T:
    out = tuple(int(d) for d in broadcast(a.shape, b.shape) or ())  # (infer_spec checked they broadcast)
    f = _op(op, a.dtype)
    xs = _gather(a, out, _broadcast_strides(a.shape, out))
    ys = _gather(b, out, _broadcast_strides(b.shape, out))
    return _T(out, [f(x, y) for x, y in zip(xs, ys, strict=True)], a.dtype)


def _sqrt(x: float) -> float:
    return math.sqrt(x) if x >= 0 or x != x else math.nan


_INT_UNARY: Mapping[str, Callable[[int], int]] = {"neg": int.__neg__, "abs": abs, "sign": lambda v: (v > 0) - (v < 0)}


def _unary(op: str, x: _T) -> _T:
    dtype = x.dtype
    if dtype not in FLOAT_DTYPES:
        g = _INT_UNARY[op]
        return _T(x.shape, [_wrapped(g(int(v)), dtype) for v in x.data], dtype)
    work = "float64" if dtype == "float64" else "float32"  # torch's CPU computes float16 and bfloat16 in float32
    floats: Mapping[str, Callable[[float], float]] = {
        "sqrt": _sqrt,
        "rsqrt": lambda v: _div(1.0, _rounded(_sqrt(v), work)),  # 1 / sqrt(v), each rounded, as torch's kernel
        "neg": float.__neg__,
        "reciprocal": lambda v: _div(1.0, v),
        "abs": abs,
        "sign": lambda v: 1.0 if v > 0 else -1.0 if v < 0 else 0.0,  # NaN: 0, as torch has it
    }
    f = floats[op]
    return _T(x.shape, [_rounded(_rounded(f(float(v)), work), dtype) for v in x.data], dtype)


def _exact_sum(xs: Sequence[Number], dtype: str) -> Number:
    if dtype == "bool":
        return any(xs)
    if dtype not in FLOAT_DTYPES:
        return _wrapped(sum(int(v) for v in xs), dtype)
    try:
        total = math.fsum(float(v) for v in xs)
    except (OverflowError, ValueError):  # an infinity, or one on the way: the plain sum has it
        total = sum(float(v) for v in xs)
    return _rounded(total, dtype)


def _reduce(x: _T, dims: Sequence[int], f: Callable[[list[Number]], Number], dtype: str) -> _T:
    """``f`` of the values of ``x`` over ``dims``, at each index of the other dims (in order)."""
    rank = len(x.shape)
    over = sorted({_dim(d, rank) for d in dims})
    kept = [i for i in range(rank) if i not in over]
    st = _strides(x.shape)
    shape = tuple(x.shape[i] for i in kept)
    inner = tuple(x.shape[i] for i in over)
    outs = [
        f(_gather(x, inner, [st[i] for i in over], sum(i * st[k] for i, k in zip(idx, kept, strict=True))))
        for idx in itertools.product(*map(range, shape))
    ]
    return _T(shape, outs, dtype)


def _greatest(x: _T, dims: Sequence[int]) -> _T:
    f = _op("maximum", x.dtype)

    def greatest(xs: list[Number]) -> Number:
        out = xs[0]
        for v in xs[1:]:
            out = f(out, v)
        return out

    return _reduce(x, dims, greatest, x.dtype)


def _matmul(a: _T, b: _T) -> _T:
    m, k = a.shape
    n = b.shape[1] if len(b.shape) == 2 else 1
    rows = [a.data[i * k : (i + 1) * k] for i in range(m)]
    cols = [b.data[j::n] for j in range(n)]
    if a.dtype in FLOAT_DTYPES:  # each product as torch makes it (in float32, but for float64: 1e30 * 1e30 is inf)
        acc = "float64" if a.dtype == "float64" else "float32"
        data = [
            _exact_sum([_rounded(float(x) * float(y), acc) for x, y in zip(r, c, strict=True)], a.dtype)
            for r in rows
            for c in cols
        ]
    else:
        data = [_wrapped(sum(int(x) * int(y) for x, y in zip(r, c, strict=True)), a.dtype) for r in rows for c in cols]
    return _T((m, n) if len(b.shape) == 2 else (m,), data, a.dtype)


def _channel(x: _T, axis: int | None) -> list[int]:
    """The index of each value of ``x`` into a per-tensor (0) or per-channel (dim ``axis``) parameter."""
    if axis is None or not x.shape:
        return [0] * len(x.data)
    d = _dim(axis, len(x.shape))
    inner = math.prod(x.shape[d + 1 :])
    return [(i // inner) % x.shape[d] for i in range(len(x.data))]


def _floats(t: _T, dtype: str) -> list[float]:
    return [float(_to(v, dtype)) for v in t.data]


def _quantize(e: Quantize, x: _T, scale: _T, zero: _T) -> _T:
    # x * (1 / scale) in float32, rounded half to even, plus the zero point, clamped: as the adapter's torch
    inv = [_rounded(_div(1.0, s), "float32") for s in _floats(scale, "float32")]
    z = _floats(zero, "float32")
    pre: list[float] = []
    for v, c in zip(_floats(x, "float32"), _channel(x, e.axis), strict=True):
        t = _rounded(v * inv[c], "float32")
        pre.append(_rounded((float(round(t)) if math.isfinite(t) else t) + z[c], "float32"))
    # NaN (of x, or of 0 * (1 / 0)) clamps to NaN, then to whatever torch's cast makes of it
    _in_range(_T(x.shape, list(pre), "float32"), -math.inf, math.inf, False, "numbers to quantize, no NaN")
    return _T(x.shape, [_to(min(max(q, e.quant_min), e.quant_max), e.dtype) for q in pre], e.dtype)


def _dequantize(e: Dequantize, x: _T, scale: _T, zero: _T) -> _T:
    work = "float64" if e.dtype == "float64" else "float32"
    s, z = _floats(scale, work), _floats(zero, work)
    out = [
        _to(_rounded(_rounded(v - z[c], work) * s[c], work), e.dtype)
        for v, c in zip(_floats(x, work), _channel(x, e.axis), strict=True)
    ]
    return _T(x.shape, out, e.dtype)


def _in_range(x: _T, low: float, high: float, truncated: bool, what: str) -> None:
    """Every value of ``x`` in ``[low, high]`` (``truncated``: its integer part in ``[low, high)``),
    NaN never; else the adapter's ``value-range``, told as it tells it."""
    if truncated:
        bad = [float(v) for v in x.data if not (math.isfinite(v) and low <= math.trunc(v) < high)]
    elif x.dtype == "int64":  # compared exactly (float64 rounds one past 2**53), as the adapter does
        bad = [float(v) for v in x.data if not low <= v <= high]
    else:
        bad = [float(v) for v in x.data if not float(low) <= float(v) <= float(high)]
    if bad:
        span = "NaN" if any(v != v for v in bad) else f"{min(bad) + 0.0:g} to {max(bad) + 0.0:g}"
        raise _Fails(
            Declined(code="value-range", node=EXPR_NODE, detail=f"needs {what}; {len(bad)} of them are {span}")
        )


def _cast(x: _T, dtype: str) -> _T:
    if dtype in INT_RANGES and x.dtype in FLOAT_DTYPES:  # torch leaves the others undefined
        lo, hi = INT_RANGES[dtype]
        _in_range(x, lo, hi + 1, True, f"values a cast to {dtype} holds, [{lo}, {hi}] once truncated")
    return _T(x.shape, [_to(v, dtype) for v in x.data], dtype)


def _computed(e: WeightExpr, ev: Callable[[WeightExpr], _T]) -> _T:
    match e:
        case Fill():
            value = int(e.value) if e.dtype in INT_RANGES else _to(e.value, e.dtype)
            return _T(e.shape, [value] * math.prod(e.shape), e.dtype)
        case Permute():
            return _permute(ev(e.x), e.dims)
        case Reshape():
            return _T(e.shape, ev(e.x).data, ev(e.x).dtype)
        case Unsqueeze():
            x = ev(e.x)
            d = _dim(e.dim, len(x.shape) + 1)
            return _T((*x.shape[:d], 1, *x.shape[d:]), x.data, x.dtype)
        case Slice():
            return _slice(ev(e.x), e.dim, e.start, e.stop)
        case PadTo():
            return _pad_to(ev(e.x), e.dim, e.multiple)
        case Concat():
            return _joined([ev(p) for p in e.xs], e.dim)
        case Cast():
            return _cast(ev(e.x), e.dtype)
        case Binary():
            return _binary(e.op, ev(e.a), ev(e.b))
        case Unary():
            return _unary(e.op, ev(e.x))
        case SumOver():  # summed in its dtype, as torch sums
            return _reduce(_cast(ev(e.x), e.dtype), e.dims, lambda xs: _exact_sum(xs, e.dtype), e.dtype)
        case MaxOver():
            return _greatest(ev(e.x), e.dims)
        case MatMul():
            return _matmul(ev(e.a), ev(e.b))
        case Quantize():
            return _quantize(e, ev(e.x), ev(e.scale), ev(e.zero_point))
        case Dequantize():
            return _dequantize(e, ev(e.x), ev(e.scale), ev(e.zero_point))
        case Within():
            x = ev(e.x)
            _in_range(x, e.low, e.high, False, f"values in [{e.low:g}, {e.high:g}]")
            return x
    raise _bad(f"evaluate does not compute {type(e).__name__}")

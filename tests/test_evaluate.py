"""fxpure.testing.evaluate (plain Python) against the adapter's torch materialiser, which computes
the constants a transform writes: random well-typed expressions over random values, specials
included (NaN, infinities, -0.0, the ends of integer ranges), must give the same numbers."""

from __future__ import annotations

import math
from typing import Any, get_args

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from returns.result import Failure, Success

from adapters.torchnames import dtype_of
from adapters.weights import materialize
from fxpure.evaluate import Nested
from fxpure.testing import evaluate, spec
from fxpure.weights import (
    INT_RANGES,
    Binary,
    BinaryOp,
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
    UnaryOp,
    Unsqueeze,
    WeightExpr,
    Within,
    infer_spec,
    subexpressions,
)

FLOATS = ("float32", "float16", "bfloat16", "float64")
INTS = ("int8", "uint8", "int16", "int32", "int64")
DTYPES = (*FLOATS, *INTS, "bool")
SPECIAL = (math.nan, math.inf, -math.inf, -0.0, 0.0, 1e-40, 65504.0, 70000.0, 3.4e38, 0.5, 1.5, 2.5, -2.5)


def _number(dtype: str) -> st.SearchStrategy[Any]:
    if dtype == "bool":
        return st.booleans()
    if dtype in INT_RANGES:
        lo, hi = INT_RANGES[dtype]
        return st.one_of(st.sampled_from((lo, hi, 0, -1 if lo < 0 else 1)), st.integers(lo, hi))
    return st.one_of(st.sampled_from(SPECIAL), st.floats(-300, 300, width=32), st.floats(allow_nan=True))


def _nested(draw: st.DrawFn, shape: tuple[int, ...], dtype: str) -> Any:
    if not shape:
        return draw(_number(dtype))
    return [_nested(draw, shape[1:], dtype) for _ in range(shape[0])]


def _tensor(value: Any, s: Source) -> torch.Tensor:
    """The torch tensor of a value given to ``evaluate`` (a float source's numbers rounded to its dtype
    through float64, as ``evaluate`` rounds them)."""
    wide = torch.tensor(value, dtype=torch.float64 if s.spec.dtype in FLOATS else dtype_of(s.spec.dtype))
    return wide.reshape(tuple(int(d) for d in s.spec.shape)).to(dtype_of(s.spec.dtype))


@st.composite
def programs(draw: st.DrawFn) -> tuple[WeightExpr, dict[str, Any]]:
    """A random well-typed expression built by growing a pool of expressions from random sources,
    and the values of its sources; no floating sum, product, sqrt or rsqrt (torch adds in its own
    order and rounds roots its own way: those are compared apart)."""
    pool: list[WeightExpr] = []
    values: dict[str, Any] = {}
    for i in range(draw(st.integers(1, 3))):
        shape = tuple(draw(st.lists(st.integers(0 if i else 1, 3), min_size=0, max_size=3)))
        dtype = draw(st.sampled_from(DTYPES))
        s = Source(key=f"s{i}", spec=spec(*shape, dtype=dtype))
        values[s.key] = _nested(draw, shape, dtype)
        pool.append(s)
    for _ in range(draw(st.integers(1, 8))):
        x = pool[-1] if draw(st.integers(0, 2)) else draw(st.sampled_from(pool))  # (deeper, mostly)
        xs = infer_spec(x).unwrap()
        shape, dtype, rank = tuple(int(d) for d in xs.shape), xs.dtype, len(xs.shape)
        kind = draw(st.sampled_from(KINDS))
        made: WeightExpr
        match kind:
            case "permute":
                made = Permute(x=x, dims=tuple(draw(st.permutations(range(rank)))))
            case "reshape":
                n = math.prod(shape)
                made = Reshape(x=x, shape=draw(st.sampled_from([(n,), (1, n), (n, 1)])))
            case "unsqueeze":
                made = Unsqueeze(x=x, dim=draw(st.integers(-rank - 1, rank)))
            case "slice" if rank:
                d = draw(st.integers(-rank, rank - 1))  # (negative dims count from the end)
                start = draw(st.integers(0, shape[d]))
                made = Slice(x=x, dim=d, start=start, stop=draw(st.integers(start, shape[d])))
            case "pad" if rank:
                made = PadTo(x=x, dim=draw(st.integers(-rank, rank - 1)), multiple=draw(st.integers(1, 4)))
            case "concat" if rank:
                made = Concat(xs=(x, draw(st.sampled_from([x, *pool]))), dim=draw(st.integers(-rank, rank - 1)))
            case "cast":
                made = Cast(x=x, dtype=draw(st.sampled_from(DTYPES)))
            case "binary":
                op = draw(st.sampled_from(BINARY_OPS))
                fill = Fill(shape=(), value=draw(_number(dtype)), dtype=dtype)
                other = draw(st.sampled_from([x, fill, fill, Cast(x=draw(st.sampled_from(pool)), dtype=dtype)]))
                a, b = (x, other) if draw(st.booleans()) else (other, x)
                made = Binary(op=op, a=a, b=b)
            case "unary":
                # (torch's sqrt and rsqrt are not rounded correctly: sqrt(67.0) is a float32 off; apart below)
                made = Unary(op=draw(st.sampled_from(EXACT_UNARY)), x=x)
            case "sum" if rank:  # (to an integer or bool: exact, a float cast first)
                out = draw(st.sampled_from((*INTS, "bool")))
                made = SumOver(x=x, dims=tuple(draw(st.sets(st.integers(-rank, rank - 1), min_size=1))), dtype=out)
            case "max" if rank:
                made = MaxOver(x=x, dims=tuple(draw(st.sets(st.integers(-rank, rank - 1), min_size=1))))
            case "matmul" if rank == 2 and dtype not in FLOATS:
                made = MatMul(
                    a=x, b=Permute(x=x, dims=(1, 0)) if draw(st.booleans()) else Slice(x=x, dim=1, start=0, stop=1)
                )
            case "quantize" if dtype in FLOATS:
                made = Quantize(x=x, **_qparams(draw, shape), dtype=draw(st.sampled_from(("int8", "uint8", "int32"))))
            case "dequantize" if dtype in INTS:
                q = _qparams(draw, shape)
                del q["quant_min"], q["quant_max"]
                made = Dequantize(x=x, **q, dtype=draw(st.sampled_from(FLOATS)))
            case "within" if dtype != "bool":
                low = draw(st.floats(-200, 200))
                made = Within(x=x, low=low, high=low + draw(st.floats(0, 300)))
            case _:
                continue
        if isinstance(infer_spec(made), Success):
            pool.append(made)
    return pool[-1], values


BINARY_OPS: tuple[BinaryOp, ...] = get_args(BinaryOp)
EXACT_UNARY: tuple[UnaryOp, ...] = ("neg", "reciprocal", "abs", "sign")
KINDS = (
    "permute", "reshape", "unsqueeze", "slice", "pad", "concat", "cast", "binary", "unary", "sum", "max",
    "matmul", "quantize", "dequantize", "within",
)  # fmt: skip


def _qparams(draw: st.DrawFn, shape: tuple[int, ...]) -> dict[str, Any]:
    axis = draw(st.sampled_from([None, *range(-len(shape), len(shape))]))
    count = 1 if axis is None else shape[axis]
    scales = [draw(st.floats(0.0009765625, 10, width=32)) for _ in range(count)]
    zero = draw(st.integers(-3, 3))
    parts = {"axis": axis, "quant_min": -100, "quant_max": 100}
    if axis is None:
        return {"scale": Fill(shape=(), value=scales[0], dtype="float32"), **parts,
                "zero_point": Fill(shape=(), value=zero, dtype="int32")}  # fmt: skip
    # a per-channel scale of a value per channel: a concat of fills
    scale = Concat(xs=tuple(Fill(shape=(1,), value=v, dtype="float32") for v in scales), dim=0) if scales else None
    return {"scale": scale or Fill(shape=(0,), value=1.0, dtype="float32"), **parts,
            "zero_point": Fill(shape=(count,), value=zero, dtype="int32")}  # fmt: skip


def _same(ours: Nested, theirs: Any, *, close: bool) -> bool:
    if isinstance(ours, list):
        return (
            isinstance(theirs, list)
            and len(ours) == len(theirs)
            and all(_same(a, b, close=close) for a, b in zip(ours, theirs, strict=True))
        )
    if isinstance(ours, float) and math.isnan(ours):
        return isinstance(theirs, float) and math.isnan(theirs)
    if close and isinstance(ours, float):
        return math.isclose(ours, theirs, rel_tol=1e-2, abs_tol=1e-2)
    return type(ours) is type(theirs) and ours == theirs  # (-0.0 == 0.0: torch's maximum keeps either)


def _torch(expr: WeightExpr, values: dict[str, Any]) -> torch.Tensor:
    sources = {s.key: _tensor(values[s.key], s) for s in subexpressions(expr) if isinstance(s, Source)}
    return materialize(expr, sources)


def _check(expr: WeightExpr, values: dict[str, Any], *, close: bool = False) -> None:
    ours = evaluate(expr, values)
    theirs = _torch(expr, values)
    if not isinstance(ours, Success):
        reason = ours.failure()
        if reason.code == "value-range":  # torch computes it: a Within, or a float cast to an integer, is violated
            assert any(_violated(e, values) for e in subexpressions(expr)), (expr, reason)
            return
        raise AssertionError((expr, reason))
    assert list(theirs.shape) == list(infer_spec(expr).unwrap().shape)
    assert _same(ours.unwrap(), theirs.tolist(), close=close), (expr, ours.unwrap(), theirs.tolist())


def _violated(e: WeightExpr, values: dict[str, Any]) -> bool:
    """``e`` is a ``Within``, a cast (or sum) of floats to an integer dtype, or a quantization, some
    value of whose operand (computed by torch) lies outside what it allows (NaN, for the last)."""
    if isinstance(e, Within):
        x = _torch(e.x, values)
        if x.dtype == torch.int64:  # Python compares an int and a bound exactly
            return not all(e.low <= v <= e.high for v in x.reshape(-1).tolist())
        x = x.to(torch.float64)
        return not bool(((x >= e.low) & (x <= e.high)).all())
    if isinstance(e, Quantize):  # what it casts, by its definition: round(x * (1 / scale)) + zero_point
        scale, zero = (_torch(v, values).to(torch.float32) for v in (e.scale, e.zero_point))
        assert e.axis is None or scale.dim() == 1  # (per channel: along e.axis)
        shape = [1] * len(infer_spec(e.x).unwrap().shape)
        if e.axis is not None:
            shape[e.axis] = -1
        x = _torch(e.x, values).to(torch.float32)
        return bool((torch.round(x * (1.0 / scale.reshape(shape))) + zero.reshape(shape)).isnan().any())
    if isinstance(e, Cast | SumOver) and e.dtype in INTS and infer_spec(e.x).unwrap().dtype in FLOATS:
        # its integer part in [lo, hi]: each of lo and hi + 1 a float64 exactly (lo - 1 is not for int64)
        whole, (lo, hi) = torch.trunc(_torch(e.x, values).to(torch.float64)), INT_RANGES[e.dtype]
        return not bool(((whole >= float(lo)) & (whole < float(hi + 1))).all())
    return False


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(programs())
def test_evaluate_computes_what_the_adapter_computes(program: tuple[WeightExpr, dict[str, Any]]) -> None:
    _check(*program)


ROOTS: tuple[UnaryOp, ...] = ("sqrt", "rsqrt")
EPS = {"float64": 2**-50, "float32": 2**-21, "float16": 2**-8, "bfloat16": 2**-5}  # a few units of precision


@settings(max_examples=200, deadline=None)
@given(st.data(), st.sampled_from(FLOATS), st.sampled_from(("sum", "matmul")))
def test_float_sums_and_products_agree_within_a_rounding(data: st.DataObject, dtype: str, op: str) -> None:
    """torch adds in its own order (float16 in float32), ``evaluate`` exactly, then each rounds to the
    dtype: within a few units of the dtype's precision of the sum of the terms' magnitudes."""
    m, k = data.draw(st.integers(1, 4)), data.draw(st.integers(0, 6))
    finite = st.floats(-300, 300, width=16)
    a = Source(key="a", spec=spec(m, k, dtype=dtype))
    b = Source(key="b", spec=spec(k, dtype=dtype))
    flat, vector = (data.draw(st.lists(finite, min_size=n, max_size=n)) for n in (m * k, k))
    rows = [flat[i * k : (i + 1) * k] for i in range(m)]
    values = {"a": rows, "b": vector}
    expr: WeightExpr = MatMul(a=a, b=b) if op == "matmul" else SumOver(x=a, dims=(1,), dtype=dtype)
    ours, theirs = evaluate(expr, values).unwrap(), _torch(expr, values).tolist()
    assert isinstance(ours, list)
    for i, (x, y) in enumerate(zip(ours, theirs, strict=True)):
        terms = [v * (vector[j] if op == "matmul" else 1.0) for j, v in enumerate(rows[i])]
        assert x == y or abs(x - y) <= EPS[dtype] * (sum(map(abs, terms)) + 1), (x, y, terms)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(FLOATS), st.sampled_from(ROOTS), st.lists(_number("float64"), max_size=8))
def test_roots_agree_within_a_rounding(dtype: str, op: UnaryOp, xs: list[float]) -> None:
    """``evaluate`` rounds a root correctly; torch's kernels may be a unit off (float32 sqrt(67))."""
    x = Source(key="x", spec=spec(len(xs), dtype=dtype))
    ours, theirs = evaluate(Unary(op=op, x=x), {"x": xs}).unwrap(), _torch(Unary(op=op, x=x), {"x": xs}).tolist()
    assert isinstance(ours, list)
    for a, b in zip(ours, theirs, strict=True):
        assert (a != a and b != b) or a == b or abs(a - b) <= 2 * EPS[dtype] * abs(b), (a, b)


def _src(key: str, dtype: str, *shape: int) -> Source:
    return Source(key=key, spec=spec(*shape, dtype=dtype))


F64, F32, I8 = _src("d", "float64", 4), _src("f", "float32", 8), _src("i", "int8", 4)
BIG, EDGE = _src("l", "int64", 2), _src("e", "float64", 4)
HALF_TIE, BF16_TIE = 1 + 2**-11 + 2**-40, 1 + 2**-8 + 2**-40  # ties once rounded to float32 first, as torch does
ONE, ZERO = Fill(shape=(), value=1.0, dtype="float32"), Fill(shape=(), value=0, dtype="int32")
VALUES = {
    "d": [HALF_TIE, BF16_TIE, -0.0, 1e300],
    "f": [0.5, 1.5, 2.5, -0.5, -2.5, 126.5, math.nan, -0.0],
    "i": [127, -128, -1, 0],
    "l": [2**62 + 2**38 + 1, -(2**63)],  # (past 2**53: rounded once to float32, as torch rounds it)
    "e": [3e9, -3e9, -(2.0**63), 2.0**63 - 1024],
}


# a product whose terms pass float32's range: inf - inf, NaN, in torch (it computes them in float32)
ONE_E30, MINUS_E30 = (Fill(shape=(1,), value=v, dtype="float32") for v in (1e30, -1e30))


def _q(x: WeightExpr, scale: WeightExpr) -> Quantize:
    return Quantize(x=x, scale=scale, zero_point=ZERO, axis=None, quant_min=-128, quant_max=127, dtype="int8")


@pytest.mark.parametrize(
    "expr",
    [
        Cast(x=F64, dtype="float16"),
        Cast(x=F64, dtype="bfloat16"),
        Cast(x=F32, dtype="bool"),
        _q(Slice(x=F32, dim=0, start=0, stop=6), ONE),  # ties to even
        _q(Fill(shape=(2,), value=1.55, dtype="float32"), Fill(shape=(), value=0.1, dtype="float32")),  # x * (1/s)
        _q(Fill(shape=(2,), value=-300.0, dtype="float32"), ONE),  # clamped
        Slice(x=Reshape(x=F32, shape=(4, 2)), dim=0, start=1, stop=3),
        Unary(op="sign", x=F32),
        Unary(op="reciprocal", x=F32),
        Unary(op="neg", x=I8),
        Unary(op="abs", x=I8),
        Binary(op="add", a=I8, b=Fill(shape=(), value=1, dtype="int8")),
        Binary(op="div", a=F32, b=Fill(shape=(), value=-0.0, dtype="float32")),
        Binary(op="maximum", a=F32, b=Fill(shape=(), value=1.0, dtype="float32")),
        Binary(op="minimum", a=Fill(shape=(), value=math.nan, dtype="float32"), b=F32),
        Fill(shape=(2,), value=70000.0, dtype="float16"),
        Fill(shape=(), value=-1e9, dtype="bfloat16"),
        MaxOver(x=Reshape(x=F32, shape=(2, 4)), dims=(1,)),
        Dequantize(x=I8, scale=Fill(shape=(), value=0.1, dtype="float32"), zero_point=ZERO, axis=None),
        Cast(x=BIG, dtype="float32"),
        Cast(x=BIG, dtype="float16"),
        Cast(x=EDGE, dtype="int64"),  # -2**63 is an int64 (a bound of -2**63 - 1 in float64 is -2**63)
        # the whole range of int32 and int64: torch clamped int32's in float32, 2**31 - 1 as 2**31 (3e9: -2**31)
        Quantize(x=EDGE, scale=ONE, zero_point=ZERO, axis=None, quant_min=-(2**31), quant_max=2**31 - 1, dtype="int32"),
        Quantize(x=EDGE, scale=ONE, zero_point=ZERO, axis=None, quant_min=-(2**63), quant_max=2**63 - 1, dtype="int64"),
        MatMul(a=Fill(shape=(1, 2), value=1e30, dtype="float32"), b=Concat(xs=(ONE_E30, MINUS_E30), dim=0)),
        # int64 bounds float64 does not hold: clamped exactly all the same
        Quantize(x=EDGE, scale=ONE, zero_point=ZERO, axis=None, quant_min=0, quant_max=2**62 + 1, dtype="int64"),
        Quantize(x=EDGE, scale=ONE, zero_point=ZERO, axis=None, quant_min=-(2**63), quant_max=1 - 2**63, dtype="int64"),
        Fill(shape=(2,), value=2**64, dtype="float32"),  # (an int past int64: torch.full refused it)
        _q(F32, Fill(shape=(), value=0.0, dtype="float32")),  # 0 * (1 / 0): NaN before the cast, declined
    ],
    ids=lambda e: type(e).__name__,
)
def test_evaluate_rounds_and_wraps_as_torch_does(expr: WeightExpr) -> None:
    _check(expr, VALUES)


def test_a_value_out_of_range_is_declined_as_the_adapter_declines_it() -> None:
    w = Within(x=I8, low=-8, high=7)
    (reason,) = [evaluate(w, VALUES).failure()]
    assert (reason.code, reason.message) == ("value-range", "needs values in [-8, 7]; 2 of them are -128 to 127")
    assert evaluate(Within(x=I8, low=-128, high=127), VALUES).unwrap() == VALUES["i"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"i.weight": [1, 2, 3, 4]},
            "no value for the source i (values are given by the name of the node holding each)",
        ),
        ({"i": [1, 2, 3]}, "the value of i has shape (3,), its spec (4,)"),
        ({"i": [1, 2, 3, 300]}, "the value of i holds 300, which int8 does not hold"),
        ({"i": [1, 2, 3, 0.5]}, "the value of i holds 0.5, which int8 does not hold"),
        ({"i": [[1, 2], [3]]}, "a ragged value [[1, 2], [3]]"),
        ({"i": [1, 2, 3, "4"]}, "the value of i holds '4', no number"),
        (
            {"i": torch.zeros(4, dtype=torch.int8, device="meta")},
            "the value of i cannot be read: NotImplementedError: ",
        ),
    ],
)
def test_values_that_do_not_fit_their_source_are_a_failure(values: dict[str, Any], message: str) -> None:
    assert evaluate(Unary(op="neg", x=I8), values).failure().message.startswith(message)
    huge = evaluate(Unary(op="neg", x=F32), {"f": [2**1100] * 8}).failure().message
    assert huge == f"the value of f holds {2**1100!r}, which float32 does not hold"
    edge = evaluate(Unary(op="neg", x=F64), {"d": [2**1024 - 1, 0, 0, 0]}).failure().message  # (float() raised)
    assert edge == f"the value of d holds {2**1024 - 1!r}, which float64 does not hold"


def test_a_cast_torch_leaves_undefined_is_declined_as_the_adapter_declines_it() -> None:
    cast = Cast(x=F32, dtype="int8")
    message = "needs values a cast to int8 holds, [-128, 127] once truncated; 1 of them are NaN"
    assert (evaluate(cast, VALUES).failure().code, evaluate(cast, VALUES).failure().message) == ("value-range", message)
    too_big = evaluate(cast, {"f": [0.5, -1.9, 127.9, 128.0, 300.0, 0, 0, 0]}).failure().message
    assert too_big == "needs values a cast to int8 holds, [-128, 127] once truncated; 2 of them are 128 to 300"
    assert evaluate(cast, {"f": [0.5, -1.9, 127.9, -128.9, 0, 0, 0, 0]}).unwrap() == [0, -1, 127, -128, 0, 0, 0, 0]


@settings(max_examples=300, deadline=None)
@given(st.data(), st.sampled_from((*INTS, "bool")), st.sampled_from(BINARY_OPS))
def test_each_op_of_integers_and_bools_is_torchs(data: st.DataObject, dtype: str, op: BinaryOp) -> None:
    """Every ``Binary`` op on integers and bools, shifts by negative amounts and past the width included."""
    amounts = st.integers(-2, 70).filter(lambda v: dtype == "bool" or INT_RANGES[dtype][0] <= v <= INT_RANGES[dtype][1])
    a, b = (Source(key=k, spec=spec(6, dtype=dtype)) for k in "ab")
    values = {"a": data.draw(st.lists(_number(dtype), min_size=6, max_size=6))}
    shifts = op.startswith("shift") and dtype != "bool"
    values["b"] = data.draw(st.lists(amounts if shifts else _number(dtype), min_size=6, max_size=6))
    expr = Binary(op=op, a=a, b=b)
    assume(isinstance(infer_spec(expr), Success))  # (no div of integers, no sub or shift of bools)
    _check(expr, values)


def test_two_int4_values_a_byte_in_twos_complement() -> None:
    """The nibble packing XNNPACK-style int4 needs (``lo & 15 | hi << 4``), as torch computes it."""
    w = Source(key="w", spec=spec(2, 4, dtype="int8"))
    pairs = Reshape(x=w, shape=(2, 2, 2))
    lo, hi = (Reshape(x=Slice(x=pairs, dim=2, start=i, stop=i + 1), shape=(2, 2)) for i in (0, 1))
    nibble = Binary(op="bitwise_and", a=lo, b=Fill(shape=(), value=15, dtype="int8"))
    packed = Binary(op="bitwise_or", a=nibble, b=Binary(op="shift_left", a=hi, b=Fill(shape=(), value=4, dtype="int8")))
    values = {"w": [[-8, 7, -1, 0], [3, -4, 5, -6]]}
    assert evaluate(packed, values).unwrap() == [[0x78, 0x0F], [-0x3D, -0x5B]]  # 0x78; 0x0F; 0xC3; 0xA5 as int8
    _check(packed, values)


@pytest.mark.parametrize(("expr", "values"), [("w", {"w": [1.0]}), (None, {}), (F32, [0.5] * 8), (F32, None)])
def test_an_argument_of_another_type_is_a_type_error(expr: Any, values: Any) -> None:
    """A caller's bug (a name for an expression, a list for the values) raises TypeError naming it,
    as ``rewrite`` does for a plan of another type, not an AttributeError from inside."""
    with pytest.raises(TypeError, match="evaluate takes"):
        evaluate(expr, values)


@pytest.mark.parametrize(
    "expr",
    [
        Binary(op="pow", a=F32, b=F32),  # type: ignore[arg-type]
        Unary(op="log", x=F32),  # type: ignore[arg-type]
        Source(key="f", spec=None),  # type: ignore[arg-type]
        Reshape(x=F32, shape=[8]),  # type: ignore[arg-type]
        Slice(x=F32, dim=0, start=0, stop=None),  # type: ignore[arg-type]
        Binary(op="add", a=F32, b="f"),  # type: ignore[arg-type]
    ],
    ids=["pow", "log", "no-spec", "list-shape", "none-stop", "str-operand"],
)
def test_a_malformed_expression_is_a_failure(expr: WeightExpr) -> None:
    """An expression whose fields are not of their types (a hand-written plan's slip the type checker
    would catch) is ``bad-weight-expr``, as ``infer_spec`` says, where a KeyError or TypeError escaped."""
    out = evaluate(expr, VALUES)
    assert isinstance(out, Failure) and out.failure().code == "bad-weight-expr"

"""fxpure.weights on its own: the exact spec or the exact BadExpr of every expression kind and every
invalid input; structural equality; ``inverse``/``unpack`` checked by value; and ``fold_batch_norm``
checked by value against the textbook formula with a small numpy evaluator (no fxpure arithmetic)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any, TypeAlias, get_args

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from returns.result import Failure, Success

from fxpure import weights
from fxpure.reasons import BadExpr
from fxpure.snapshot import SMALL_VALUES, Dim, TensorSpec
from fxpure.weights import (
    EXPR_NODE,
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
    broadcast,
    children,
    fold_batch_norm,
    infer_spec,
    int_values,
    inverse,
    moves_data,
    out_channels,
    sources,
    subexpressions,
    unpack,
)

Array: TypeAlias = npt.NDArray[Any]
NP_DTYPES: dict[str, type[np.generic]] = {
    "float16": np.float16,
    "float32": np.float32,
    "float64": np.float64,
    "int8": np.int8,
    "uint8": np.uint8,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
}


def src(*shape: Dim, dtype: str = "float32", key: str = "x") -> Source:
    return Source(key=key, spec=TensorSpec(shape=shape, dtype=dtype))


def spec(*shape: Dim, dtype: str = "float32") -> TensorSpec:
    return TensorSpec(shape=shape, dtype=dtype)


def fresh(value: Any) -> Any:
    """``value`` rebuilt, every expression in it a new object: an expression keeps its spec and
    hash once computed, so a table built at import would otherwise answer from what an earlier test
    (or the clean run a mutation tester forks from) computed, and never run inference again."""
    if isinstance(value, tuple):
        return tuple(fresh(v) for v in value)
    if hasattr(value, "__dataclass_fields__") and not isinstance(value, TensorSpec):
        return type(value)(**{f.name: fresh(getattr(value, f.name)) for f in fields(value)})
    return value


def bad_message(expr: WeightExpr) -> str:
    """The message of ``expr``'s BadExpr, checking it is one about the expression alone."""
    result = infer_spec(expr)
    assert isinstance(result, Failure), result
    bad = result.failure()
    assert isinstance(bad, BadExpr)
    assert (bad.node, bad.code, bad.path) == (EXPR_NODE, "bad-weight-expr", "")
    assert isinstance(bad.message, str)
    return bad.message


# --- a small evaluator (numpy, honouring every dtype; never fxpure's arithmetic) ----------------------

BINARY: dict[str, Callable[[Array, Array], Array]] = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": np.divide,
    "maximum": np.maximum,
    "minimum": np.minimum,
}
UNARY: dict[str, Callable[[Array], Array]] = {
    "neg": np.negative,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: np.reciprocal(np.sqrt(x)),
    "reciprocal": np.reciprocal,
    "abs": np.abs,
    "sign": np.sign,
}


def _axis(dim: int, rank: int) -> int:
    assert -rank <= dim < rank, (dim, rank)
    return dim % rank


def evaluate(e: WeightExpr, env: Mapping[str, Array]) -> Array:
    """The value of a layout or arithmetic expression over the arrays of ``env``."""
    with np.errstate(over="ignore"):
        out = _evaluate(e, env)
    return out


def _evaluate(e: WeightExpr, env: Mapping[str, Array]) -> Array:
    match e:
        case Source():
            v = env[e.key]
            assert (v.shape, v.dtype) == (e.spec.shape, np.dtype(NP_DTYPES[e.spec.dtype]))
            return v
        case Fill():
            return np.full(e.shape, e.value, dtype=NP_DTYPES[e.dtype])
        case Cast():
            return evaluate(e.x, env).astype(NP_DTYPES[e.dtype])
        case Reshape():
            x = evaluate(e.x, env)
            assert all(d >= 0 for d in e.shape) and x.size == int(np.prod(e.shape)), (x.shape, e.shape)
            return x.reshape(e.shape)
        case Permute():
            return np.transpose(evaluate(e.x, env), e.dims)
        case Unsqueeze():
            x = evaluate(e.x, env)
            return np.expand_dims(x, _axis(e.dim, x.ndim + 1))
        case Slice():
            x = evaluate(e.x, env)
            d = _axis(e.dim, x.ndim)
            assert 0 <= e.start <= e.stop <= x.shape[d]
            return x[(slice(None),) * d + (slice(e.start, e.stop),)]
        case PadTo():
            x = evaluate(e.x, env)
            d = _axis(e.dim, x.ndim)
            pad = [(0, 0)] * x.ndim
            pad[d] = (0, -x.shape[d] % e.multiple)
            return np.pad(x, pad)
        case Binary():
            a, b = evaluate(e.a, env), evaluate(e.b, env)
            assert a.dtype == b.dtype, (a.dtype, b.dtype)
            assert e.op in BINARY, e.op
            out = BINARY[e.op](a, b)
            assert out.dtype == a.dtype
            return out
        case MaxOver():
            x = evaluate(e.x, env)
            return np.asarray(np.max(x, axis=tuple(_axis(d, x.ndim) for d in e.dims)))
        case Unary():
            assert e.op in UNARY, e.op
            x = evaluate(e.x, env)
            return UNARY[e.op](x)
    raise AssertionError(f"the evaluator does not know {e!r}")


def value_of(e: WeightExpr, env: Mapping[str, Array]) -> Array:
    """``evaluate``, checking the value has the inferred spec."""
    out = evaluate(e, env)
    s = infer_spec(e).unwrap()
    assert (out.shape, out.dtype) == (s.shape, np.dtype(NP_DTYPES[s.dtype]))
    return out


def source_of(key: str, value: Array) -> Source:
    return Source(key=key, spec=TensorSpec(shape=value.shape, dtype=str(value.dtype)))


# --- infer_spec: every expression kind ----------------------------------------------------------------

W43 = src(4, 3)
F32_SCALAR = Fill(shape=(), value=0.5, dtype="float32")
I32_SCALAR = Fill(shape=(), value=0.0, dtype="int32")
BAD = Permute(x=W43, dims=(0,))  # ill-typed: "permute (0,) does not fit rank 2"
BAD_MSG = "permute (0,) does not fit rank 2"
BAD2 = Unsqueeze(x=W43, dim=5)
BAD2_MSG = "unsqueeze at 5 does not fit rank 2"


def quantize(
    x: WeightExpr = W43,
    scale: WeightExpr = F32_SCALAR,
    zero_point: WeightExpr = I32_SCALAR,
    axis: int | None = None,
    quant_min: int = -128,
    quant_max: int = 127,
    dtype: str = "int8",
) -> Quantize:
    return Quantize(
        x=x, scale=scale, zero_point=zero_point, axis=axis, quant_min=quant_min, quant_max=quant_max, dtype=dtype
    )


def vec(n: int, dtype: str = "float32", key: str = "v") -> Source:
    return src(n, dtype=dtype, key=key)


I8 = src(4, 3, dtype="int8")

SPECS: list[tuple[WeightExpr, TensorSpec]] = [
    (src("n", 3, dtype="int8"), spec("n", 3, dtype="int8")),
    (Fill(shape=(2, 3), value=1.5, dtype="float16"), spec(2, 3, dtype="float16")),
    (Fill(shape=(), value=0.0, dtype="int8"), spec(dtype="int8")),
    (Fill(shape=(3,), value=-128, dtype="int8"), spec(3, dtype="int8")),
    (Fill(shape=(0,), value=255, dtype="uint8"), spec(0, dtype="uint8")),
    (Binary(op="sub", a=src(2, dtype="int32"), b=src(2, dtype="int32")), spec(2, dtype="int32")),
    (Cast(x=src("n", 3), dtype="int8"), spec("n", 3, dtype="int8")),
    (Permute(x=src(2, 3, 4, dtype="int8"), dims=(2, 0, 1)), spec(4, 2, 3, dtype="int8")),
    (Permute(x=src("n", 3), dims=(1, 0)), spec(3, "n")),
    (Reshape(x=W43, shape=(2, 6)), spec(2, 6)),
    (Reshape(x=W43, shape=(12,)), spec(12)),
    (Reshape(x=I8, shape=(2, 2, 3)), spec(2, 2, 3, dtype="int8")),
    (Reshape(x=src(0, 3), shape=(3, 0)), spec(3, 0)),
    (Unsqueeze(x=W43, dim=0), spec(1, 4, 3)),
    (Unsqueeze(x=W43, dim=2), spec(4, 3, 1)),
    (Unsqueeze(x=W43, dim=-1), spec(4, 3, 1)),
    (Unsqueeze(x=I8, dim=-2), spec(4, 1, 3, dtype="int8")),
    (Unsqueeze(x=W43, dim=-3), spec(1, 4, 3)),
    (Slice(x=src(4, 6), dim=1, start=2, stop=5), spec(4, 3)),
    (Slice(x=src(4, 6, dtype="int8"), dim=-1, start=0, stop=6), spec(4, 6, dtype="int8")),
    (Slice(x=src(4, 6), dim=0, start=2, stop=2), spec(0, 6)),
    (Slice(x=src(4, 6), dim=-2, start=1, stop=4), spec(3, 6)),
    (Slice(x=src("n", 6), dim=1, start=1, stop=3), spec("n", 2)),
    (PadTo(x=src(5, 6), dim=0, multiple=4), spec(8, 6)),
    (PadTo(x=src(5, 6, dtype="int8"), dim=-1, multiple=4), spec(5, 8, dtype="int8")),
    (PadTo(x=src(5, 6), dim=-2, multiple=5), spec(5, 6)),
    (PadTo(x=src(5, 6), dim=0, multiple=1), spec(5, 6)),
    (PadTo(x=src("n", 6), dim=1, multiple=4), spec("n", 8)),
    (SumOver(x=src(2, 3, 4, dtype="float16"), dims=(0, 2), dtype="float32"), spec(3)),
    (SumOver(x=src(2, 3, 4), dims=(-1,), dtype="float64"), spec(2, 3, dtype="float64")),
    (SumOver(x=src(2, 0), dims=(1,), dtype="float32"), spec(2)),  # a sum of nothing is 0
    (MaxOver(x=src(2, 3, 4, dtype="float16"), dims=(0, 2)), spec(3, dtype="float16")),
    (MaxOver(x=src(2, 3, dtype="int8"), dims=(-1,)), spec(2, dtype="int8")),
    (MaxOver(x=src("n", 3), dims=(1,)), spec("n")),
    (Concat(xs=(src(2, 3), src(4, 3)), dim=0), spec(6, 3)),
    (Concat(xs=(src(2, 3, dtype="int8"), src(2, 5, dtype="int8")), dim=-1), spec(2, 8, dtype="int8")),
    (Concat(xs=(src(2, 3),), dim=1), spec(2, 3)),
    (Concat(xs=(src(1, 3), src(2, 3), src(3, 3)), dim=-2), spec(6, 3)),
    (Concat(xs=(src("n", 3), src("n", 2)), dim=1), spec("n", 5)),
    (Binary(op="mul", a=src(4, 1), b=src(3)), spec(4, 3)),
    (Binary(op="add", a=src(2, 3, dtype="int8"), b=src(dtype="int8")), spec(2, 3, dtype="int8")),
    (Binary(op="shift_left", a=src(2, 3, dtype="uint8"), b=src(dtype="uint8")), spec(2, 3, dtype="uint8")),
    (Binary(op="bitwise_xor", a=src(2, dtype="bool"), b=src(2, dtype="bool")), spec(2, dtype="bool")),
    (Binary(op="div", a=src(1), b=src("n", 1)), spec("n", 1)),
    (Binary(op="maximum", a=src(2, 3, dtype="int8"), b=src(dtype="int8")), spec(2, 3, dtype="int8")),
    (Binary(op="minimum", a=src(3, 1), b=src(4)), spec(3, 4)),
    (Unary(op="sqrt", x=src(2, 3, dtype="float16")), spec(2, 3, dtype="float16")),
    (Unary(op="rsqrt", x=src(2, dtype="bfloat16")), spec(2, dtype="bfloat16")),
    (Unary(op="reciprocal", x=src(2, dtype="float64")), spec(2, dtype="float64")),
    (Unary(op="neg", x=src(2, 3, dtype="int8")), spec(2, 3, dtype="int8")),
    (Unary(op="neg", x=src(2)), spec(2)),
    (Unary(op="abs", x=src(2, dtype="int8")), spec(2, dtype="int8")),
    (Unary(op="sign", x=src(2, 3, dtype="bfloat16")), spec(2, 3, dtype="bfloat16")),
    (quantize(), spec(4, 3, dtype="int8")),
    (quantize(x=src(4, 3, dtype="float16"), scale=Fill(shape=(1,), value=0.1, dtype="float32")),
     spec(4, 3, dtype="int8")),
    (quantize(scale=vec(3), zero_point=vec(3, "int32"), axis=1, quant_min=0, quant_max=255, dtype="uint8"),
     spec(4, 3, dtype="uint8")),
    (quantize(scale=vec(4), zero_point=vec(4, "int32"), axis=-2), spec(4, 3, dtype="int8")),
    (quantize(quant_min=3, quant_max=3, dtype="int32"), spec(4, 3, dtype="int32")),
    (Dequantize(x=I8, scale=F32_SCALAR, zero_point=I32_SCALAR, axis=None), spec(4, 3)),
    (Dequantize(x=I8, scale=vec(4), zero_point=vec(4, "int32"), axis=0, dtype="float16"), spec(4, 3, dtype="float16")),
    (Dequantize(x=src("n", 3, dtype="int32"), scale=vec(3), zero_point=vec(3), axis=-1), spec("n", 3)),
    (MatMul(a=src(4, 3), b=src(3, 5, key="y")), spec(4, 5)),
    (MatMul(a=src(4, 3, dtype="float16"), b=src(3, 1, dtype="float16")), spec(4, 1, dtype="float16")),
    (MatMul(a=src(2, 3, dtype="bfloat16"), b=src(3, 3, dtype="bfloat16")), spec(2, 3, dtype="bfloat16")),
    (MatMul(a=src(4, 3, dtype="int8"), b=src(3, dtype="int8")), spec(4, dtype="int8")),  # a matrix by a vector
    (MatMul(a=src(4, 3, dtype="float64"), b=vec(3, "float64")), spec(4, dtype="float64")),
    (MatMul(a=src(1, 2, dtype="uint8"), b=src(2, 7, dtype="uint8")), spec(1, 7, dtype="uint8")),
    (MatMul(a=src(2, 0, dtype="int64"), b=src(0, 5, dtype="int64")), spec(2, 5, dtype="int64")),  # zeros, as torch's
    (MatMul(a=src("n", 3), b=src(3, "m")), spec("n", "m")),
    (MatMul(a=src(2, "k"), b=src("k")), spec(2)),
    (MatMul(a=Permute(x=W43, dims=(1, 0)), b=W43), spec(3, 3)),
]  # fmt: skip


@pytest.mark.parametrize(("expr", "expected"), SPECS)
def test_infer_spec(expr: WeightExpr, expected: TensorSpec) -> None:
    expr = fresh(expr)
    assert infer_spec(expr) == Success(expected)
    assert infer_spec(expr) == Success(expected)  # and again, from the kept answer


FAILURES: list[tuple[WeightExpr, str]] = [
    (BAD, BAD_MSG),
    (Permute(x=W43, dims=(0, 0)), "permute (0, 0) does not fit rank 2"),
    (Permute(x=W43, dims=(0, 1, 2)), "permute (0, 1, 2) does not fit rank 2"),
    (Cast(x=BAD, dtype="int8"), BAD_MSG),
    (Reshape(x=W43, shape=(5, 3)), "cannot reshape (4, 3) to (5, 3)"),
    (Reshape(x=W43, shape=(2, 2)), "cannot reshape (4, 3) to (2, 2)"),
    (Reshape(x=W43, shape=(-1, -12)), "cannot reshape (4, 3) to (-1, -12)"),
    (Reshape(x=src("n", 4), shape=(4,)), "cannot reshape ('n', 4) to (4,)"),
    (Reshape(x=BAD, shape=(4, 3)), BAD_MSG),
    (Unsqueeze(x=W43, dim=3), "unsqueeze at 3 does not fit rank 2"),
    (Unsqueeze(x=W43, dim=-4), "unsqueeze at -4 does not fit rank 2"),
    (Unsqueeze(x=BAD2, dim=0), BAD2_MSG),
    (Slice(x=src(4, 6), dim=2, start=0, stop=1), "slice 0:1 on dim 2 does not fit (4, 6)"),
    (Slice(x=src(4, 6), dim=-3, start=0, stop=1), "slice 0:1 on dim -3 does not fit (4, 6)"),
    (Slice(x=src(4, 6), dim=1, start=0, stop=7), "slice 0:7 on dim 1 does not fit (4, 6)"),
    (Slice(x=src(4, 6), dim=1, start=3, stop=2), "slice 3:2 on dim 1 does not fit (4, 6)"),
    (Slice(x=src(4, 6), dim=1, start=-1, stop=2), "slice -1:2 on dim 1 does not fit (4, 6)"),
    (Slice(x=src("n", 6), dim=0, start=0, stop=1), "slice 0:1 on dim 0 does not fit ('n', 6)"),
    (Slice(x=BAD, dim=0, start=0, stop=1), BAD_MSG),
    (PadTo(x=src(5, 6), dim=2, multiple=4), "cannot pad dim 2 of (5, 6) to a multiple of 4"),
    (PadTo(x=src(5, 6), dim=-3, multiple=4), "cannot pad dim -3 of (5, 6) to a multiple of 4"),
    (PadTo(x=src("n", 6), dim=0, multiple=4), "cannot pad dim 0 of ('n', 6) to a multiple of 4"),
    (PadTo(x=src(5, 6), dim=0, multiple=0), "cannot pad dim 0 of (5, 6) to a multiple of 0"),
    (PadTo(x=src(5, 6), dim=1, multiple=-2), "cannot pad dim 1 of (5, 6) to a multiple of -2"),
    (PadTo(x=BAD, dim=0, multiple=2), BAD_MSG),
    (SumOver(x=W43, dims=(2,), dtype="float32"), "sum over (2,) does not fit rank 2"),
    (SumOver(x=W43, dims=(0, -3), dtype="float32"), "sum over (0, -3) does not fit rank 2"),
    (SumOver(x=BAD, dims=(0,), dtype="float32"), BAD_MSG),
    # torch sums a tensor over every dim for dims=() and refuses a dim named twice
    (SumOver(x=src(2, 3, 4), dims=(0, -3), dtype="float32"), "sum over (0, -3) does not fit rank 3"),
    (SumOver(x=src(2, 3), dims=(), dtype="float32"), "sum over () does not fit rank 2"),
    (Fill(shape=(2, -1), value=1.0, dtype="float32"), "fill of shape (2, -1) with 1.0 as float32"),
    # a size copied from a symbolic spec, a dtype torch does not name so (or only by an alias)
    (Fill(shape=("s0", 4), value=1.0, dtype="float32"), "fill of shape ('s0', 4) with 1.0 as float32"),  # type: ignore[arg-type]
    (Reshape(x=W43, shape=(1, "s0", "s1")), "cannot reshape (4, 3) to (1, 's0', 's1')"),  # type: ignore[arg-type]
    (Fill(shape=(2,), value=1.0, dtype="half"), "fill of shape (2,) with 1.0 as half"),
    (Cast(x=W43, dtype="flaot32"), "cast to 'flaot32'"),
    (Cast(x=W43, dtype="float"), "cast to 'float'"),
    (SumOver(x=W43, dims=(0,), dtype="long"), "sum as 'long'"),
    (MaxOver(x=W43, dims=(2,)), "max over (2,) does not fit rank 2"),
    (MaxOver(x=src(2, 3), dims=()), "max over () does not fit rank 2"),
    (MaxOver(x=src(2, 3), dims=(1, -1)), "max over (1, -1) does not fit rank 2"),
    (MaxOver(x=src(2, 0), dims=(1,)), "max over (1,) of the empty dims of (2, 0)"),  # torch refuses it
    (MaxOver(x=BAD, dims=(0,)), BAD_MSG),
    (Unary(op="abs", x=src(2, dtype="bool")), "abs of bool (needs a numeric dtype)"),
    (Unary(op="sign", x=src(2, dtype="bool")), "sign of bool (needs a numeric dtype)"),
    # torch refuses -x and x - y on bool tensors
    (Unary(op="neg", x=src(2, dtype="bool")), "neg of bool (needs a numeric dtype)"),
    (Binary(op="sub", a=src(2, dtype="bool"), b=src(2, dtype="bool")), "sub of bool"),
    (Binary(op="bitwise_and", a=src(2), b=src(2)), "bitwise_and of float32 (needs an integer dtype or bool)"),
    (Within(x=src(2), low=-(2**1100), high=0), f"a range [{-(2**1100)}, 0] past any float's"),
    (Fill(shape=(), value=2**1100, dtype="float32"), f"fill of shape () with {2**1100!r} as float32"),
    (
        Binary(op="shift_left", a=src(2, dtype="bool"), b=src(2, dtype="bool")),
        "shift_left of bool (needs an integer dtype)",
    ),
    (Fill(shape=(2,), value=300, dtype="int8"), "fill of shape (2,) with 300 as int8"),
    (Fill(shape=(2,), value=-2, dtype="uint8"), "fill of shape (2,) with -2 as uint8"),
    (Fill(shape=(2,), value=0.5, dtype="int32"), "fill of shape (2,) with 0.5 as int32"),
    (Binary(op="div", a=src(2, dtype="int32"), b=src(2, dtype="int32")), "div of int32 (cast to a float first)"),
    (Concat(xs=(), dim=0), "concat of nothing"),
    (Concat(xs=(src(2, 3), src(2, 3)), dim=2), "concat dim 2 does not fit rank 2"),
    (Concat(xs=(src(2, 3),), dim=-3), "concat dim -3 does not fit rank 2"),
    (Concat(xs=(src(2, 3), src(2, 4)), dim=0), "concat of mismatched shapes or dtypes"),
    (Concat(xs=(src(2, 3, 4), src(2, 5, 4)), dim=0), "concat of mismatched shapes or dtypes"),
    (Concat(xs=(src(2, 3), src(2, 3), src(2, 4)), dim=0), "concat of mismatched shapes or dtypes"),
    (Concat(xs=(src(2, 3), src(2)), dim=0), "concat of ranks [1, 2]"),
    (Concat(xs=(src(2, 3, 2), src(3, 3)), dim=2), "concat of ranks [2, 3]"),  # dim fits the first only
    (Concat(xs=(src(2, 3), src(2, 3, dtype="int8")), dim=0), "concat of mismatched shapes or dtypes"),
    (Concat(xs=(src("n", 3), src(2, 3)), dim=0), "concat along a symbolic dim"),
    (Concat(xs=(src(2, 3), BAD, BAD2), dim=0), BAD_MSG),
    (Binary(op="add", a=src(2, dtype="int8"), b=src(2)), "add of int8 and float32 (cast one first)"),
    (Binary(op="sub", a=src(2), b=src(3, dtype="float16")), "sub of float32 and float16 (cast one first)"),
    (Binary(op="mul", a=src(2, 3), b=src(4)), "mul of shapes (2, 3) and (4,) that do not broadcast"),
    (Binary(op="div", a=src("n"), b=src("m")), "div of shapes ('n',) and ('m',) that do not broadcast"),
    (Binary(op="maximum", a=src(2, dtype="int8"), b=src(2)), "maximum of int8 and float32 (cast one first)"),
    (Binary(op="minimum", a=src(2, 3), b=src(2)), "minimum of shapes (2, 3) and (2,) that do not broadcast"),
    (Binary(op="add", a=BAD, b=BAD2), BAD_MSG),
    (Binary(op="add", a=W43, b=BAD2), BAD2_MSG),
    (Unary(op="sqrt", x=I8), "sqrt of int8 (needs a floating dtype)"),
    (Unary(op="rsqrt", x=src(2, dtype="int32")), "rsqrt of int32 (needs a floating dtype)"),
    (Unary(op="reciprocal", x=src(2, dtype="uint8")), "reciprocal of uint8 (needs a floating dtype)"),
    (Unary(op="neg", x=BAD), BAD_MSG),
    (quantize(x=I8), "quantize int8 to int8 in [-128, 127]"),
    (quantize(dtype="float16"), "quantize float32 to float16 in [-128, 127]"),
    (quantize(quant_min=5, quant_max=4), "quantize float32 to int8 in [5, 4]"),
    (quantize(quant_min=0, quant_max=255), "quantize float32 to int8 in [0, 255]"),
    (quantize(quant_min=-129, quant_max=0), "quantize float32 to int8 in [-129, 0]"),
    (quantize(x=I8, scale=vec(2)), "quantize int8 to int8 in [-128, 127]"),
    (quantize(scale=vec(2)), "per-tensor scale of shape (2,)"),
    (quantize(zero_point=vec(4, "int32")), "per-tensor zero point of shape (4,)"),
    (quantize(scale=vec(2), zero_point=vec(4, "int32")), "per-tensor scale of shape (2,)"),
    (quantize(scale=vec(3), zero_point=vec(4), axis=0), "scale of shape (3,) for axis 0 of (4, 3)"),
    (quantize(scale=vec(4), zero_point=vec(3), axis=0), "zero point of shape (3,) for axis 0 of (4, 3)"),
    (quantize(scale=F32_SCALAR, zero_point=vec(3), axis=1), "scale of shape () for axis 1 of (4, 3)"),
    (quantize(scale=vec(4), zero_point=vec(4), axis=2), "scale of shape (4,) for axis 2 of (4, 3)"),
    (quantize(scale=vec(4), zero_point=vec(4), axis=-3), "scale of shape (4,) for axis -3 of (4, 3)"),
    (quantize(scale=BAD2), BAD2_MSG),
    (quantize(zero_point=BAD), BAD_MSG),
    (quantize(x=BAD), BAD_MSG),
    (Dequantize(x=W43, scale=F32_SCALAR, zero_point=I32_SCALAR, axis=None), "dequantize float32 to float32"),
    (Dequantize(x=I8, scale=F32_SCALAR, zero_point=I32_SCALAR, axis=None, dtype="int32"), "dequantize int8 to int32"),
    (Dequantize(x=I8, scale=vec(2), zero_point=I32_SCALAR, axis=None), "per-tensor scale of shape (2,)"),
    (Dequantize(x=I8, scale=vec(4), zero_point=vec(3), axis=0), "zero point of shape (3,) for axis 0 of (4, 3)"),
    (Dequantize(x=BAD, scale=F32_SCALAR, zero_point=I32_SCALAR, axis=None), BAD_MSG),
    (Within(x=W43, low=1, high=0), "a range [1, 0] no value lies in"),
    (Within(x=W43, low=float("nan"), high=1), "a range [nan, 1] no value lies in"),
    (Within(x=src(3, dtype="bool"), low=0, high=1), "a range of bool values"),
    (Within(x=src(3, dtype="complex64"), low=0, high=1), "a range of complex64 values"),
    (Within(x=BAD, low=0, high=1), BAD_MSG),
    (Within(x=W43, low="0", high=True), "a range of str and bool, no numbers"),  # type: ignore[arg-type]
    (MatMul(a=src(3), b=src(3, 2)), "matmul of ranks 1 and 2 (a matrix by a matrix or a vector)"),
    (MatMul(a=src(2, 4, 3), b=src(3, 2)), "matmul of ranks 3 and 2 (a matrix by a matrix or a vector)"),
    (MatMul(a=src(), b=src()), "matmul of ranks 0 and 0 (a matrix by a matrix or a vector)"),
    (MatMul(a=W43, b=src(3, 2, 1)), "matmul of ranks 2 and 3 (a matrix by a matrix or a vector)"),
    (MatMul(a=W43, b=src()), "matmul of ranks 2 and 0 (a matrix by a matrix or a vector)"),
    (MatMul(a=W43, b=src(3, dtype="int8")), "matmul of float32 and int8 (cast one first)"),
    (MatMul(a=W43, b=src(3, 2, dtype="float16")), "matmul of float32 and float16 (cast one first)"),
    (MatMul(a=src(3, dtype="int8"), b=src(3, 2)), "matmul of ranks 1 and 2 (a matrix by a matrix or a vector)"),
    (MatMul(a=src(2, 3, dtype="bool"), b=src(3, 2, dtype="bool")), "matmul of bool"),  # torch's CPU mm refuses it
    (MatMul(a=src(2, 3, dtype="bool"), b=src(4, dtype="bool")), "matmul of bool"),
    (MatMul(a=W43, b=src(4, 5)), "matmul of shapes (4, 3) and (4, 5): inner sizes differ"),
    (MatMul(a=W43, b=src(4)), "matmul of shapes (4, 3) and (4,): inner sizes differ"),
    (MatMul(a=W43, b=src(2, 3, dtype="float16")), "matmul of float32 and float16 (cast one first)"),
    (MatMul(a=src(2, "k"), b=src(3, 2)), "matmul of shapes (2, 'k') and (3, 2): inner sizes differ"),
    (MatMul(a=src(2, "k"), b=src("j", 2)), "matmul of shapes (2, 'k') and ('j', 2): inner sizes differ"),
    (MatMul(a=BAD, b=W43), BAD_MSG),
    (MatMul(a=src(3, 4), b=BAD2), BAD2_MSG),
    (MatMul(a=BAD2, b=BAD), BAD2_MSG),
]


@pytest.mark.parametrize(("expr", "message"), FAILURES)
def test_infer_spec_failure(expr: WeightExpr, message: str) -> None:
    expr = fresh(expr)
    assert bad_message(expr) == message
    assert bad_message(expr) == message  # and again, from the kept answer


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ((8, 1, 3), (4, 1), (8, 4, 3)),
        ((2,), (3,), None),
        ((2, 3), (3, 3), None),
        ((3, 2), (3,), None),
        ((), (), ()),
        ((), (2, 1), (2, 1)),
        ((5, 1), (), (5, 1)),
        ((1,), (1, 1, 4), (1, 1, 4)),
        (("n", 1), (3,), ("n", 3)),
        (("n",), (1,), ("n",)),
        ((1,), ("n",), ("n",)),
        (("n",), ("n",), ("n",)),
        (("n",), ("m",), None),
        (("n",), (2,), None),
    ],
)
def test_broadcast(a: tuple[Dim, ...], b: tuple[Dim, ...], expected: tuple[Dim, ...] | None) -> None:
    assert broadcast(a, b) == expected


SHAPES = st.lists(st.integers(min_value=1, max_value=3), max_size=4).map(tuple)


@settings(max_examples=150, deadline=None)
@given(SHAPES, SHAPES)
def test_broadcast_is_numpys(a: tuple[int, ...], b: tuple[int, ...]) -> None:
    try:
        expected: tuple[int, ...] | None = np.broadcast_shapes(a, b)
    except ValueError:
        expected = None
    assert broadcast(a, b) == expected


@pytest.mark.parametrize(
    ("weight", "transposed", "groups", "expected"),
    [
        (spec(8, 2, 3, 3), False, 1, 8),
        (spec(8, 2, 3, 3), False, 2, 8),
        (spec(8, 2, 3, 3), True, 1, 2),
        (spec(8, 2, 3, 3), True, 2, 4),
        (spec("n", 2), False, 1, "n"),
        (spec(8, "k", 3), True, 2, "k"),
    ],
)
def test_out_channels(weight: TensorSpec, transposed: bool, groups: int, expected: Dim) -> None:
    assert out_channels(weight, transposed=transposed, groups=groups) == expected


# --- structural equality ------------------------------------------------------------------------------


def test_equal_expressions_are_one_key() -> None:
    def build() -> WeightExpr:
        return Binary(
            op="mul",
            a=Cast(x=src(4, 3, dtype="float16"), dtype="float32"),
            b=Fill(shape=(), value=2.0, dtype="float32"),
        )

    a, b = build(), build()
    assert a is not b
    assert a == b and hash(a) == hash(b) and hash(a) == hash(a)
    assert {a: 1}[b] == 1
    assert a == a


def test_a_fill_of_negative_zero_is_not_a_fill_of_zero() -> None:
    # 0.0 == -0.0 in Python, but 1 / x tells them apart: one constant for both would be wrong
    pos, neg = (Fill(shape=(2,), value=v, dtype="float32") for v in (0.0, -0.0))
    assert pos != neg and len({pos, neg}) == 2
    assert Fill(shape=(2,), value=-0.0, dtype="float32") == neg
    assert Fill(shape=(2,), value=0, dtype="int32") == Fill(shape=(2,), value=0.0, dtype="int32")
    assert Fill(shape=(2,), value=-2, dtype="float32") == Fill(shape=(2,), value=-2.0, dtype="float32")  # one tensor


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (src(4, key="a"), src(4, key="b")),
        (src(4), src(4, dtype="int8")),
        (Cast(x=W43, dtype="float16"), Cast(x=W43, dtype="int8")),
        (Cast(x=src(4, key="a"), dtype="int8"), Cast(x=src(4, key="b"), dtype="int8")),
        (Permute(x=W43, dims=(0, 1)), Permute(x=W43, dims=(1, 0))),
        (Unsqueeze(x=W43, dim=0), Unsqueeze(x=W43, dim=1)),
        (Slice(x=W43, dim=0, start=0, stop=1), Slice(x=W43, dim=0, start=0, stop=2)),
        (Fill(shape=(2,), value=1.0, dtype="float32"), Fill(shape=(2,), value=2.0, dtype="float32")),
        (Binary(op="add", a=W43, b=W43), Binary(op="sub", a=W43, b=W43)),
        (Unary(op="neg", x=W43), Unary(op="sqrt", x=W43)),
        (Reshape(x=W43, shape=(12,)), Permute(x=W43, dims=(1, 0))),
        (MatMul(a=src(3, 3, key="a"), b=src(3, 3, key="b")), MatMul(a=src(3, 3, key="b"), b=src(3, 3, key="a"))),
        (
            MatMul(a=src(3, 3, key="a"), b=src(3, 3, key="b")),
            Binary(op="mul", a=src(3, 3, key="a"), b=src(3, 3, key="b")),
        ),
    ],
)
def test_different_expressions_are_different_keys(a: WeightExpr, b: WeightExpr) -> None:
    a, b = fresh(a), fresh(b)
    assert a != b and b != a
    assert len({a: 1, b: 2}) == 2


def test_keys_read_every_field_also_when_first_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weights, "_FIELDS", {})  # each class's field reader is built on first use
    exprs = [
        fresh(e)
        for e in (
            Slice(x=src(4, 6), dim=1, start=2, stop=5),
            Slice(x=src(4, 6), dim=1, start=2, stop=4),  # differs in the last field only
            Quantize(
                x=W43, scale=F32_SCALAR, zero_point=I32_SCALAR, axis=None, quant_min=-8, quant_max=7, dtype="int8"
            ),
            Quantize(
                x=W43, scale=F32_SCALAR, zero_point=I32_SCALAR, axis=None, quant_min=-8, quant_max=7, dtype="int16"
            ),
        )
    ]
    for i, a in enumerate(exprs):
        same = fresh(a)
        assert a == same and hash(a) == hash(same)
        assert all(a != b for b in exprs[i + 1 :])
    assert len(set(exprs)) == len(exprs)


def test_every_expression_has_two_fields_or_more() -> None:
    # an expression's key reads its fields with one attrgetter, which gives a tuple for two or more
    assert all(len(fields(cls)) >= 2 for cls in get_args(WeightExpr))


@pytest.mark.parametrize("other", ["x", 3, None, ("x",)])
def test_an_expression_equals_no_other_value(other: object) -> None:
    assert src(4) != other
    assert Permute(x=W43, dims=(1, 0)) != other


def test_children_subexpressions_sources() -> None:
    a, b = src(2, key="a"), src(2, key="b")
    neg = Unary(op="neg", x=b)
    cat = Concat(xs=(a, neg, a), dim=0)
    q = Quantize(x=cat, scale=F32_SCALAR, zero_point=I32_SCALAR, axis=None, quant_min=0, quant_max=9, dtype="int8")
    assert children(cat) == (a, neg, a)
    assert children(q) == (cat, F32_SCALAR, I32_SCALAR)
    assert children(a) == ()
    assert subexpressions(q) == {q, cat, neg, a, b, F32_SCALAR, I32_SCALAR}
    assert sources(q) == {"a", "b"}
    assert sources(F32_SCALAR) == frozenset()


def test_a_matrix_product_is_one_key_and_computes_from_both_operands() -> None:
    def build() -> MatMul:
        w2, w1 = src(6, 4, key="w2"), src(4, 3, key="w1")
        return MatMul(a=w2, b=w1)

    merged, again = build(), build()
    assert merged is not again and merged == again and hash(merged) == hash(again) and {merged: 1}[again] == 1
    # the weight and the bias of two merged linears both read W2: one subexpression of the two
    bias = MatMul(a=src(6, 4, key="w2"), b=vec(4, key="b1"))
    assert children(merged) == (src(6, 4, key="w2"), src(4, 3, key="w1"))
    assert subexpressions(merged) & subexpressions(bias) == {src(6, 4, key="w2")}
    assert sources(merged) == {"w1", "w2"} and sources(bias) == {"w2", "b1"}
    assert not moves_data(merged)  # arithmetic: an inf in a weight is no inf the old ops read at that place


# --- inverse and unpack, by value ---------------------------------------------------------------------

X234 = np.arange(24, dtype=np.float32).reshape(2, 3, 4)


@pytest.mark.parametrize(
    "layout",
    [
        lambda x: Permute(x=x, dims=(1, 2, 0)),
        lambda x: Permute(x=x, dims=(2, 0, 1)),
        lambda x: Reshape(x=x, shape=(6, 4)),
        lambda x: Unsqueeze(x=x, dim=-2),
        lambda x: PadTo(x=x, dim=1, multiple=4),
        lambda x: PadTo(x=x, dim=-1, multiple=3),
        lambda x: PadTo(x=x, dim=0, multiple=1),
    ],
)
def test_inverse_recovers_the_input(layout: Callable[[WeightExpr], WeightExpr]) -> None:
    x = source_of("x", X234)
    expr = layout(x)
    y_value = value_of(expr, {"x": X234})
    y = source_of("y", y_value)
    back = inverse(expr, y).unwrap()
    assert infer_spec(back) == Success(x.spec)
    np.testing.assert_array_equal(value_of(back, {"y": y_value}), X234)


def test_unpack_recovers_the_input_through_every_layout_op() -> None:
    x = source_of("x", X234)
    packed = PadTo(x=Unsqueeze(x=Reshape(x=Permute(x=x, dims=(2, 0, 1)), shape=(4, 6)), dim=0), dim=2, multiple=4)
    y_value = value_of(packed, {"x": X234})
    assert y_value.shape == (1, 4, 8)
    inner, back = unpack(packed, source_of("y", y_value)).unwrap()
    assert inner == x
    np.testing.assert_array_equal(value_of(back, {"y": y_value}), X234)


def test_unpack_stops_at_other_ops() -> None:
    cast = Cast(x=W43, dtype="float16")
    y = src(4, 3, dtype="float16", key="y")
    assert unpack(cast, y) == Success((cast, y))
    inner, back = unpack(Permute(x=cast, dims=(1, 0)), src(3, 4, dtype="float16", key="y")).unwrap()
    assert inner == cast and infer_spec(back) == Success(spec(4, 3, dtype="float16"))


def _inverse_message(expr: WeightExpr) -> str:
    result = inverse(expr, src(1, key="y"))
    assert isinstance(result, Failure), result
    bad = result.failure()
    assert isinstance(bad, BadExpr)
    assert (bad.node, bad.code) == (EXPR_NODE, "bad-weight-expr")
    return bad.message


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        (W43, "Source has no inverse"),
        (Cast(x=W43, dtype="float16"), "Cast has no inverse"),
        (Slice(x=W43, dim=0, start=0, stop=1), "Slice has no inverse"),
        (SumOver(x=W43, dims=(0,), dtype="float32"), "SumOver has no inverse"),
        (Concat(xs=(W43,), dim=0), "Concat has no inverse"),
        (F32_SCALAR, "Fill has no inverse"),
        (Binary(op="add", a=W43, b=W43), "Binary has no inverse"),
        (Unary(op="neg", x=W43), "Unary has no inverse"),
        (quantize(), "Quantize has no inverse"),
        (Dequantize(x=I8, scale=F32_SCALAR, zero_point=I32_SCALAR, axis=None), "Dequantize has no inverse"),
        (Reshape(x=src("n", 3), shape=(3, 4)), "cannot invert over symbolic shape ('n', 3)"),
        (Unsqueeze(x=src(2, "n"), dim=0), "cannot invert over symbolic shape (2, 'n')"),
        (PadTo(x=src("n", 3), dim=1, multiple=4), "cannot invert over symbolic shape ('n', 3)"),
        (PadTo(x=src(3, 5), dim=2, multiple=4), "dim 2 does not fit (3, 5)"),
        (PadTo(x=src(3, 5), dim=-3, multiple=4), "dim -3 does not fit (3, 5)"),
        (Reshape(x=BAD, shape=(12,)), BAD_MSG),
        (PadTo(x=BAD2, dim=0, multiple=2), BAD2_MSG),
    ],
)
def test_inverse_failure(expr: WeightExpr, message: str) -> None:
    assert _inverse_message(expr) == message


def test_unpack_fails_where_inverse_does() -> None:
    result = unpack(Permute(x=PadTo(x=src("n", 3), dim=1, multiple=4), dims=(1, 0)), src(4, "n", key="y"))
    assert isinstance(result, Failure)
    assert result.failure().message == "cannot invert over symbolic shape ('n', 3)"


# --- fold_batch_norm, by value ------------------------------------------------------------------------


def _reference(
    w: Array,
    b: Array | None,
    mean: Array,
    var: Array,
    gamma: Array | None,
    beta: Array | None,
    eps: float,
    transposed: bool,
    groups: int,
) -> tuple[Array, Array]:
    """The textbook fold in float32: s = gamma / sqrt(var + eps), W * s per output channel,
    (b - mean) * s + beta; missing gamma, beta, bias are 1, 0, 0."""
    f32 = np.float32
    oc = mean.shape[0]
    g_ = gamma.astype(f32) if gamma is not None else np.ones(oc, f32)
    s = g_ / np.sqrt(var.astype(f32) + f32(eps))
    out = w.astype(f32)
    if transposed:  # (IC, OC/g, ...): output channel g*(OC/g)+j sits at [g*(IC/g)+i, j]
        icg, ocg = w.shape[0] // groups, w.shape[1]
        for g in range(groups):
            for i in range(icg):
                for j in range(ocg):
                    out[g * icg + i, j] *= s[g * ocg + j]
    else:
        for o in range(oc):
            out[o] *= s[o]
    b_ = b.astype(f32) if b is not None else np.zeros(oc, f32)
    be = beta.astype(f32) if beta is not None else np.zeros(oc, f32)
    return out, (b_ - mean.astype(f32)) * s + be


def _fold_case(
    wshape: tuple[int, ...],
    oc: int,
    *,
    dtype: str = "float32",
    pdtype: str | None = None,
    has: str = "bgB",
    eps: float = 1e-3,
    transposed: bool = False,
    groups: int = 1,
    seed: int = 0,
) -> None:
    """Fold random parameters (``has``: b = bias, g = gamma, B = beta) and check the values."""
    rng = np.random.default_rng(seed)
    np_w, np_p = NP_DTYPES[dtype], NP_DTYPES[pdtype or dtype]
    # multiples of 1/8 in a small range: exact in every float dtype
    w = (rng.integers(-16, 17, wshape) / 8).astype(np_w)
    env: dict[str, Array] = {
        "w": w,
        "b": (rng.integers(-16, 17, oc) / 8).astype(np_w),
        "mean": (rng.integers(-16, 17, oc) / 8).astype(np_p),
        "var": (rng.integers(1, 33, oc) / 8).astype(np_p),
        "gamma": (rng.integers(-16, 17, oc) / 8).astype(np_p),
        "beta": (rng.integers(-16, 17, oc) / 8).astype(np_p),
    }

    def opt(key: str, flag: str) -> Source | None:
        return source_of(key, env[key]) if flag in has else None

    result = fold_batch_norm(
        weight=source_of("w", w),
        bias=opt("b", "b"),
        mean=source_of("mean", env["mean"]),
        var=source_of("var", env["var"]),
        gamma=opt("gamma", "g"),
        beta=opt("beta", "B"),
        eps=eps,
        transposed=transposed,
        groups=groups,
    )
    new_w, new_b = result.unwrap()
    assert infer_spec(new_w) == Success(spec(*wshape, dtype=dtype))
    assert infer_spec(new_b) == Success(spec(oc, dtype=dtype))
    ref_w, ref_b = _reference(
        w,
        env["b"] if "b" in has else None,
        env["mean"],
        env["var"],
        env["gamma"] if "g" in has else None,
        env["beta"] if "B" in has else None,
        eps,
        transposed,
        groups,
    )
    got_w, got_b = value_of(new_w, env), value_of(new_b, env)
    tol = 1e-6 if dtype == "float32" else 2e-3
    np.testing.assert_allclose(got_w.astype(np.float64), ref_w.astype(np_w).astype(np.float64), rtol=tol, atol=tol)
    np.testing.assert_allclose(got_b.astype(np.float64), ref_b.astype(np_w).astype(np.float64), rtol=tol, atol=tol)
    for e in subexpressions(new_w) | subexpressions(new_b):
        # every computation is in float32, and no cast is a copy to the dtype its operand has
        if isinstance(e, Binary | Unary):
            assert infer_spec(e).unwrap().dtype == "float32", e
        if isinstance(e, Cast):
            assert infer_spec(e.x).unwrap().dtype != e.dtype, e


@pytest.mark.parametrize("has", ["bgB", "", "b", "g", "B", "gB"])
def test_fold_linear(has: str) -> None:
    _fold_case((3, 5), 3, has=has)  # odd out channels: groups default to 1


@pytest.mark.parametrize("has", ["bgB", "", "bB"])
def test_fold_conv(has: str) -> None:
    _fold_case((4, 2, 3, 3), 4, has=has, eps=0.25)


def test_fold_grouped_conv() -> None:
    _fold_case((4, 3, 1, 1), 4, groups=2)  # IC/g = 3 does not divide: only OC must


@pytest.mark.parametrize(
    ("wshape", "oc", "groups", "has"),
    [
        ((4, 3, 2), 3, 1, "bgB"),
        ((4, 3, 2), 6, 2, "bgB"),
        ((4, 3, 2), 6, 2, ""),
        ((6, 2, 2, 2), 6, 3, "gB"),
        ((2, 5), 5, 1, "b"),
    ],
)
def test_fold_transposed(wshape: tuple[int, ...], oc: int, groups: int, has: str) -> None:
    _fold_case(wshape, oc, transposed=True, groups=groups, has=has, seed=1)


@pytest.mark.parametrize("pdtype", ["float16", "float32"])
@pytest.mark.parametrize("has", ["bgB", ""])
def test_fold_float16(pdtype: str, has: str) -> None:
    _fold_case((4, 2, 3), 4, dtype="float16", pdtype=pdtype, has=has, seed=2)
    _fold_case((2, 4, 3), 8, dtype="float16", pdtype=pdtype, has=has, transposed=True, groups=2, seed=3)


def test_fold_float16_is_computed_in_float32() -> None:
    """(60000 - -60000) overflows float16 but not float32; the result, 30000, fits float16 again."""
    h = np.float16
    w = np.full((2, 1), 4, h)
    env = {
        "w": w,
        "b": np.array([60000, 1], h),
        "mean": np.array([-60000, -1], h),
        "var": np.array([1, 1], h),
        "gamma": np.array([0.25, 2], h),
    }
    weight = source_of("w", w)
    new_w, new_b = fold_batch_norm(
        weight=weight,
        bias=source_of("b", env["b"]),
        mean=source_of("mean", env["mean"]),
        var=source_of("var", env["var"]),
        gamma=source_of("gamma", env["gamma"]),
        beta=None,
        eps=0.0,
    ).unwrap()
    np.testing.assert_array_equal(value_of(new_b, env), np.array([30000, 4], h))
    np.testing.assert_array_equal(value_of(new_w, env), np.array([[1], [8]], h))
    assert Cast(x=weight, dtype="float32") in subexpressions(new_w)


def test_a_float64_fold_is_computed_in_float64() -> None:
    # float32 arithmetic would lose the 1e-12 in the bias
    d = np.float64
    env = {"w": np.ones((1, 1), d), "b": np.array([1e-12], d), "mean": np.zeros(1, d), "var": np.full(1, 1.0, d)}
    new_w, new_b = fold_batch_norm(
        weight=source_of("w", env["w"]),
        bias=source_of("b", env["b"]),
        mean=source_of("mean", env["mean"]),
        var=source_of("var", env["var"]),
        gamma=None,
        beta=None,
        eps=0.0,
    ).unwrap()
    assert all(infer_spec(e).unwrap().dtype == "float64" for e in subexpressions(new_b) | subexpressions(new_w))
    np.testing.assert_array_equal(value_of(new_b, env), np.array([1e-12], d))


def test_fold_eps_is_added_to_var() -> None:
    env = {"w": np.ones((1, 1), np.float32), "mean": np.zeros(1, np.float32), "var": np.full(1, 3, np.float32)}
    new_w, new_b = fold_batch_norm(
        weight=source_of("w", env["w"]),
        bias=None,
        mean=source_of("mean", env["mean"]),
        var=source_of("var", env["var"]),
        gamma=None,
        beta=None,
        eps=13.0,
    ).unwrap()
    np.testing.assert_array_equal(value_of(new_w, env), np.array([[0.25]], np.float32))
    np.testing.assert_array_equal(value_of(new_b, env), np.zeros(1, np.float32))


@pytest.mark.parametrize(
    ("weight", "transposed", "groups", "message"),
    [
        (BAD, False, 1, BAD_MSG),
        (src(4), False, 1, "cannot fold into a weight of shape (4,)"),
        (src(4), True, 1, "cannot fold into a weight of shape (4,)"),  # was an IndexError
        (src(), False, 1, "cannot fold into a weight of shape ()"),
        (src("n", 3, 1, 1), False, 1, "cannot fold into a weight of shape ('n', 3, 1, 1)"),
        (src(4, "k", 1), True, 2, "cannot fold into a weight of shape (4, 'k', 1)"),
        (src(4, "k", 1, 1), False, 1, "cannot fold into a weight of shape (4, 'k', 1, 1)"),
        (src(3, 2, 1, 1), True, 2, "cannot fold into a weight of shape (3, 2, 1, 1)"),
        (src(3, 4, 1, 1), False, 2, "cannot fold into a weight of shape (3, 4, 1, 1)"),
    ],
)
def test_fold_failure(weight: WeightExpr, transposed: bool, groups: int, message: str) -> None:
    result = fold_batch_norm(
        weight=weight,
        bias=None,
        mean=vec(4),
        var=vec(4),
        gamma=None,
        beta=None,
        eps=1e-5,
        transposed=transposed,
        groups=groups,
    )
    assert isinstance(result, Failure), result
    bad = result.failure()
    assert isinstance(bad, BadExpr)
    assert (bad.node, bad.code, bad.message) == (EXPR_NODE, "bad-weight-expr", message)


def test_the_values_of_an_integer_fill_are_known_as_a_captured_vectors_are() -> None:
    assert int_values(Fill(shape=(3,), value=2.0, dtype="uint8")) == (2, 2, 2)
    assert int_values(Fill(shape=(), value=-1.0, dtype="int32")) == (-1,)  # a scalar: one value
    assert int_values(Fill(shape=(SMALL_VALUES,), value=0.0, dtype="int64")) == (0,) * SMALL_VALUES
    # held by value no larger than a captured one is, of rank 1 at most, of an integer dtype
    assert int_values(Fill(shape=(SMALL_VALUES + 1,), value=0.0, dtype="int64")) is None
    assert int_values(Fill(shape=(2, 2), value=0.0, dtype="int64")) is None
    assert int_values(Fill(shape=(2,), value=1.0, dtype="bool")) is None
    assert int_values(Source(key="z", spec=spec(2, dtype="int64"))) is None  # the program's: captured

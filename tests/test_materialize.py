"""``adapters.weights.materialize``: every result owns its storage, so two derived weights never
change together, and inputs are never touched."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import adapters.weights as mat
from adapters.weights import Memo, materialize
from fxpure.snapshot import TensorSpec
from fxpure.weights import (
    Binary,
    Cast,
    Dequantize,
    Fill,
    MatMul,
    MaxOver,
    Permute,
    Quantize,
    Reshape,
    Slice,
    Source,
    Unary,
    WeightExpr,
    known_values,
)

W = Source(key="w", spec=TensorSpec(shape=(2, 3), dtype="float32"))
DOUBLED = Binary(op="mul", a=W, b=Fill(shape=(), value=2.0, dtype="float32"))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _inputs() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}


def test_a_reshaped_copy_of_a_derived_weight_has_its_own_storage() -> None:
    reshaped = Reshape(x=DOUBLED, shape=(3, 2))
    expected = {DOUBLED: _inputs()["w"] * 2, reshaped: (_inputs()["w"] * 2).reshape(3, 2)}
    for order in ((DOUBLED, reshaped), (reshaped, DOUBLED)):
        tensors, memo = _inputs(), Memo()
        first, second = (materialize(e, tensors, memo) for e in order)
        assert torch.equal(first, expected[order[0]]) and torch.equal(second, expected[order[1]])
        assert _storage(first) != _storage(second)
        first.add_(100)  # a later in-place pass on one weight leaves the other as it was
        assert torch.equal(second, expected[order[1]])


def test_views_and_no_op_casts_of_an_input_are_copies_and_the_input_is_untouched() -> None:
    views: list[WeightExpr] = [Permute(x=W, dims=(1, 0)), Cast(x=W, dtype="float32"), Reshape(x=W, shape=(6,))]
    for expr in views:
        tensors = _inputs()
        out = materialize(expr, tensors, Memo())
        assert _storage(out) != _storage(tensors["w"])
        out.zero_()
        assert torch.equal(tensors["w"], _inputs()["w"])


def test_a_weight_asked_for_twice_from_one_memo_comes_back_twice_as_its_own_copy() -> None:
    tensors, memo = _inputs(), Memo()
    a, b = materialize(DOUBLED, tensors, memo), materialize(DOUBLED, tensors, memo)
    assert torch.equal(a, b) and _storage(a) != _storage(b)


def _src(key: str, t: torch.Tensor) -> Source:
    return Source(key=key, spec=TensorSpec(shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch.")))


def test_quantize_rounds_ties_as_torch_does() -> None:
    import torchao.quantization.pt2e  # noqa: F401  registers quantized_decomposed

    # values at (or within a rounding of) k.5 steps: x / scale and x * (1 / scale) round some apart
    scale = 0.0123
    x = (torch.arange(-100, 100).float() + 0.5) * scale
    tensors = {"x": x, "s": torch.tensor(scale), "z": torch.tensor(0)}
    e = Quantize(
        x=_src("x", x),
        scale=_src("s", tensors["s"]),
        zero_point=_src("z", tensors["z"]),
        axis=None,
        quant_min=-128,
        quant_max=127,
        dtype="int8",
    )
    # the scale is a tensor, as in the .tensor overload (the default one takes a Python double)
    qd = torch.ops.quantized_decomposed
    want = qd.quantize_per_tensor.tensor(x, tensors["s"], tensors["z"], -128, 127, torch.int8)
    assert torch.equal(materialize(e, tensors), want)
    per_channel = replace(e, x=_src("x", x[None]), scale=_src("s", s := torch.full((200,), scale)), axis=1)
    per_channel = replace(per_channel, zero_point=_src("z", z := torch.zeros(200, dtype=torch.int64)))
    want = qd.quantize_per_channel(x[None], s, z, 1, -128, 127, torch.int8)
    assert torch.equal(materialize(per_channel, {"x": x[None], "s": s, "z": z}), want)


def test_a_float64_dequantize_is_computed_in_float64() -> None:
    q, s, z = (
        torch.tensor([123456789, 7], dtype=torch.int32),
        torch.tensor([0.1], dtype=torch.float64),
        torch.tensor([0]),
    )
    e = Dequantize(x=_src("q", q), scale=_src("s", s), zero_point=_src("z", z), axis=None, dtype="float64")
    assert torch.equal(materialize(e, {"q": q, "s": s, "z": z}), q.double() * 0.1)


def test_a_slice_of_a_derived_weight_holds_only_its_own_bytes() -> None:
    # one group's weight out of a fused one: a view of the whole would be saved whole
    w = torch.randn(8, 3)
    fused = Binary(op="mul", a=_src("w", w), b=Fill(shape=(), value=2.0, dtype="float32"))
    memo: Memo = {}
    groups = [materialize(Slice(x=fused, dim=0, start=i, stop=i + 4), {"w": w}, memo) for i in (0, 4)]
    for i, g in zip((0, 4), groups, strict=True):
        assert g.untyped_storage().nbytes() == g.numel() * g.element_size() == 4 * 3 * 4
        assert torch.equal(g, w[i : i + 4] * 2)


def test_a_per_channel_scale_from_a_weights_greatest_magnitude() -> None:
    # amax(|w|) over all but the output channel, / 127: how an observer sets a symmetric int8 scale;
    # checked against plain Python over the numbers, not torch
    rows = [[0.5, -2.0, 1.0], [-0.25, 0.0, 0.125], [3.0, -3.5, 0.0], [-1.0, -1.0, -1.0]]
    w = torch.tensor(rows).reshape(4, 3, 1, 1)
    source = _src("w", w)
    scale = Binary(
        op="div", a=MaxOver(x=Unary(op="abs", x=source), dims=(1, 2, 3)), b=Fill(shape=(), value=127.0, dtype="float32")
    )
    got = materialize(scale, {"w": w}, Memo())
    assert got.shape == (4,) and got.tolist() == [torch.tensor(max(abs(v) for v in r) / 127).item() for r in rows]
    signs = materialize(Unary(op="sign", x=source), {"w": w}, Memo())
    assert signs.reshape(4, 3).tolist() == [[(v > 0) - (v < 0) for v in r] for r in rows]
    q = torch.tensor([[-128, 5], [7, -3]], dtype=torch.int8)
    ints = materialize(MaxOver(x=Unary(op="abs", x=_src("q", q)), dims=(0,)), {"q": q}, Memo())
    assert ints.dtype == torch.int8 and ints.tolist() == [7, 5]  # |-128| wraps to -128 in int8, as in torch


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_the_number_a_0_d_fill_is_known_to_hold_is_the_one_it_computes_to(dtype: str) -> None:
    # a review found float16 numbers rounded once (to 1.0009765625) where torch rounds to float32
    # first, then to float16 (1.0): the plan's ConstantInfo.values then differed from the program's
    values = [1.0004882812509095, 2.9802322388562674e-08, 0.1, -0.0, 65519.0, 65520.0, -1e9, 1e40, 5e-324]
    for v in [
        *values,
        *(float(x) for x in torch.randn(200, dtype=torch.float64) * 10.0 ** torch.randint(-9, 7, (200,))),
    ]:
        fill = Fill(shape=(), value=v, dtype=dtype)
        (known,) = known_values(fill) or (None,)
        computed = materialize(fill, {}).item()
        assert known is not None and (known, math.copysign(1, known)) == (computed, math.copysign(1, computed)), v


@pytest.mark.parametrize("expr", ["transposed", "reshaped"])
def test_a_result_has_the_strides_an_empty_tensor_of_its_shape_has(expr: str) -> None:
    # found by a hunt: (1, 10) transposed (and reshaped to (10, 1, 1, 1)) kept the view's strides,
    # (1, 10), which torch calls contiguous (its size-1 dims' strides do not count) but ExecuTorch reads
    # as another dim order: its portable conv refused such a weight when the .pte ran
    w = Source(key="row", spec=TensorSpec(shape=(1, 10), dtype="float32"))
    made = (
        Permute(x=w, dims=(1, 0)) if expr == "transposed" else Reshape(x=Permute(x=w, dims=(1, 0)), shape=(10, 1, 1, 1))
    )
    row = torch.arange(10, dtype=torch.float32).reshape(1, 10)
    out = materialize(made, {"row": row}, Memo())
    assert out.stride() == torch.empty(out.shape).stride() and out.dim_order() == tuple(range(out.dim()))
    assert torch.equal(out.flatten(), row.flatten())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm_affine_computes_what_an_eval_batch_norm_does(dtype: torch.dtype, affine: bool) -> None:
    # the outside author's standalone batch norm as x * scale + shift: checked against torch's own
    from fxpure.weights import batch_norm_affine

    torch.manual_seed(0)
    c = 5
    stats = {"m": torch.randn(c), "v": torch.rand(c) + 0.5, "g": torch.randn(c), "b": torch.randn(c)}
    stats = {k: v.to(dtype) for k, v in stats.items()}
    name = str(dtype).removeprefix("torch.")
    vec = {k: Source(key=k, spec=TensorSpec(shape=(c,), dtype=name)) for k in stats}
    gamma, beta = (vec["g"], vec["b"]) if affine else (None, None)
    scale, shift = batch_norm_affine(mean=vec["m"], var=vec["v"], gamma=gamma, beta=beta, eps=1e-3, dtype=name)
    s, t = materialize(scale, stats), materialize(shift, stats)
    assert s.dtype == t.dtype == dtype and s.shape == t.shape == (c,)
    x = torch.randn(2, c, 3, 3).to(dtype)
    g, b = (stats["g"], stats["b"]) if affine else (None, None)
    want = torch.nn.functional.batch_norm(
        x.double(),
        stats["m"].double(),
        stats["v"].double(),
        None if g is None else g.double(),
        None if b is None else b.double(),
        eps=1e-3,
    )
    got = x.double() * s.double().reshape(1, c, 1, 1) + t.double().reshape(1, c, 1, 1)
    tolerance = {torch.float16: 2e-2, torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    assert torch.allclose(got, want, atol=tolerance, rtol=tolerance)


def _random(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-8, 8, shape, generator=g).to(dtype)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int64]
)
@pytest.mark.parametrize("n", [5, 1, 0, None])  # None: a matrix by a vector
def test_a_matrix_product_is_torchs_mm_in_the_operands_dtype(dtype: torch.dtype, n: int | None) -> None:
    g = torch.Generator().manual_seed(1)
    a = _random((4, 3), dtype, g)
    b = _random((3,) if n is None else (3, n), dtype, g)
    tensors = {"a": a, "b": b}
    before = {k: v.clone() for k, v in tensors.items()}
    got = materialize(MatMul(a=_src("a", a), b=_src("b", b)), tensors, Memo())
    # the oracle: torch.mm on the tensors themselves (a vector as a column, and back)
    want = torch.mm(a, b) if n is not None else torch.mm(a, b.unsqueeze(1)).squeeze(1)
    assert got.dtype == dtype and got.shape == want.shape == ((4, n) if n is not None else (4,))
    if n is None and dtype.is_floating_point:  # (mv may sum in another order than mm of a column)
        assert torch.allclose(
            got.double(), want.double(), rtol=1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-6
        )
    else:
        assert torch.equal(got, want)
    assert all(torch.equal(tensors[k], before[k]) for k in tensors)  # the inputs untouched


def test_an_integer_matrix_product_wraps_in_its_dtype() -> None:
    # computed in the operands' dtype, as documented: 100 * 100 * 2 = 20000 wraps to 32 in int8
    a, b = torch.full((1, 2), 100, dtype=torch.int8), torch.full((2, 1), 100, dtype=torch.int8)
    got = materialize(MatMul(a=_src("a", a), b=_src("b", b)), {"a": a, "b": b})
    assert got.dtype == torch.int8 and got.item() == 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_maximum_and_minimum_clamp_a_weight_as_torch_clamp_does(dtype: torch.dtype) -> None:
    name = str(dtype).removeprefix("torch.")
    w = Source(key="w", spec=TensorSpec(shape=(2, 3), dtype=name))
    low, high = (Fill(shape=(), value=v, dtype=name) for v in (-2, 3))
    clamped = Binary(op="minimum", a=Binary(op="maximum", a=w, b=low), b=high)
    values = torch.tensor([[-5, -2, 0], [1, 3, 7]], dtype=dtype)
    out = materialize(clamped, {"w": values}, Memo())
    assert out.dtype is dtype and out.tolist() == [[-2, -2, 0], [1, 3, 3]]


def test_maximum_and_minimum_keep_a_nan_of_either_operand() -> None:
    w = Source(key="w", spec=TensorSpec(shape=(3,), dtype="float32"))
    nan = Fill(shape=(), value=math.nan, dtype="float32")
    values = {"w": torch.tensor([1.0, math.nan, -1.0])}
    floored = materialize(Binary(op="maximum", a=w, b=Fill(shape=(), value=0.0, dtype="float32")), values, Memo())
    assert floored[0] == 1 and math.isnan(floored[1]) and floored[2] == 0
    assert torch.isnan(materialize(Binary(op="minimum", a=w, b=nan), values, Memo())).all()


def test_merged_linears_weight_and_bias_share_their_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    # W2 @ W1 and W2 @ b1 + b2 of two linears, and W2 @ W1 again in another constant: with one
    # memo, each distinct product is computed once, and each result is its own tensor
    g = torch.Generator().manual_seed(2)
    t = {"w1": torch.randn(4, 3, generator=g), "b1": torch.randn(4, generator=g), "w2": torch.randn(6, 4, generator=g)}
    t["b2"] = torch.randn(6, generator=g)
    w1, b1, w2, b2 = (_src(k, v) for k, v in t.items())
    calls: list[WeightExpr] = []
    real = mat._RULES[MatMul]

    def counted(e: MatMul, ev: mat.Eval) -> torch.Tensor:
        calls.append(e)
        return real(e, ev)

    monkeypatch.setitem(mat._RULES, MatMul, counted)
    weight = MatMul(a=w2, b=w1)
    bias = Binary(op="add", a=MatMul(a=w2, b=b1), b=b2)
    twice = Binary(op="add", a=MatMul(a=w2, b=w1), b=MatMul(a=w2, b=w1))
    memo = Memo()
    got_w, got_b, got_twice, got_w_again = (materialize(e, t, memo) for e in (weight, bias, twice, weight))
    assert sorted(map(repr, calls)) == sorted(map(repr, [weight, MatMul(a=w2, b=b1)]))
    assert torch.equal(got_w, torch.mm(t["w2"], t["w1"])) and torch.equal(got_w_again, got_w)
    assert torch.allclose(got_b, torch.mm(t["w2"], t["b1"].unsqueeze(1)).squeeze(1) + t["b2"], atol=1e-6)
    assert torch.equal(got_twice, torch.mm(t["w2"], t["w1"]) * 2)
    assert len({_storage(x) for x in (got_w, got_b, got_twice, got_w_again)}) == 4

"""fold_binary on hand-built snapshots: every op, operand order and operand kind on every producer
spelling, checked against the op's own arithmetic by a small pure-Python evaluator; and every
rejection reason with its exact code, node and pattern path."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable
from dataclasses import replace

import pytest
from returns.result import Failure

import fxpure
from fxpure import NodeRef, plan, rewrite, verify
from fxpure.plan import MAX_RUNS
from fxpure.reasons import GENERIC_CODES, Declined
from fxpure.rules.fold_binary import fold_binary
from fxpure.serial import to_data
from fxpure.snapshot import Arg, DTypeArg, GraphSnapshot, TensorSpec
from fxpure.testing import GraphBuilder, spec
from fxpure.weights import Binary, Cast, Fill, Reshape, Source, Unary, WeightExpr, infer_spec, subexpressions

RULE = fold_binary()
B, IC, OC, IN, F, T = 2, 4, 6, 5, 6, 3
Shape = tuple[int | str, ...]
Values = tuple[tuple[int, ...], list[float]]

# --- a tiny evaluator of the expressions the rule writes (the oracle does not use the rule's code) --------


def _strides(shape: tuple[int, ...]) -> list[int]:
    out, n = [], 1
    for d in reversed(shape):
        out.append(n)
        n *= d
    return out[::-1]


def _at(shape: tuple[int, ...], values: list[float], index: tuple[int, ...]) -> float:
    local = index[len(index) - len(shape) :]
    flat = sum((i if d != 1 else 0) * s for i, d, s in zip(local, shape, _strides(shape), strict=True))
    return values[flat]


def evaluate(e: WeightExpr, env: dict[str, Values]) -> Values:
    """Value of an expression as (shape, row-major values), in Python floats."""
    match e:
        case Source():
            return env[e.key]
        case Cast():
            return evaluate(e.x, env)
        case Fill():
            return e.shape, [e.value] * math.prod(e.shape)
        case Reshape():
            shape, values = evaluate(e.x, env)
            assert math.prod(shape) == math.prod(e.shape)
            return e.shape, values
        case Unary(op="neg"):
            shape, values = evaluate(e.x, env)
            return shape, [-v for v in values]
        case Binary():
            (sa, va), (sb, vb) = evaluate(e.a, env), evaluate(e.b, env)
            rank = max(len(sa), len(sb))
            pa, pb = (1,) * (rank - len(sa)) + sa, (1,) * (rank - len(sb)) + sb
            assert all(a == b or 1 in (a, b) for a, b in zip(pa, pb, strict=True)), (sa, sb)
            dims = tuple(max(a, b) for a, b in zip(pa, pb, strict=True))
            fn: dict[str, Callable[[float, float], float]] = {
                "add": lambda a, b: a + b,
                "sub": lambda a, b: a - b,
                "mul": lambda a, b: a * b,
                "div": lambda a, b: a / b,
            }
            return dims, [fn[e.op](_at(sa, va, i), _at(sb, vb, i)) for i in itertools.product(*map(range, dims))]
    raise AssertionError(f"the rule wrote an expression the oracle does not know: {e!r}")


def values_for(shape: Shape, start: float, step: float) -> Values:
    dims = tuple(d for d in shape if isinstance(d, int))
    return dims, [start + step * i for i in range(math.prod(dims))]


# --- the graphs --------------------------------------------------------------------------------------

PRODUCERS = ("conv2d", "conv_transpose_g2", "conv1d", "linear", "addmm", "mm", "addmm_nd")
LINEARS = ("linear", "addmm", "mm", "addmm_nd")
W_SHAPES: dict[str, Shape] = {
    "conv2d": (OC, IC, 3, 3),
    "conv1d": (OC, IC, 3),
    "conv_transpose_g2": (IC, OC // 2, 5, 5),
    **{k: (F, IN) for k in LINEARS},
}
X_SHAPES: dict[str, Shape] = {
    "conv2d": (IC, 8, 8),
    "conv1d": (IC, 8),
    "conv_transpose_g2": (IC, 6, 6),
    "addmm_nd": (T, IN),
    **{k: (IN,) for k in ("linear", "addmm", "mm")},
}
Y_SHAPES: dict[str, Shape] = {
    "conv2d": (OC, 6, 6),
    "conv1d": (OC, 6),
    "conv_transpose_g2": (OC, 10, 10),
    "addmm_nd": (T, F),
    **{k: (F,) for k in ("linear", "addmm", "mm")},
}
TRANSPOSED: dict[str, Arg] = {
    "stride": (1, 1),
    "padding": (0, 0),
    "dilation": (1, 1),
    "output_padding": (0, 0),
    "transposed": True,
}


def _producer(g: GraphBuilder, kind: str, x: NodeRef, w: NodeRef, b: NodeRef | None, y: TensorSpec) -> NodeRef:
    """The conv or linear in spelling ``kind``, output ``y``."""
    if kind in ("conv2d", "conv1d"):
        return g.call(f"aten.{kind}.default", name="conv", out=y, input=x, weight=w, bias=b)
    if kind == "conv_transpose_g2":
        return g.call("aten.convolution.default", name="conv", out=y, input=x, weight=w, bias=b, groups=2, **TRANSPOSED)
    if kind == "linear":
        return g.call("aten.linear.default", name="lin", out=y, input=x, weight=w, bias=b)
    t = g.call("aten.permute_copy.default", name="lin_t", out=(IN, F), self=w, dims=(1, 0))
    if kind == "addmm" and b is not None:
        return g.call("aten.addmm.default", name="lin", out=y, self=b, mat1=x, mat2=t)
    if kind in ("addmm", "mm"):
        return g.call("aten.mm.default", name="lin", out=y, self=x, mat2=t)
    flat = g.call("aten.view_copy.default", name="lin_in", out=(B * T, IN), self=x, size=(-1, IN))
    if b is None:
        prod = g.call("aten.mm.default", name="lin", out=spec(B * T, F, dtype=y.dtype), self=flat, mat2=t)
    else:
        prod = g.call("aten.addmm.default", name="lin", out=spec(B * T, F, dtype=y.dtype), self=b, mat1=flat, mat2=t)
    return g.call("aten.view_copy.default", name="lin_out", out=y, self=prod, size=(-1, T, F))


def graph(
    *,
    producer: str = "conv2d",
    target: str = "aten.mul.Tensor",
    first: bool = True,
    operand: str = "tensor",
    c_shape: Shape | None = None,
    c_dtype: str = "float32",
    alpha: Arg = None,
    rounding_mode: str | None = None,
    bias: bool = True,
    lifted: bool = True,
    weight_is_input: bool = False,
    weight_dtype: str = "float32",
    weight_shape: Shape | None = None,
    out_dtype: str | None = None,
    extra_user: str | None = None,
    batch: int | str = B,
    relu: bool = False,
    tied: bool = False,
    dropout: bool | None = None,
) -> GraphSnapshot:
    """x -> conv | linear (``producer``) -> ``target``(y, c) (``first``) or (c, y) -> output, with knobs
    for every plan shape and rejection. ``operand``: "scalar" (2.5), "tensor" (a buffer of
    ``c_shape``, by default one entry per output channel), "input" (computed at run time)."""
    linear = producer in LINEARS
    g = GraphBuilder(dialect="edge" if producer in ("addmm", "mm", "addmm_nd") else "aten", lifted=lifted)
    w_shape = weight_shape or W_SHAPES[producer]
    w = None if weight_is_input else g.parameter("w", w_shape, weight_dtype, key="m.weight")
    b = g.parameter("b", (OC,), weight_dtype, key="m.bias") if bias and producer != "mm" else None
    if c_shape is None:
        c_shape = (OC,) if linear else (OC, *(1,) * (len(Y_SHAPES[producer]) - 1))
    c: Arg = 2.5
    if operand == "tensor":
        c = g.buffer("c", c_shape, c_dtype, key="m.c")
    x = g.input("x", (batch, *X_SHAPES[producer]), weight_dtype)
    if operand == "input":
        c = g.input("c", c_shape, c_dtype)
    w = w or g.input("w", w_shape, weight_dtype)
    y_spec = spec(batch, *Y_SHAPES[producer], dtype=weight_dtype)
    if relu:
        y = g.call("aten.relu.default", name="relu", out=y_spec, self=x)
    else:
        y = _producer(g, producer, x, w, b, y_spec)
    if dropout is not None:  # a dropout of the output, ``train=dropout``
        y = g.call("aten.dropout.default", name="drop", out=y_spec, self=y, p=0.1, train=dropout)
    operands: dict[str, Arg] = {"self": y, "other": c} if first else {"self": c, "other": y}
    if alpha is not None:
        operands["alpha"] = alpha
    if target.endswith("Tensor_mode"):
        operands["rounding_mode"] = rounding_mode
    out = spec(*y_spec.shape, dtype=out_dtype or weight_dtype)
    outputs: list[Arg] = [g.call(target, name="bin", out=out, **operands)]
    if extra_user is not None:
        outputs.append(NodeRef(extra_user))
    if tied:  # another op reads the same weight
        other = "aten.linear.default" if linear else "aten.conv2d.default" if producer == "conv2d" else None
        assert other is not None
        outputs.append(g.call(other, name="other", out=y_spec, input=x, weight=w))
    g.output(*outputs)
    return g.build()


def calls(s: GraphSnapshot) -> list[str]:
    return [n.target.removeprefix("aten.") for n in s.nodes if n.op == "call_function"]


def only_rejection(g: GraphSnapshot) -> fxpure.Reason:
    report = plan(g, [RULE])
    assert report.plans == () and report.after == g
    (rejection,) = report.rejections
    assert rejection.rule == "fold-binary" and rejection.node == "bin"
    return rejection.reason


# the op's own arithmetic, as a function of the producer's output y: (target, y first) -> f(y, c, alpha)
OPS: dict[tuple[str, bool], Callable[[float, float, float], float]] = {
    ("aten.mul.Tensor", True): lambda y, c, a: y * c,
    ("aten.mul.Tensor", False): lambda y, c, a: c * y,
    ("aten.div.Tensor", True): lambda y, c, a: y / c,
    ("aten.add.Tensor", True): lambda y, c, a: y + a * c,
    ("aten.add.Tensor", False): lambda y, c, a: c + a * y,
    ("aten.sub.Tensor", True): lambda y, c, a: y - a * c,
    ("aten.sub.Tensor", False): lambda y, c, a: c - a * y,
    ("aten.rsub.Scalar", True): lambda y, c, a: c - a * y,
    ("aten.rsub.Tensor", False): lambda y, c, a: y - a * c,  # torch.rsub(c, y)
    # true division in its other spellings
    ("aten.true_divide.Tensor", True): lambda y, c, a: y / c,
    ("aten.div.Tensor_mode", True): lambda y, c, a: y / c,
    # in place (an aten program's y.mul_(c)): the producer's output is the one written
    ("aten.mul_.Tensor", True): lambda y, c, a: y * c,
    ("aten.div_.Tensor", True): lambda y, c, a: y / c,
    ("aten.add_.Tensor", True): lambda y, c, a: y + a * c,
    ("aten.sub_.Tensor", True): lambda y, c, a: y - a * c,
}


def _out_channel(producer: str, index: tuple[int, ...]) -> int:
    """Output channel of a weight element: row of (OC, ...) / (out, in); for a transposed conv with
    2 groups, (IC, OC/2, ...): element [i, j] feeds channel (i // (IC/2)) * (OC/2) + j."""
    if producer == "conv_transpose_g2":
        return (index[0] // (IC // 2)) * (OC // 2) + index[1]
    return index[0]


PRODUCTS = ("aten.conv1d.default", "aten.conv2d.default", "aten.convolution.default", "aten.linear.default")


def weight_and_bias(after: GraphSnapshot) -> tuple[str, Arg, Arg]:
    """The one conv/linear/addmm/mm after the rewrite: its target, weight and bias (in any spelling)."""
    (node,) = (n for n in after.nodes if n.target in (*PRODUCTS, "aten.addmm.default", "aten.mm.default"))
    if node.target in PRODUCTS:
        return node.target, node.args[1], node.args[2] if len(node.args) > 2 else None
    t = node.args[-1] if node.target == "aten.mm.default" else node.args[2]
    assert isinstance(t, NodeRef)
    bias = node.args[0] if node.target == "aten.addmm.default" else None
    return node.target, after.node(t.name).args[0], bias


def _cases() -> list[tuple[str, bool, float | None, str]]:
    """(target, y first, alpha, operand) for every op: alpha only where the op has one (-1 turns
    ``c - alpha y`` into ``c + y``), a number only for rsub.Scalar."""
    out: list[tuple[str, bool, float | None, str]] = []
    for (target, first), kind in ((key, key[0].split(".")[1].removesuffix("_")) for key in sorted(OPS)):
        alphas = {"mul": (None,), "div": (None,), "true_divide": (None,), "add": (None, 2.0)}.get(kind, (None, 2.0, -1))
        operands = (
            ("scalar",)
            if kind == "rsub" and first
            else ("channels", "0-d")
            if kind == "rsub"
            else ("scalar", "channels", "0-d")
        )
        out += [(target, first, a, o) for a in alphas for o in operands]
    return out


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("producer", PRODUCERS)
@pytest.mark.parametrize(("target", "first", "alpha", "operand"), _cases())
def test_folds_every_op_order_and_operand(
    target: str, first: bool, alpha: float | None, operand: str, producer: str, bias: bool
) -> None:
    c_shape = {"0-d": (), "(1,)": (1,)}.get(operand)
    kind = "scalar" if operand == "scalar" else "tensor"
    g = graph(producer=producer, target=target, first=first, operand=kind, c_shape=c_shape, alpha=alpha, bias=bias)
    report = plan(g, [RULE])
    assert report.rejections == () and len(report.plans) == 1
    after = verify(report.after).unwrap()
    (out,) = after.outputs
    assert after.node(out).spec == g.node("bin").spec
    # the op's arithmetic per output channel o: f(y) = a_o * y + k_o
    env = {k: values_for(info.spec.shape, 0.5 + 0.1 * j, 0.01) for j, (k, info) in enumerate(g.constants.items())}
    c_values = env["c"][1] if kind == "tensor" else [2.5]
    f, alpha_ = OPS[(target, first)], 1.0 if alpha is None else float(alpha)
    k = [f(0.0, c_values[o % len(c_values)], alpha_) for o in range(OC)]
    a = [f(1.0, c_values[o % len(c_values)], alpha_) - k[o] for o in range(OC)]
    old_b = env["b"][1] if "b" in env else [0.0] * OC
    # the new weight is a_o * W along the output channels (the old weight itself when a = 1)
    product, w_ref, b_ref = weight_and_bias(after)
    assert isinstance(w_ref, NodeRef)
    assert (w_ref == NodeRef("w")) == all(abs(x - 1.0) < 1e-12 for x in a)
    assert after.constants[w_ref.name].spec == g.constants["w"].spec  # cast back to the weight's dtype
    w_expr = after.constants[w_ref.name].source or Source(key="w", spec=g.constants["w"].spec)
    (w_shape, w_vals), (shape, got) = env["w"], evaluate(w_expr, env)
    assert shape == w_shape
    indices = itertools.product(*map(range, w_shape))
    assert got == pytest.approx([a[_out_channel(producer, i)] * v for i, v in zip(indices, w_vals, strict=True)])
    # the bias is a_o * b_o + k_o, created when the op shifts and there was none
    assert (b_ref is not None) == ("b" in g.constants or any(k))
    if b_ref is not None:
        assert isinstance(b_ref, NodeRef)
        b_expr = after.constants[b_ref.name].source
        assert b_expr is not None and evaluate(b_expr, env)[0] == (OC,)
        assert after.constants[b_ref.name].spec == spec(OC)
        assert evaluate(b_expr, env)[1] == pytest.approx([a[o] * old_b[o] + k[o] for o in range(OC)])
    # the same calls in the same spelling without the binary op; mm becomes addmm when a bias appears
    assert sorted(calls(after)) == sorted("addmm.default" if t == "mm.default" and b_ref else t for t in calls(g)[:-1])
    assert product == ("aten.addmm.default" if producer == "mm" and any(k) else product)
    # nothing dead is left behind
    assert set(after.constants) == {w_ref.name, *([b_ref.name] if isinstance(b_ref, NodeRef) else [])}


@pytest.mark.parametrize(
    ("knobs", "code", "path", "node"),
    [
        # c / y is not a scale and shift of y
        ({"target": "aten.div.Tensor", "first": False}, "output-is-divisor", "bin.other/conv", "bin"),
        (
            {"producer": "linear", "target": "aten.div.Tensor", "first": False},
            "output-is-divisor",
            "bin.other/lin",
            "bin",
        ),
        # a constant that broadcasts along another dim than the output channels, or grows the output
        ({"c_shape": (OC,)}, "not-per-channel", "bin.other", "bin"),
        ({"c_shape": (1, OC)}, "not-per-channel", "bin.other", "bin"),
        ({"c_shape": (B, OC, 1, 1)}, "not-per-channel", "bin.other", "bin"),
        ({"c_shape": (1, 1, OC, 1, 1)}, "not-per-channel", "bin.other", "bin"),
        (
            {"c_shape": (OC, 1, 1), "first": False, "target": "aten.add.Tensor", "producer": "conv1d"},
            "not-per-channel",
            "bin.self",
            "bin",
        ),
        ({"producer": "linear", "c_shape": (B, 1)}, "not-per-channel", "bin.other", "bin"),
        ({"producer": "addmm_nd", "c_shape": (T, 1)}, "not-per-channel", "bin.other", "bin"),
        # float16 conv times a float32 tensor is float32; a folded conv would stay float16
        ({"weight_dtype": "float16", "out_dtype": "float32"}, "dtype-promotion", "bin", "bin"),
        ({"producer": "mm", "weight_dtype": "bfloat16", "out_dtype": "float32"}, "dtype-promotion", "bin", "bin"),
        # computed operands, in either order
        ({"operand": "input"}, "not-constant", "bin.other", "bin"),
        ({"operand": "input", "first": False, "target": "aten.add.Tensor"}, "not-constant", "bin.self", "bin"),
        ({"operand": "input", "first": False, "target": "aten.sub.Tensor"}, "not-constant", "bin.self", "bin"),
        ({"operand": "input", "target": "aten.div.Tensor"}, "not-constant", "bin.other", "bin"),
        ({"weight_is_input": True}, "not-constant", "bin.self/conv.weight", "conv"),
        ({"producer": "addmm", "weight_is_input": True}, "not-constant", "bin.self/lin.mat2/lin_t.self", "lin_t"),
        # a producer read by another node too
        ({"extra_user": "conv"}, "conv-output-shared", "bin.self/conv", "conv"),
        ({"extra_user": "conv", "first": False}, "conv-output-shared", "bin.other/conv", "conv"),
        ({"producer": "linear", "extra_user": "lin"}, "linear-output-shared", "bin.self/lin", "lin"),
        ({"producer": "addmm", "extra_user": "lin"}, "linear-output-shared", "bin.self/lin", "lin"),
        ({"producer": "mm", "extra_user": "lin", "first": False}, "linear-output-shared", "bin.other/lin", "lin"),
        ({"producer": "addmm_nd", "extra_user": "lin_out"}, "linear-output-shared", "bin.self/lin_out", "lin_out"),
        ({"producer": "addmm_nd", "extra_user": "lin"}, "linear-output-shared", "bin.self/lin_out.self/lin", "lin"),
        # not a float weight, not a static weight, not a number for alpha
        ({"weight_dtype": "int8"}, "unsupported-dtype", "bin.self/conv.weight", "conv"),
        ({"weight_shape": ("s0", IC, 3, 3)}, "symbolic-shape", "bin.self/conv.weight", "conv"),
        ({"target": "aten.add.Tensor", "alpha": NodeRef("x")}, "not-scalar", "bin.alpha", "bin"),
        # a division that rounds (y // c) is no scale
        ({"target": "aten.div.Tensor_mode", "rounding_mode": "floor"}, "arg-mismatch", "bin.rounding_mode", "bin"),
    ],
)
def test_each_rejection_reason(knobs: dict[str, object], code: str, path: str, node: str) -> None:
    reason = only_rejection(graph(**knobs))  # type: ignore[arg-type]
    assert (reason.code, reason.path, reason.node) == (code, path, node)
    assert code in RULE.codes and reason.message and code in str(reason)


def test_messages_say_what_is_wrong() -> None:
    assert only_rejection(graph(target="aten.div.Tensor", first=False)).message == (
        "bin divides by the output of conv: not a scale and shift of it"
    )
    assert only_rejection(graph(c_shape=(OC,))).message == (
        "other of bin has shape (6,): it must broadcast along the 6 output channels (dim 1 of (2, 6, 6, 6)) only"
    )
    assert only_rejection(graph(weight_dtype="float16", out_dtype="float32")).message == (
        "bin turns the float16 output of conv into float32 (a folded op keeps it)"
    )


def test_ops_without_a_conv_or_linear_operand_are_no_candidates() -> None:
    # relu(x) * c, and a reshape of something else than a matmul times c: neither considered nor reported
    assert RULE.anchors(graph(relu=True)) == []
    g = GraphBuilder(dialect="edge")
    x = g.input("x", (B, T, IN))
    r = g.call("aten.relu.default", name="relu", out=(B, T, IN), self=x)
    flat = g.call("aten.view_copy.default", name="flat", out=(B * T, IN), self=r, size=(-1, IN))
    g.output(g.call("aten.mul.Tensor", name="bin", out=(B * T, IN), self=flat, other=2.5))
    report = plan(g.build(), [RULE])
    assert report.plans == () and report.rejections == ()
    # beside a conv, another computed operand: a candidate, declined
    assert only_rejection(graph(operand="input")).code == "not-constant"


@pytest.mark.parametrize("batch", [B, "s0"])
@pytest.mark.parametrize(
    ("target", "first"), [("aten.add.Tensor", True), ("aten.add.Tensor", False), ("aten.mul.Tensor", True)]
)
def test_an_activation_beside_the_conv_makes_no_candidate(batch: int | str, target: str, first: bool) -> None:
    # x + conv(x) (a residual), conv(x) * gate of the same shape: not a scale or shift of the conv's
    # output, neither considered nor reported; a constant of that shape is a candidate, declined
    whole = (batch, *Y_SHAPES["conv2d"])
    assert RULE.anchors(graph(operand="input", c_shape=whole, target=target, first=first, batch=batch)) == []
    assert only_rejection(graph(operand="tensor", c_shape=whole, target=target, first=first, batch=batch)).code == (
        "not-per-channel"
    )
    # a computed operand of another shape (a squeeze-excitation gate, one value per sample and channel)
    gate = graph(operand="input", c_shape=(batch, OC, 1, 1), target=target, first=first, batch=batch)
    assert only_rejection(gate).code == "not-constant"


@pytest.mark.parametrize(("batch", "candidate"), [(1, True), (B, False), ("s0", False)])
def test_a_computed_operand_as_large_as_a_batch_1_output_stays_a_candidate(batch: int | str, candidate: bool) -> None:
    # linear(x) * g with g of the output's shape: at batch 1, (1, F) could be one value per feature
    # (a candidate, declined not-constant: fold it first); at any other batch it is an activation
    g = graph(producer="linear", operand="input", c_shape=(batch, F), batch=batch)
    if candidate:
        assert only_rejection(g).code == "not-constant"
    else:
        assert RULE.anchors(g) == []


def test_a_matmul_that_is_no_linear_is_declined() -> None:
    # mm(x, y) * 2.5 is a candidate (an mm's output), but y is no transposed weight
    g = GraphBuilder(dialect="edge")
    x, y = g.input("x", (B, IN)), g.input("y", (IN, F))
    m = g.call("aten.mm.default", name="lin", out=(B, F), self=x, mat2=y)
    g.output(g.call("aten.mul.Tensor", name="bin", out=(B, F), self=m, other=2.5))
    reason = only_rejection(g.build())
    assert (reason.code, reason.path, reason.node) == ("producer-not-conv-or-linear", "bin.self/lin.mat2/lin_t", "lin")
    assert reason.message == "mat2 of lin comes from y (y), not a permute or a transpose"


def test_malformed_op_is_a_value_not_an_exception() -> None:
    g = graph()
    nodes = [replace(n, args=n.args[:1]) if n.name == "bin" else n for n in g.nodes]
    assert only_rejection(fxpure.snapshot(nodes, g.constants)).code == "malformed-node"


@pytest.mark.parametrize("producer", ["conv2d", "addmm_nd", "mm"])
def test_symbolic_sizes_stay_symbolic_in_every_new_node(producer: str) -> None:
    g = graph(producer=producer, target="aten.add.Tensor", batch="s0")
    after = verify(plan(g, [RULE]).after).unwrap()
    (out,) = after.outputs
    new = after.node(out).tensor_spec
    assert new == g.node("bin").spec and new is not None and new.shape[0] == "s0"


@pytest.mark.parametrize("lifted", [True, False])
@pytest.mark.parametrize("producer", ["conv2d", "linear"])
def test_a_weight_shared_with_another_op_is_left_as_it_is(producer: str, lifted: bool) -> None:
    g = graph(producer=producer, tied=True, lifted=lifted)
    after = verify(plan(g, [RULE]).after).unwrap()
    assert after.constants["w"] == g.constants["w"]  # still read, unchanged, by the other op
    assert after.node("other").args[1] == NodeRef("w")
    base = "conv" if producer == "conv2d" else "lin"
    assert after.node(f"{base}_mul").args[1:3] == (NodeRef(f"{base}_mul_weight"), NodeRef(f"{base}_mul_bias"))
    assert after.node(f"{base}_mul_weight").op == ("placeholder" if lifted else "get_attr")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_weights_fold_in_float32_and_stay_half(dtype: str) -> None:
    g = graph(weight_dtype=dtype, operand="scalar", target="aten.add.Tensor", first=False, alpha=0.5)
    after = verify(plan(g, [RULE]).after).unwrap()
    for name in ("conv_add_weight", "conv_add_bias"):
        info = after.constants[name]
        assert info.spec.dtype == dtype and info.source is not None
        arithmetic = [e for e in subexpressions(info.source) if isinstance(e, Binary)]
        assert arithmetic and all(infer_spec(e).unwrap().dtype == "float32" for e in arithmetic)


def test_float64_weights_fold_in_float64() -> None:
    g = graph(weight_dtype="float64", c_dtype="float64", target="aten.add.Tensor", first=False, alpha=0.5)
    after = verify(plan(g, [RULE]).after).unwrap()
    for name in ("conv_add_weight", "conv_add_bias"):
        info = after.constants[name]
        assert info.spec.dtype == "float64" and info.source is not None
        assert all(infer_spec(e).unwrap().dtype == "float64" for e in subexpressions(info.source))


def test_a_chain_folds_whole_the_rule_running_again_while_it_folds() -> None:
    # (conv * c) + 2.5: a run plans on one snapshot, so the add sees a mul, not a conv; the rule's
    # second run folds it into the already folded (still unmaterialised) weight and bias, and a third
    # finds nothing
    g = GraphBuilder()
    w, b, c = g.parameter("w", (OC, IC, 3, 3)), g.parameter("b", (OC,)), g.buffer("c", (OC, 1, 1))
    x = g.input("x", (B, IC, 8, 8))
    y = g.call("aten.conv2d.default", name="conv", out=(B, OC, 6, 6), input=x, weight=w, bias=b)
    m = g.call("aten.mul.Tensor", name="mul", out=(B, OC, 6, 6), self=y, other=c)
    g.output(g.call("aten.add.Tensor", name="add", out=(B, OC, 6, 6), self=m, other=2.5))
    both = plan(g.build(), [RULE])
    assert [[p.anchor for p in s] for s in both.stages] == [["mul"], ["add"], []]
    assert both.rejections == () and calls(both.after) == ["conv2d.default"]
    once = plan(g.build(), [replace(RULE, repeat=False)])  # a rule without repeat runs once
    assert [p.anchor for p in once.plans] == ["mul"] and once.rejections == ()  # the add reads the mul
    assert plan(once.after, [RULE]).after == both.after
    # the second run's plan reads the first's new conv: applied flat to the first snapshot, it says so
    flat = rewrite(g.build(), both.plans)
    assert isinstance(flat, Failure) and flat.failure().node == "add"
    assert flat.failure().detail.endswith("does not have (a later stage's plan? see RewriteReport.stages)")
    env = {
        "w": values_for((OC, IC, 3, 3), 0.5, 0.01),
        "b": values_for((OC,), 0.6, 0.01),
        "c": values_for((OC, 1, 1), 0.7, 0.1),
    }
    bias = both.after.constants["conv_mul_add_bias"].source
    assert bias is not None
    assert evaluate(bias, env)[1] == pytest.approx([(0.6 + 0.01 * o) * (0.7 + 0.1 * o) + 2.5 for o in range(OC)])
    assert set(both.after.constants) == {"conv_mul_weight", "conv_mul_add_bias"}


def _edge_conv(g: GraphBuilder, x: NodeRef, w: NodeRef, out: Shape | TensorSpec, name: str | None = None) -> NodeRef:
    """An edge program's 3x3 convolution of ``x`` by ``w``, no bias, strides and dilations 1."""
    return g.call(
        "aten.convolution.default",
        name=name,
        out=out,
        input=x,
        weight=w,
        bias=None,
        stride=(1, 1),
        padding=(0, 0),
        dilation=(1, 1),
        transposed=False,
        output_padding=(0, 0),
        groups=1,
    )


def _edge_conv_copied(conv_dtype: str, **copy: Arg) -> tuple[GraphBuilder, NodeRef]:
    """An edge program's conv of ``conv_dtype``, then a ``_to_dim_order_copy`` of its output."""
    g = GraphBuilder(dialect="edge")
    x, w = g.input("x", (B, IC, 8, 8), conv_dtype), g.parameter("w", (OC, IC, 3, 3), conv_dtype)
    y = _edge_conv(g, x, w, spec(B, OC, 6, 6, dtype=conv_dtype), name="conv")
    return g, g.call("dim_order_ops._to_dim_order_copy.default", name="copy", out=(B, OC, 6, 6), self=y, **copy)


@pytest.mark.parametrize(
    ("op", "conv_first", "code"),
    [
        ("aten.mul.Tensor", True, "dtype-promotion"),
        ("aten.mul.Tensor", False, "dtype-promotion"),
        ("aten.div.Tensor", True, "dtype-promotion"),
        ("aten.div.Tensor", False, "output-is-divisor"),  # c / y: no scale, whatever the dtypes
        ("aten.sub.Tensor", False, "dtype-promotion"),
    ],
)
def test_on_edge_an_op_reading_a_promoting_copy_of_the_output_is_declined(op: str, conv_first: bool, code: str) -> None:
    # to_edge writes conv_fp16 * c_fp32 as mul(_to_dim_order_copy(conv, float32), c): no candidate
    # before, neither planned nor reported
    g, copy = _edge_conv_copied("float16", dtype=DTypeArg(name="float32"))
    c = g.buffer("c", (OC, 1, 1))
    a, b = (copy, c) if conv_first else (c, copy)
    g.output(g.call(op, name="bin", out=(B, OC, 6, 6), self=a, other=b))
    report = plan(g.build(), [RULE])
    assert report.plans == ()
    assert [(r.node, r.reason.code) for r in report.rejections] == [("bin", code)]


def test_on_edge_an_op_reading_a_layout_copy_of_the_output_is_no_candidate() -> None:
    # a copy to another dim order only (no promotion): not a scale of the conv's output as it is
    g, copy = _edge_conv_copied("float32", dim_order=(0, 2, 3, 1))
    g.output(g.call("aten.mul.Tensor", name="bin", out=(B, OC, 6, 6), self=copy, other=g.buffer("c", (OC, 1, 1))))
    report = plan(g.build(), [RULE])
    assert report.plans == () and report.rejections == ()


def test_a_candidate_a_later_run_declines_is_reported_there() -> None:
    # (conv * c) + d, d not per channel: the add becomes a candidate in the second run, which declines it
    g = GraphBuilder()
    w, c, d = g.parameter("w", (OC, IC, 3, 3)), g.buffer("c", (OC, 1, 1)), g.buffer("d", (1, 1, 6, 1))
    x = g.input("x", (B, IC, 8, 8))
    y = g.call("aten.conv2d.default", name="conv", out=(B, OC, 6, 6), input=x, weight=w)
    m = g.call("aten.mul.Tensor", name="mul", out=(B, OC, 6, 6), self=y, other=c)
    g.output(g.call("aten.add.Tensor", name="add", out=(B, OC, 6, 6), self=m, other=d))
    report = plan(g.build(), [RULE])
    assert [[p.anchor for p in s] for s in report.stages] == [["mul"], []]
    assert [(r.node, r.reason.code) for r in report.rejections] == [("add", "not-per-channel")]


def _chain(ops: int, *, last: str = "per-channel") -> GraphSnapshot:
    """conv * c + 1 * c + 1 ... (``ops`` ops, op8's operand ``last``), after a conv times an input
    (declined in every run: not-constant)."""
    g = GraphBuilder()
    w, c, d = g.parameter("w", (OC, IC, 3, 3)), g.buffer("c", (OC, 1, 1)), g.buffer("d", (1, 1, 6, 1))
    x = g.input("x", (B, IC, 8, 8))
    z = g.call("aten.conv2d.default", name="conv_z", out=(B, OC, 6, 6), input=x, weight=w)
    scaled = g.call("aten.mul.Tensor", name="by_input", out=(B, OC, 6, 6), self=z, other=g.input("s", (B, OC, 1, 1)))
    y = g.call("aten.conv2d.default", name="conv", out=(B, OC, 6, 6), input=x, weight=w)
    for i in range(ops):
        target, other = ("aten.mul.Tensor", c) if i % 2 else ("aten.add.Tensor", 1.0)
        other = d if i == MAX_RUNS and last != "per-channel" else other
        y = g.call(target, name=f"op{i}", out=(B, OC, 6, 6), self=y, other=other)
    g.output(scaled, y)
    return g.build()


@pytest.mark.parametrize(
    ("ops", "last", "left"),
    [
        (MAX_RUNS, "per-channel", []),
        (MAX_RUNS + 2, "per-channel", [("op8", "runs-exhausted")]),
        (MAX_RUNS + 2, "per-pixel", [("op8", "not-per-channel")]),
    ],
)
def test_a_chain_longer_than_the_runs_allowed_reports_what_is_left(
    ops: int, last: str, left: list[tuple[str, str]]
) -> None:
    # one op folds per run; after MAX_RUNS runs the next op, a candidate now, is reported with the
    # reason another run would give, or runs-exhausted (the op after it reads an op, no conv: no
    # candidate yet); the candidate every run declines is reported once
    report = plan(_chain(ops, last=last), [RULE])
    assert [[p.anchor for p in s] for s in report.stages if s] == [[f"op{i}"] for i in range(MAX_RUNS)]
    assert [(r.rule, r.node, r.reason.node, r.reason.code) for r in report.rejections] == [
        ("fold-binary", n, n, code) for n, code in [("by_input", "not-constant"), *left]
    ]
    if left == [("op8", "runs-exhausted")]:
        ran = f"fold-binary ran {MAX_RUNS} times in a row"
        assert (
            report.rejections[1].reason.message
            == f"{ran} and would rewrite op8 in another run: plan on the result to go on"
        )
        assert len(plan(report.after, [RULE]).plans) == ops - MAX_RUNS
    # a reason found outside the core for the node left is reported instead
    why = Declined(code="non-finite-weight", node="op8", detail="inf")
    outside = plan(_chain(ops, last=last), [RULE], declined={("fold-binary", "op8"): why})
    assert [r.reason for r in outside.rejections][1:] == ([why] if left else [])


def test_every_code_is_stable() -> None:
    assert sorted(RULE.codes - GENERIC_CODES) == [
        "arg-mismatch",
        "conv-output-shared",
        "dtype-promotion",
        "linear-output-shared",
        "not-constant",
        "not-per-channel",
        "not-scalar",
        "output-is-divisor",
        "output-shared",
        "producer-not-conv-or-linear",
        "quantized-output",
        "runs-exhausted",
        "symbolic-shape",
        "unsupported-dtype",
        "wrong-op",
    ]


def test_rewrite_is_pure_and_second_run_finds_nothing() -> None:
    g = graph(producer="mm", target="aten.sub.Tensor", first=False)
    copy_before = json.dumps(to_data(g), sort_keys=True)  # records, not the same objects
    first = plan(g, [RULE])
    assert json.dumps(to_data(g), sort_keys=True) == copy_before and len(first.plans) == 1
    again = plan(first.after, [RULE])
    assert again.plans == () and again.rejections == ()


def test_a_constant_of_the_outputs_rank_folds_when_it_is_per_channel() -> None:
    # (1, C, 1, 1) beside a (B, C, H, W) output: as many dims as the output, one per channel
    (p,) = plan(graph(c_shape=(1, OC, 1, 1)), [RULE]).plans
    assert p.anchor == "bin"
    (lin,) = plan(graph(producer="linear", c_shape=(1, F)), [RULE]).plans
    assert lin.anchor == "bin"


@pytest.mark.parametrize(
    ("unknown", "detail"),
    [
        ("bin", "the op or its operand has no known dtype"),
        ("conv", "the op or its operand has no known dtype"),
    ],
)
def test_an_op_or_producer_without_a_spec_is_malformed(unknown: str, detail: str) -> None:
    g = graph()
    nodes = [replace(n, spec=None) if n.name == unknown else n for n in g.nodes]
    reason = only_rejection(fxpure.snapshot(nodes, g.constants))
    assert (reason.code, reason.node, reason.path, reason.message) == ("malformed-node", "bin", "bin", f"bin: {detail}")


def test_a_constant_copied_to_the_ops_dtype_is_folded_as_the_copy() -> None:
    # to_edge's spelling of y + 0.1 in a float16 model: 0.1 lifted as a float32 tensor, copied to
    # float16 (_to_dim_order_copy); the fold adds the float16 value the op reads, and the copy goes
    g = GraphBuilder(dialect="edge")
    x, w = g.input("x", (B, IC, 5, 5), dtype="float16"), g.parameter("w", (OC, IC, 1, 1), dtype="float16")
    conv = g.call("aten.convolution.default", name="conv", input=x, weight=w, bias=None, stride=(1, 1),
                  padding=(0, 0), dilation=(1, 1), transposed=False, output_padding=(0, 0), groups=1,
                  out=spec(B, OC, 5, 5, dtype="float16"))  # fmt: skip
    c = g.constant("c", (), dtype="float32")
    copied = g.node("dim_order_ops._to_dim_order_copy.default", (c,), {"dtype": DTypeArg("float16"), "dim_order": ()},
                    name="copy", out=spec(dtype="float16"))  # fmt: skip
    g.output(g.call("aten.add.Tensor", name="bin", self=conv, other=copied, out=spec(B, OC, 5, 5, dtype="float16")))
    report = plan(g.build(), [RULE])
    (p,) = report.plans
    assert {"bin", "conv"} <= set(p.erase) and "copy" in {*p.erase, *p.prune}  # (a float copy is a constant)
    (bias,) = [c.expr for c in p.constants if c.name.endswith("_bias")]
    assert Cast(x=Source(key="c", spec=spec(dtype="float32")), dtype="float16") in subexpressions(bias)
    assert "copy" not in verify(report.after).unwrap().index


def test_a_reshape_pair_after_a_linear_is_reported_not_skipped() -> None:
    # found by a hunt: to_edge writes view_copy to (B*T, O) and back after each in-place op
    # (y.mul_(g); y.add_(t)); the add two reshapes from the addmm was neither planned nor declined
    g = GraphBuilder(dialect="edge")
    flat = g.call("aten.view_copy.default", out=(6, 6), self=g.input("x", (2, 3, 6)), size=(6, 6))
    wt = g.call("aten.permute_copy.default", out=(6, 5), self=g.parameter("w", (5, 6)), dims=(1, 0))
    y = g.call("aten.addmm.default", out=(6, 5), self=g.parameter("b", (5,)), mat1=flat, mat2=wt)
    y = g.call("aten.view_copy.default", name="back", out=(2, 3, 5), self=y, size=(2, 3, 5))
    y = g.call("aten.view_copy.default", out=(6, 5), self=y, size=(6, 5))
    y = g.call("aten.view_copy.default", out=(2, 3, 5), self=y, size=(2, 3, 5))
    g.output(g.call("aten.add.Tensor", name="add", out=(2, 3, 5), self=y, other=g.buffer("t", (5,))))
    report = plan(g.build(), [RULE])
    assert report.plans == ()
    assert [(r.node, r.reason.code) for r in report.rejections] == [("add", "producer-not-conv-or-linear")]


@pytest.mark.parametrize("producer", ["conv2d", "linear"])
@pytest.mark.parametrize("first", [True, False])
def test_an_output_read_through_a_dropout_in_eval_mode_folds_and_the_dropout_goes(producer: str, first: bool) -> None:
    # BEiT's and DINOv2's layer scale: gamma * dropout(dense(x)); a dropout in eval mode returns its input
    report = plan(graph(producer=producer, first=first, dropout=False), [RULE])
    (p,) = report.plans
    assert {"drop", "bin"} <= set(p.erase) and report.rejections == ()
    assert "dropout.default" not in calls(report.after)
    # in training mode it drops values: no scale of the output, and no candidate
    report = plan(graph(producer=producer, first=first, dropout=True), [RULE])
    assert report.plans == () and report.rejections == ()


@pytest.mark.parametrize("product", ["conv", "mm"])
@pytest.mark.parametrize("unsqueezed", [True, False])
def test_a_scale_of_an_unbatched_product_on_edge_is_declined_and_of_a_batched_one_is_no_candidate(
    product: str, unsqueezed: bool
) -> None:
    # edge spells a conv of an unbatched input unsqueeze_copy, convolution, squeeze_copy, and a rank-1
    # linear without bias the same around an mm: a scale after it was skipped unreported; a squeeze
    # of a product whose input is no unsqueeze is no such spelling, and no candidate
    g = GraphBuilder(dialect="edge")
    shape = (IC, 8, 8) if product == "conv" else (IN,)
    x = g.input("x", shape if unsqueezed else (1, *shape))
    u = g.call("aten.unsqueeze_copy.default", out=(1, *shape), self=x, dim=0) if unsqueezed else x
    if product == "conv":
        y = _edge_conv(g, u, g.parameter("w", (OC, IC, 3, 3)), (1, OC, 6, 6))
        out: Shape = (OC, 6, 6)
    else:
        wt = g.call("aten.permute_copy.default", out=(IN, F), self=g.parameter("w", (F, IN)), dims=(1, 0))
        y = g.call("aten.mm.default", out=(1, F), self=u, mat2=wt)
        out = (F,)
    s = g.call("aten.squeeze_copy.dims", out=out, self=y, dim=(0,))
    g.output(g.call("aten.mul.Tensor", name="mul", out=out, self=s, other=g.buffer("k", ())))
    report = plan(g.build(), [RULE])
    assert report.plans == ()
    want = [("mul", "producer-not-conv-or-linear")] if unsqueezed else []
    assert [(r.node, r.reason.code) for r in report.rejections] == want


def _qdq(g: GraphBuilder, x: NodeRef, shape: tuple[int, ...]) -> NodeRef:
    """``x`` quantized and dequantized, as PT2E writes each activation."""
    for op, dtype in (("quantize", "int8"), ("dequantize", "float32")):
        x = g.call(
            f"quantized_decomposed.{op}_per_tensor.default",
            out=spec(*shape, dtype=dtype),
            input=x,
            scale=0.1,
            zero_point=0,
            quant_min=-128,
            quant_max=127,
            dtype=DTypeArg(name="int8"),
        )
    return x


@pytest.mark.parametrize("dialect", ["aten", "edge"])
@pytest.mark.parametrize(("moved", "quantized"), [(True, False), (False, False), (True, True), (False, True)])
def test_a_scale_of_a_linear_made_a_1x1_conv_is_declined_and_of_a_conv_squeezed_is_no_candidate(
    moved: bool, quantized: bool, dialect: str
) -> None:
    # found by a hunt: after linear-to-conv2d (the rules in another order than RULES), a layer scale
    # of the linear's output, now conv(unsqueeze(permute(x))) squeezed and permuted back, was skipped
    # unreported; a squeeze of a conv of an input the graph did not move so is no linear's spelling.
    # In a PT2E program each view's output is quantized and dequantized: that too was skipped (a hunt,
    # 2026-12-07)
    g = GraphBuilder(dialect=dialect)
    qdq = (lambda x, shape: _qdq(g, x, shape)) if quantized else (lambda x, _: x)
    permute, unsqueeze, squeeze = (
        ("aten.permute_copy.default", "aten.unsqueeze_copy.default", "aten.squeeze_copy.dims")
        if dialect == "edge"
        else ("aten.permute.default", "aten.unsqueeze.default", "aten.squeeze.dims")
    )
    if moved:
        x = g.input("x", (2, 5, 8))
        t = qdq(g.call(permute, out=(2, 8, 5), self=x, dims=(0, 2, 1)), (2, 8, 5))
        x4 = qdq(g.call(unsqueeze, out=(2, 8, 1, 5), self=t, dim=2), (2, 8, 1, 5))
    else:
        x4 = g.input("x", (2, 8, 1, 5))
    y = qdq(_edge_conv(g, x4, g.parameter("w", (6, 8, 1, 1)), (2, 6, 1, 5)), (2, 6, 1, 5))
    squeezed = qdq(g.call(squeeze, out=(2, 6, 5), self=y, dim=(2,)), (2, 6, 5))
    back = qdq(g.call(permute, out=(2, 5, 6), self=squeezed, dims=(0, 2, 1)), (2, 5, 6))
    g.output(g.call("aten.mul.Tensor", name="mul", out=(2, 5, 6), self=back, other=g.parameter("gamma", (6,))))
    report = plan(g.build(), [RULE])
    assert report.plans == ()
    want = [("mul", "producer-not-conv-or-linear")] if moved else []
    assert [(r.node, r.reason.code) for r in report.rejections] == want


@pytest.mark.parametrize("requantized", [True, False])
def test_a_scale_of_a_quantized_and_dequantized_output_is_declined(requantized: bool) -> None:
    # PT2E's static quantization writes q/dq after the conv: the scale of dequantize(quantize(conv)) is
    # a candidate, declined quantized-output (folded, it would scale what the quantization was fixed
    # for), also where the conv's output has another reader; a dequantize of anything else (an
    # input's) is no conv's output
    g = GraphBuilder(dialect="edge")
    x, w = g.input("x", (B, IC, 8, 8)), g.parameter("w", (OC, IC, 3, 3))
    y = _edge_conv(g, x, w, (B, OC, 6, 6), name="conv")
    q = g.call(
        "quantized_decomposed.quantize_per_tensor.default",
        name="q",
        out=spec(B, OC, 6, 6, dtype="int8"),
        input=y if requantized else g.input("xq", (B, OC, 6, 6)),
        scale=0.1,
        zero_point=0,
        quant_min=-128,
        quant_max=127,
        dtype=DTypeArg(name="int8"),
    )
    # (given by keyword, as a GraphModule may call it)
    given: dict[str, Arg] = {"input": q, "scale": 0.1, "zero_point": 0, "quant_min": -128, "quant_max": 127}
    dq = g.node(
        "quantized_decomposed.dequantize_per_tensor.default",
        kwargs={**given, "dtype": DTypeArg(name="int8")},
        name="dq",
        out=(B, OC, 6, 6),
    )
    g.output(g.call("aten.mul.Tensor", name="bin", out=(B, OC, 6, 6), self=dq, other=2.5), y)
    report = plan(g.build(), [RULE])
    got = [(r.node, r.reason.code, r.reason.path) for r in report.rejections]
    assert report.plans == () and got == ([("bin", "quantized-output", "bin")] if requantized else [])
    if requantized:  # (until 2026-12-06 producer-not-conv-or-linear: "comes from dq, not a convolution")
        assert report.rejections[0].reason.message == (
            "bin: reads the output of conv quantized and dequantized (dq): folded into it, the scale or shift "
            "would change the values its quantization was calibrated for"
        )


@pytest.mark.parametrize(("through", "dialect"), [("dropout", "aten"), ("clone", "aten"), ("clone", "edge")])
def test_a_scale_of_a_quantized_output_read_through_a_dropout_or_copy_is_declined_as_quantized(
    through: str, dialect: str
) -> None:
    # found by a hunt (2026-12-07): PT2E quantizes the dropout's (or copy's) output again; the scale
    # was declined producer-not-conv-or-linear, naming the dropout, where the direct case says why
    g = GraphBuilder(dialect=dialect)
    x, w = g.input("x", (B, IC, 8, 8)), g.parameter("w", (OC, IC, 3, 3))
    y = _qdq(g, _edge_conv(g, x, w, (B, OC, 6, 6), name="conv"), (B, OC, 6, 6))
    if through == "dropout":
        kept = g.call("aten.dropout.default", name="kept", out=(B, OC, 6, 6), self=y, p=0.1, train=False)
    else:  # (edge's spelling of an eval dropout)
        clone = "dim_order_ops._clone_dim_order.default" if dialect == "edge" else "aten.clone.default"
        kept = g.call(clone, name="kept", out=(B, OC, 6, 6), self=y)
    read = _qdq(g, kept, (B, OC, 6, 6))
    g.output(g.call("aten.mul.Tensor", name="bin", out=(B, OC, 6, 6), self=read, other=g.parameter("s", (OC, 1, 1))))
    report = plan(g.build(), [RULE])
    (no,) = report.rejections
    assert report.plans == () and (no.node, no.reason.code) == ("bin", "quantized-output")
    assert no.reason.message.startswith("bin: reads the output of conv quantized and dequantized")


@pytest.mark.parametrize("shared", [False, True])
def test_an_edge_promotion_of_a_conv_read_again_is_declined_as_shared(shared: bool) -> None:
    # to_edge copies a float16 conv's output to float32 before `* c_fp32`: declined dtype-promotion,
    # or output-shared where the copy has another reader (a review: a tie-break between a commuted
    # op's orders must not outweigh another alternative that got further)
    g, k = _edge_conv_copied("float16", dtype=DTypeArg("float32"))
    mul = g.call("aten.mul.Tensor", name="mul", out=(B, OC, 6, 6), self=k, other=g.parameter("c", (OC, 1, 1)))
    g.output(mul, *([k] if shared else []))
    (no,) = plan(g.build(), [RULE]).rejections
    want = ("output-shared", "bin.self/promoted") if shared else ("dtype-promotion", "bin")
    assert (no.reason.code, no.reason.path) == want

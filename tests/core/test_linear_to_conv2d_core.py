"""linear_to_conv2d on hand-built snapshots: the plan for every spelling and rank, every reason with
its exact code and pattern path, dequantized and shared weights, dynamic sizes, and a model's own
flatten around a product."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from fxpure import NodeRef, plan, snapshot, verify
from fxpure.plan import MAX_RUNS
from fxpure.rules.linear_to_conv2d import linear_to_conv2d
from fxpure.snapshot import Arg, DTypeArg, GraphSnapshot
from fxpure.testing import GraphBuilder, spec
from fxpure.weights import Permute, Reshape, Source

RULE = linear_to_conv2d()
VIEW = {"aten": "aten.view.default", "edge": "aten.view_copy.default"}
PERMUTE = {"aten": "aten.permute.default", "edge": "aten.permute_copy.default"}


def linear(
    *,
    # "linear" | "addmm" (permute + addmm/mm, reshaped around for rank > 2) | "t" | "io" (addmm/mm reading
    # the weight stored (in, out) as it is: GPT-2's Conv1D) | "io-matmul" (x @ W, W stored (in, out))
    spelling: str = "linear",
    dialect: str = "aten",
    lifted: bool = True,
    lead: tuple[int | str, ...] = (2, 5),
    features: int | str = 8,
    out: int = 6,
    bias: str = "param",  # "param" | "none" | "input" | "matrix" | "scalar"
    weight: str = "param",  # "param" | "input" | "dq" | "dq-tensor" | "dq-of-input" | "vector"
    axis: int = 0,
    shared: str = "",  # "" | "linear" (a second linear on the weight) | "output" (the weight is an output)
    t_shared: bool = False,
    beta: float = 1.0,
    least: dict[str, int] | None = None,  # symbolic size -> the least value the program declares
) -> GraphSnapshot:
    """x -> a linear in one spelling -> output, with a knob per plan shape and reason."""
    g = GraphBuilder(dialect=dialect, lifted=lifted)
    for size, low in (least or {}).items():
        g.size(size, least=low)
    stored = spelling.startswith("io")
    w_shape: tuple[int | str, ...] = (
        (features,) if weight == "vector" else (features, out) if stored else (out, features)
    )
    w = _weight(g, weight, w_shape, axis)
    b: Arg = None
    if bias == "scalar":
        b = 0.5
    elif bias != "none":
        b_shape = (lead[0], out) if bias == "matrix" else (out,)
        b = g.input("b", b_shape) if bias == "input" else g.parameter("b", b_shape)
    x = g.input("x", (*lead, features))
    y_shape = (*lead, out) if weight != "vector" else lead
    extra: list[Arg] = []
    if spelling == "linear":
        y = g.call("aten.linear.default", name="lin", out=y_shape, input=x, weight=w, bias=b)
    elif spelling == "io-matmul":
        y = g.call("aten.matmul.default", name="lin", out=y_shape, self=x, other=w)
    elif spelling == "io":
        y = _product(g, dialect, x, w, b, (*lead, features), out, beta)
    else:
        t = (
            g.call("aten.t.default", name="lin_t", out=(features, out), self=w)
            if spelling == "t"
            else g.call(PERMUTE[dialect], name="lin_t", out=(features, out), self=w, dims=(1, 0))
        )
        y = _product(g, dialect, x, t, b, (*lead, features), out, beta)
        extra += [t] if t_shared else []
    if shared == "linear":
        extra.append(g.call("aten.linear.default", name="lin_b", out=y_shape, input=x, weight=w, bias=b))
    elif shared == "output":
        extra.append(w)
    g.output(y, *extra)
    return g.build()


def _weight(g: GraphBuilder, kind: str, shape: tuple[int | str, ...], axis: int) -> NodeRef:
    """The weight as a parameter, an input, or an int8 one behind a dequantize."""
    dtype = "int8" if kind.startswith("dq") else "float32"
    w = g.input("w", shape, dtype) if kind in ("input", "dq-of-input") else g.parameter("w", shape, dtype)
    int8: dict[str, Arg] = {"quant_min": -127, "quant_max": 127, "dtype": DTypeArg("int8")}
    if kind == "dq-tensor":
        q: dict[str, Arg] = {"input": w, "scale": 0.02, "zero_point": 0, **int8}
        return g.call("quantized_decomposed.dequantize_per_tensor.default", name="dqw", out=shape, **q)
    if kind not in ("dq", "dq-of-input"):
        return w
    n = shape[axis]
    zps = g.buffer("zps", (n,), "int64", values=[0] * int(n))
    q = {"input": w, "scale": g.buffer("scales", (n,)), "zero_point": zps, "axis": axis, **int8}
    return g.call("quantized_decomposed.dequantize_per_channel.default", name="dqw", out=shape, **q)


def _product(
    g: GraphBuilder, dialect: str, x: NodeRef, t: NodeRef, b: Arg, x_shape: tuple[int | str, ...], out: int, beta: float
) -> NodeRef:
    """addmm (mm without bias) on x, flattened to rows first and reshaped back when it has rank > 2."""
    flat, rows = x, x_shape[0]
    if len(x_shape) > 2:
        rows = "rows"
        flat = g.call(VIEW[dialect], name="lin_in", out=(rows, x_shape[-1]), self=x, size=(-1, x_shape[-1]))
    if b is None:
        y = g.call("aten.mm.default", name="lin", out=(rows, out), self=flat, mat2=t)
    else:
        y = g.call("aten.addmm.default", name="lin", out=(rows, out), self=b, mat1=flat, mat2=t, beta=beta)
    if len(x_shape) <= 2:
        return y
    size = (*x_shape[:-1], out)
    return g.call(
        VIEW[dialect], name="lin_out", out=size, self=y, size=tuple(-1 if isinstance(d, str) else d for d in size)
    )


LEAD = {2: (2,), 3: (2, 5), 4: (2, 3, 5)}
# rank -> each new node before and after the conv: (op, its argument, output shape); the conv's output
CHAIN: dict[
    int, tuple[list[tuple[str, Any, tuple[int, ...]]], tuple[int, ...], list[tuple[str, Any, tuple[int, ...]]]]
] = {
    2: ([("unsqueeze", 2, (2, 8, 1)), ("unsqueeze", 3, (2, 8, 1, 1))], (2, 6, 1, 1), [("squeeze", (2, 3), (2, 6))]),
    3: (
        [("permute", (0, 2, 1), (2, 8, 5)), ("unsqueeze", 2, (2, 8, 1, 5))],
        (2, 6, 1, 5),
        [("squeeze", (2,), (2, 6, 5)), ("permute", (0, 2, 1), (2, 5, 6))],
    ),
    4: ([("permute", (0, 3, 1, 2), (2, 8, 3, 5))], (2, 6, 3, 5), [("permute", (0, 2, 3, 1), (2, 3, 5, 6))]),
}
TARGETS = {
    ("aten", "unsqueeze"): "aten.unsqueeze.default",
    ("aten", "squeeze"): "aten.squeeze.dims",
    ("aten", "permute"): "aten.permute.default",
    ("edge", "unsqueeze"): "aten.unsqueeze_copy.default",
    ("edge", "squeeze"): "aten.squeeze_copy.dims",
    ("edge", "permute"): "aten.permute_copy.default",
}
W = Source(key="w", spec=spec(6, 8))


@pytest.mark.parametrize("bias", ["param", "none"])
@pytest.mark.parametrize("rank", [2, 3, 4])
@pytest.mark.parametrize(
    ("spelling", "dialect"),
    [("linear", "aten"), ("linear", "edge"), ("addmm", "edge"), ("addmm", "aten"), ("t", "aten")],
)
def test_plan_for_every_spelling_and_rank(spelling: str, dialect: str, rank: int, bias: str) -> None:
    g = linear(spelling=spelling, dialect=dialect, lead=LEAD[rank], bias=bias)
    report = plan(g, [RULE])
    assert report.rejections == ()
    (p,) = report.plans
    after = verify(report.after).unwrap()
    before, conv_shape, back = CHAIN[rank]
    prev = NodeRef("x")
    for i, (op, arg, shape) in enumerate(before):
        n = after.node(f"lin_nchw{i}")
        assert (n.target, n.args, n.spec, n.source_fn) == (TARGETS[(dialect, op)], (prev, arg), spec(*shape), op)
        prev = NodeRef(n.name)
    conv = after.node("lin_conv")
    b = NodeRef("b") if bias == "param" else None
    if dialect == "edge":
        conv_args: tuple[Arg, ...] = (prev, NodeRef("lin_weight_1x1"), b, (1, 1), (0, 0), (1, 1), False, (0, 0), 1)
        assert (conv.target, conv.args) == ("aten.convolution.default", conv_args)
    else:
        no_bias = (prev, NodeRef("lin_weight_1x1"))  # (a None bias left out, as export writes it)
        assert (conv.target, conv.args) == ("aten.conv2d.default", no_bias if b is None else (*no_bias, b))
    assert conv.spec == spec(*conv_shape) and conv.source_fn == conv.target.split(".")[1]
    prev = NodeRef("lin_conv")
    for i, (op, arg, shape) in enumerate(back):
        n = after.node(f"lin_back{i}")
        assert (n.target, n.args, n.spec, n.source_fn) == (TARGETS[(dialect, op)], (prev, arg), spec(*shape), op)
        prev = NodeRef(n.name)
    assert after.outputs == (prev.name,)
    assert after.node(prev.name).spec == g.node(g.outputs[0]).spec
    w = after.constants["lin_weight_1x1"]
    assert (w.source, w.spec, w.kind) == (Reshape(x=W, shape=(6, 8, 1, 1)), spec(6, 8, 1, 1), "parameter")
    assert {"w", "lin", "lin_t", "lin_in", "lin_out"}.isdisjoint(after.index)  # the linear is gone, whole
    assert {n.provenance for n in after.nodes if n.op == "call_function"} == {"lin"}
    assert p.anchor == "lin"


@pytest.mark.parametrize("bias", ["param", "none"])
def test_a_program_of_core_aten_ops_gets_the_convolution_spelling(bias: str) -> None:
    # an aten program after run_decompositions(): Core ATen's convolution, aten's own views
    g = replace(linear(spelling="addmm", lead=LEAD[3], bias=bias), decomposed=True)
    assert (GraphBuilder().build().decomposed, GraphBuilder(dialect="edge").build().decomposed) == (False, True)
    after = plan(g, [RULE]).after
    b = NodeRef("b") if bias == "param" else None
    conv = after.node("lin_conv")
    args = (NodeRef("lin_nchw1"), NodeRef("lin_weight_1x1"), b, (1, 1), (0, 0), (1, 1), False, (0, 0), 1)
    assert (conv.target, conv.args, conv.spec) == ("aten.convolution.default", args, spec(2, 6, 1, 5))
    assert [after.node(f"lin_nchw{i}").target for i in (0, 1)] == ["aten.permute.default", "aten.unsqueeze.default"]
    assert after.decomposed


@pytest.mark.parametrize("dialect", ["aten", "edge"])
def test_dynamic_batch_and_sequence_stay_symbolic(dialect: str) -> None:
    g = linear(spelling="addmm", dialect=dialect, lead=("s0", "s1"), least={"s1": 1})  # s0 may be 0
    after = plan(g, [RULE]).after
    assert after.node("lin_nchw1").spec == spec("s0", 8, 1, "s1")
    assert after.node("lin_conv").spec == spec("s0", 6, 1, "s1")
    assert after.node("lin_back1").spec == spec("s0", "s1", 6)
    # no size is written into a new node: only dims of permutes, unsqueezes and squeezes
    assert [n.args[1] for n in after.nodes if n.name.startswith(("lin_nchw", "lin_back"))] == [
        (0, 2, 1),
        2,
        (2,),
        (0, 2, 1),
    ]


@pytest.mark.parametrize(
    ("weight", "axis", "normal"), [("dq", 0, 0), ("dq", -2, 0), ("dq", 1, 1), ("dq-tensor", 0, None)]
)
def test_dequantized_weight_is_reshaped_behind_a_new_dequantize(weight: str, axis: int, normal: int | None) -> None:
    g = linear(weight=weight, axis=axis, spelling="addmm", dialect="edge")
    report = plan(g, [RULE])
    assert report.rejections == ()
    after = report.after
    dq = after.node("dqw_1x1")
    assert dq.target == g.node("dqw").target and dq.spec == spec(6, 8, 1, 1)
    int8 = (-127, 127, DTypeArg("int8"))
    want = (NodeRef("w_1x1"), NodeRef("scales"), NodeRef("zps"), normal, *int8) if normal is not None else None
    assert dq.args == (want or (NodeRef("w_1x1"), 0.02, 0, *int8))
    w = after.constants["w_1x1"]
    assert w.source == Reshape(x=Source(key="w", spec=spec(6, 8, dtype="int8")), shape=(6, 8, 1, 1))
    assert (w.spec, w.kind) == (spec(6, 8, 1, 1, dtype="int8"), "buffer")
    assert after.node("lin_conv").args[1] == NodeRef("dqw_1x1")
    assert {"w", "dqw", "lin_t"}.isdisjoint(after.index)


def test_weight_shared_by_two_linears_is_reshaped_once() -> None:
    report = plan(linear(shared="linear"), [RULE])
    assert len(report.plans) == 2
    after = report.after
    assert after.node("lin_conv").args[1] == after.node("lin_b_conv").args[1] == NodeRef("lin_weight_1x1")
    assert sorted(after.constants) == ["b", "lin_weight_1x1"]


def test_weight_also_read_elsewhere_is_left_as_it_is() -> None:
    g = linear(shared="output")
    after = plan(g, [RULE]).after
    assert after.constants["w"] == g.constants["w"] and after.outputs[1] == "w"
    assert after.node("lin_conv").args[1] == NodeRef("lin_weight_1x1")


def test_a_weight_transpose_another_node_reads_is_left_to_it() -> None:
    # tied weights (edge spells every product's own permute_copy; an aten program's ``wt = W.T``
    # read twice, or returned) were declined output-shared where the rewrite is valid
    for spelling in ("addmm", "t"):
        g = linear(spelling=spelling, dialect="edge" if spelling == "addmm" else "aten", t_shared=True)
        report = plan(g, [RULE])
        assert len(report.plans) == 1 and report.rejections == ()
        after = verify(report.after).unwrap()
        assert "lin_t" in after.index and "lin_t" in after.outputs  # still computed, for its other reader
        assert after.node("lin_conv").args[1] == NodeRef("lin_weight_1x1")


def test_computed_bias_passes_through() -> None:
    after = plan(linear(bias="input"), [RULE]).after
    assert after.node("lin_conv").args[2] == NodeRef("b")


@pytest.mark.parametrize(
    ("knobs", "code", "path", "message"),
    [
        ({"lead": ()}, "unsupported-rank", "lin.input", "lin has 1 input dims, the rule handles (2, 3, 4)"),
        ({"lead": (2, 2, 2, 2)}, "unsupported-rank", "lin.input", "lin has 5 input dims"),
        (
            {"lead": (2, 2, 2, 2), "spelling": "addmm", "dialect": "edge"},
            "unsupported-rank",
            "lin.mat1/lin_in.self",
            "5 input dims",
        ),
        ({"weight": "vector"}, "unsupported-rank", "lin.weight", "lin has 1 weight dims, the rule handles (2,)"),
        ({"features": "s2"}, "symbolic-shape", "lin.input", "input of lin has symbolic shape (2, 5, 's2')"),
        ({"bias": "matrix", "lead": (2,), "spelling": "addmm"}, "bias-not-per-channel", "lin.self", "bias (2, 6)"),
        (
            {"bias": "scalar"},
            "bias-not-per-channel",
            "lin.bias",
            "lin: bias 0.5 is not one value per output feature (6,)",
        ),
        ({"weight": "input"}, "not-constant", "lin.weight", "weight of lin is not a constant"),
        (
            {"weight": "input", "spelling": "addmm", "dialect": "edge"},
            "not-constant",
            "lin.mat2/lin_t.self",
            "self of lin_t",
        ),
        ({"weight": "dq-of-input"}, "not-constant", "lin.weight/dqw.input", "weight of lin is not a constant"),
        ({"beta": 2.0, "spelling": "addmm"}, "arg-mismatch", "lin.beta", "beta of lin is 2.0"),
        # conv2d of no input channels is empty (no bias); of no output channels, or an empty
        # spatial dim, it fails: a linear of them is not a 1x1 conv
        ({"features": 0}, "zero-size", "lin.weight", "lin: the weight (6, 0) is empty, which"),
        ({"out": 0, "bias": "none"}, "zero-size", "lin.weight", "lin: the weight (0, 8) is empty, which"),
        ({"lead": (2, 0)}, "zero-size", "lin.input", "lin: the input (2, 0, 8) is empty, which"),
        ({"lead": (2, 3, 0)}, "zero-size", "lin.input", "the input (2, 3, 0, 8) is empty, which"),
        # an empty weight, or a static empty dim, is empty whatever a symbolic size is
        ({"features": 0, "lead": ("s0", "s1")}, "zero-size", "lin.weight", "the weight (6, 0) is empty, which"),
        ({"lead": (2, 0, "w")}, "zero-size", "lin.input", "the input (2, 0, 'w', 8) is empty, which"),
        # a symbolic one the program lets be 0 (Dim("T") declares no minimum)
        ({"lead": ("s0", "s1")}, "zero-size", "lin.input", "lin: the input ('s0', 's1', 8) is empty when s1 is 0"),
        ({"lead": ("s0", "s1"), "least": {"s1": 0}}, "zero-size", "lin.input", "when s1 is 0"),
        ({"lead": (2, "h", "w"), "least": {"h": 1}}, "zero-size", "lin.input", "when w is 0"),
        ({"lead": (0, "s1")}, "zero-size", "lin.input", "the input (0, 's1', 8) is empty when s1 is 0"),
    ],
)
def test_each_reason(knobs: dict[str, Any], code: str, path: str, message: str) -> None:
    g = linear(**knobs)
    report = plan(g, [RULE])
    assert report.plans == () and report.after == g
    (r,) = report.rejections
    assert (r.rule, r.node, r.reason.code, r.reason.path) == ("linear-to-conv2d", "lin", code, path)
    assert message in r.reason.message


def test_an_empty_linear_is_named_in_its_reason() -> None:
    (r,) = plan(linear(features=0), [RULE]).rejections
    assert (r.reason.code, r.reason.node) == ("zero-size", "lin")


@pytest.mark.parametrize("lead", [(0,), (0, 5), (0, 3, 5)])
def test_an_empty_batch_is_rewritten(lead: tuple[int, ...]) -> None:
    # conv2d takes an empty batch: only the channels and the dims moved to H and W must not be empty
    assert len(plan(linear(lead=lead), [RULE]).plans) == 1


@pytest.mark.parametrize("literal", [False, True])
def test_input_without_shape_is_malformed(literal: bool) -> None:
    g = linear()  # x without a spec, or a literal in place of x
    nodes = [replace(n, spec=None) if n.name == "x" else n for n in g.nodes]
    if literal:
        nodes = [replace(n, args=(2.0, *n.args[1:])) if n.name == "lin" else n for n in g.nodes]
    (r,) = plan(snapshot(nodes, g.constants), [RULE]).rejections
    assert (r.node, r.reason.code, r.reason.node, r.reason.path, r.reason.message) == (
        "lin",
        "malformed-node",
        "lin",
        "lin.input",
        "lin: input, weight or output has no known shape",
    )


def test_a_dequantized_weight_without_shape_is_malformed() -> None:
    g = linear(weight="dq")  # the dequantize's output has no spec: declined, not an assertion error
    nodes = [replace(n, spec=None) if n.name == "dqw" else n for n in g.nodes]
    (r,) = plan(snapshot(nodes, g.constants), [RULE]).rejections
    assert (r.node, r.reason.code, r.reason.path, r.reason.message) == (
        "lin",
        "malformed-node",
        "lin.input",
        "lin: input, weight or output has no known shape",
    )


def flattened(
    dialect: str = "edge",
    x: tuple[int, ...] = (2, 3, 4),
    flat: tuple[int, int] = (2, 12),
    out: tuple[int, ...] = (2, 2, 3),
) -> GraphSnapshot:
    """A model's own flatten before a rank-2 linear and its own reshape after, by default
    x (2, 3, 4) -> view (2, 12) -> addmm -> (2, 6) -> view (2, 2, 3)."""
    g = GraphBuilder(dialect=dialect)
    w, b = g.parameter("w", (6, flat[1])), g.parameter("b", (6,))
    lin_in = g.call(VIEW[dialect], name="lin_in", out=flat, self=g.input("x", x), size=flat)
    t = g.call(PERMUTE[dialect], name="lin_t", out=(flat[1], 6), self=w, dims=(1, 0))
    y = g.call("aten.addmm.default", name="lin", out=(flat[0], 6), self=b, mat1=lin_in, mat2=t)
    g.output(g.call(VIEW[dialect], name="lin_out", out=out, self=y, size=out))
    return g.build()


# (x, the model's flatten, its reshape after); zero rows: the reshape after has x's lead dims, the
# features still differ from x's (4 != 8), so the reshapes are the model's
@pytest.mark.parametrize(("x", "flat", "out"), [((2, 3, 4), (2, 12), (2, 2, 3)), ((0, 3, 4), (0, 8), (0, 3, 6))])
def test_a_models_own_flatten_is_kept_around_a_rank_2_conv(
    x: tuple[int, ...], flat: tuple[int, int], out: tuple[int, ...]
) -> None:
    g = flattened(x=x, flat=flat, out=out)
    report = plan(g, [RULE])
    assert len(report.plans) == 1
    after = verify(report.after).unwrap()
    assert after.node("lin_in") == g.node("lin_in")  # the model's flatten feeds the conv
    assert after.node("lin_nchw0").args == (NodeRef("lin_in"), 2)
    assert after.node("lin_conv").spec == spec(flat[0], 6, 1, 1)
    reshape = after.node("lin_out_new")  # the model's reshape, on the conv's result
    assert (reshape.target, reshape.args, reshape.spec) == (
        "aten.view_copy.default",
        (NodeRef("lin_back0"), out),
        spec(*out),
    )
    assert after.outputs == ("lin_out_new",) and "lin_out" not in after.index


def with_symbolic_sizes(*, size_read_elsewhere: bool) -> GraphSnapshot:
    """The edge spelling of a linear on a dynamic batch: the reshapes' sizes are computed in the
    graph (``sym_size``, ``mul``), as ``to_edge`` writes them."""
    g = GraphBuilder(dialect="edge")
    w = g.parameter("w", (6, 8))
    x = g.input("x", ("s0", 5, 8))
    n = g.node("aten.sym_size.int", (x, 0), name="sym_size")
    rows = g.node("_operator.mul", (n, 5), name="mul")
    flat = g.call("aten.view_copy.default", name="lin_in", out=("5*s0", 8), self=x, size=(rows, 8))
    t = g.call("aten.permute_copy.default", name="lin_t", out=(8, 6), self=w, dims=(1, 0))
    y = g.call("aten.mm.default", name="lin", out=("5*s0", 6), self=flat, mat2=t)
    out = g.call("aten.view_copy.default", name="lin_out", out=("s0", 5, 6), self=y, size=(n, 5, 6))
    g.output(out, *([rows] if size_read_elsewhere else []))
    return g.build()


def test_sizes_of_the_removed_reshapes_go_with_them() -> None:
    after = plan(with_symbolic_sizes(size_read_elsewhere=False), [RULE]).after
    assert {"sym_size", "mul", "lin_in", "lin_out"}.isdisjoint(after.index)
    kept = plan(with_symbolic_sizes(size_read_elsewhere=True), [RULE]).after
    assert {"sym_size", "mul"} <= set(kept.index) and "lin_in" not in kept.index


@pytest.mark.parametrize("rank", [2, 3, 4])
@pytest.mark.parametrize(
    ("spelling", "dialect", "bias"),
    [(s, d, b) for s, d in (("io", "aten"), ("io", "edge")) for b in ("param", "none")]
    + [("io-matmul", "aten", "none")],
)
def test_a_weight_stored_in_out_is_transposed_into_the_conv_weight(
    spelling: str, dialect: str, rank: int, bias: str
) -> None:
    # GPT-2's Conv1D: addmm(b, x, W) with W (in, out), reshaped around for rank > 2; x @ W in aten
    g = linear(spelling=spelling, dialect=dialect, lead=LEAD[rank], bias=bias)
    report = plan(g, [RULE])
    assert report.rejections == () and len(report.plans) == 1
    after = verify(report.after).unwrap()
    conv = after.node("lin_conv")
    # (edge's convolution takes its bias, None too; aten's conv2d leaves a None out, as export writes it)
    no_bias = (NodeRef("lin_weight_1x1"), None) if dialect == "edge" else (NodeRef("lin_weight_1x1"),)
    assert conv.args[1:3] == ((NodeRef("lin_weight_1x1"), NodeRef("b")) if bias == "param" else no_bias)
    w = after.constants["lin_weight_1x1"]
    stored = Source(key="w", spec=spec(8, 6))
    assert (w.source, w.spec) == (Reshape(x=Permute(x=stored, dims=(1, 0)), shape=(6, 8, 1, 1)), spec(6, 8, 1, 1))
    assert after.node(after.outputs[0]).spec == g.node(g.outputs[0]).spec
    assert {"w", "lin", "lin_in", "lin_out"}.isdisjoint(after.index)


@pytest.mark.parametrize(
    ("spelling", "code", "path"),
    [("io", "wrong-op", "lin.mat2/lin_t"), ("io-matmul", None, None)],
)
def test_a_product_of_two_activations_is_no_linear(spelling: str, code: str | None, path: str | None) -> None:
    # mm of two activations: a candidate (every mm is), declined as no transpose (the first of the
    # ways a weight is read, each missed at mat2); a matmul of them: no candidate
    g = linear(spelling=spelling, weight="input", bias="none", lead=(2,))
    report = plan(g, [RULE])
    assert report.plans == ()
    assert [(r.reason.code, r.reason.path) for r in report.rejections] == ([(code, path)] if code else [])


def test_a_quantized_linear_keeps_dequantize_conv_quantize_around_its_views() -> None:
    g = GraphBuilder()
    params: tuple[Arg, ...] = (0.05, 3, -128, 127, DTypeArg("int8"))
    xq, w = g.input("xq", (2, 5, 8), "int8"), g.parameter("w", (6, 8))
    x = g.node("quantized_decomposed.dequantize_per_tensor.default", (xq, *params), name="x", out=(2, 5, 8))
    y = g.call("aten.linear.default", name="lin", out=(2, 5, 6), input=x, weight=w, bias=None)
    out = (0.1, -2, -128, 127, DTypeArg("int8"))
    g.output(g.node("quantized_decomposed.quantize_per_tensor.default", (y, *out), name="q", out=(2, 5, 6)))
    snap = g.build()
    new = plan(snap, [linear_to_conv2d()]).after
    names = [n.name for n in new.nodes if n.op == "call_function"]
    assert names == [
        "x",
        *("lin_nchw0", "lin_nchw1", "lin_nchw_q", "lin_nchw_dq"),
        *("lin_conv", "lin_conv_q", "lin_conv_dq"),
        *("lin_back0", "lin_back1", "q"),
    ]
    assert new.node("lin_nchw_q").args == (NodeRef("lin_nchw1"), *params)
    assert new.node("lin_nchw_dq").spec == spec(2, 8, 1, 5)
    assert new.node("lin_conv_dq").args == (NodeRef("lin_conv_q"), *out)
    assert new.node("lin_conv_q").spec == spec(2, 6, 1, 5, dtype="int8")
    assert new.node("lin_conv_q").args == (NodeRef("lin_conv"), *out)


@pytest.mark.parametrize("computed", [(), ("scale",), ("zero_point",), ("scale", "zero_point")])
def test_a_linear_quantized_at_run_time_is_declined(computed: tuple[str, ...]) -> None:
    # dynamic quantization: the input's scale and zero point are computed (choose_qparams) and read
    # as tensors; the pair the plan puts after the views would read them (XNNPACK: a cycle)
    g = GraphBuilder()
    xq, w = g.input("xq", (2, 8), "int8"), g.parameter("w", (6, 8))
    scale = g.input("s", (1,)) if "scale" in computed else 0.05
    zero = g.input("z", (1,), "int64") if "zero_point" in computed else 0
    overload = "tensor" if computed else "default"
    params = (scale, zero, -128, 127, DTypeArg("int8"))
    x = g.node(f"quantized_decomposed.dequantize_per_tensor.{overload}", (xq, *params), name="x", out=(2, 8))
    g.output(g.call("aten.linear.default", name="lin", out=(2, 6), input=x, weight=w, bias=None))
    report = plan(g.build(), [linear_to_conv2d()])
    if not computed:
        assert [p.anchor for p in report.plans] == ["lin"]
        return
    (r,) = report.rejections
    assert (r.node, r.reason.code, r.reason.node) == ("lin", "dynamic-quantization", "lin")
    assert r.reason.message == "lin: its input x is quantized at run time (scale and zero point are computed)"
    assert r.reason.path == "lin.input"  # (a hunt found the check's own function named there)


def _gelu_chain(n: int) -> GraphSnapshot:
    """n GPT-2 Conv1Ds in a row in aten, each ``view(addmm(b, view(x, (-1, 8)), W), (2, 5, 8))`` then
    a GELU: each one's output reaches the next one's flattening view through the GELU."""
    g = GraphBuilder()
    x = g.input("x", (2, 5, 8))
    for i in range(n):
        w, b = g.parameter(f"w{i}", (8, 8)), g.parameter(f"b{i}", (8,))
        flat = g.call("aten.view.default", name=f"in{i}", self=x, size=(-1, 8), out=(10, 8))
        y = g.call("aten.addmm.default", name=f"lin{i}", self=b, mat1=flat, mat2=w, out=(10, 8))
        y = g.call("aten.view.default", name=f"out{i}", self=y, size=(2, 5, 8), out=(2, 5, 8))
        x = g.node("aten.gelu.default", (y,), name=f"gelu{i}", out=(2, 5, 8))
    g.output(x)
    return g.build()


@pytest.mark.parametrize("n", [3, MAX_RUNS + 2])
def test_a_linear_a_later_linears_view_reads_converts_once_that_one_is_a_conv(n: int) -> None:
    # the view reading a linear's output merges dims, which a conv's permuted output may not allow:
    # declined until the later linear (whose own view it is) is a conv; one more per run
    report = plan(_gelu_chain(n), [RULE])
    stages = [[p.anchor for p in s] for s in report.stages if s]
    assert stages == [[f"lin{i}"] for i in reversed(range(n))][:MAX_RUNS]
    left = [(r.node, r.reason.code) for r in report.rejections]
    if n <= MAX_RUNS:
        assert left == [] and verify(report.after).unwrap()
        return
    # after MAX_RUNS runs: the next would convert lin1; lin0 still waits for it
    assert left == [("lin0", "layout-sensitive-reader"), ("lin1", "runs-exhausted")]

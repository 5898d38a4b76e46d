"""Tests that kill mutants `make mutate` found alive (MUTATION.md): the full reason records of the
``need.*`` checks, patterns and checks built while a test runs (mutmut swaps a function's body in
at call time, so a rule built at import is always the original one), ``explain``/``attempts``,
and the exact plans of the rules where their other tests only check the graph they lead to."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from returns.result import Failure, Result, Success

from fxpure import plan, snapshot
from fxpure.families import CONV, DEQUANTIZE, MUL, RELU
from fxpure.pattern import (
    ANY,
    ONE,
    Bound,
    Check,
    Const,
    Lit,
    Match,
    Op,
    Planner,
    Var,
    attempts,
    dequantized,
    explain,
    need,
    rule,
)
from fxpure.plan import RewritePlan
from fxpure.reasons import (
    BindingConflict,
    ChannelMismatch,
    Declined,
    Malformed,
    Reason,
    SymbolicShape,
    UnsupportedDtype,
    UnsupportedRank,
)
from fxpure.rules import (
    concat_parallel_linears,
    conv1d_to_conv2d,
    linear_to_conv2d,
    quantized_conv,
    split_group_conv,
)
from fxpure.snapshot import Arg, DTypeArg, GraphSnapshot, NodeRef, NodeSnapshot
from fxpure.testing import GraphBuilder, spec
from fxpure.weights import Dequantize, Fill, Source, Unsqueeze
from tests.core.build import grouped_conv, qconv
from tests.core.test_concat_parallel_linears_core import parallel
from tests.core.test_conv1d_to_conv2d_core import conv1d
from tests.core.test_linear_to_conv2d_core import flattened, linear

# --- fxpure.pattern --------------------------------------------------------------------------------


def test_op_of_and_dequantized_build_what_op_builds() -> None:
    args: dict[str, Arg | Var | Const] = {"input": Var("x"), "weight": Const("w"), "groups": 1}
    assert Op.of(CONV, args) == Op(CONV, input=Var("x"), weight=Const("w"), groups=1)
    assert Op.of(CONV, args).args == (("input", Var("x")), ("weight", Const("w")), ("groups", Lit(1)))
    d = Op.of(CONV, {})
    assert (d.family, d.name, d.users, d.user, d.out, d.commute) == (CONV, None, ONE, None, None, False)
    assert (d.code, d.shared, d.out_code, d.transparent) == ("wrong-op", "output-shared", "tuple-output-used", False)
    user = Op(RELU)
    full = Op.of(
        MUL,
        {"self": Var("a")},
        name="m",
        users=ANY,
        user=user,
        out=0,
        commute=True,
        code="c",
        shared="s",
        out_code="o",
        transparent=True,
    )
    expected = Op(
        MUL,
        name="m",
        users=ANY,
        user=user,
        out=0,
        commute=True,
        code="c",
        shared="s",
        out_code="o",
        transparent=True,
        self=Var("a"),
    )
    assert full == expected
    dq = dequantized(Const("w"), name="dq", scale=Var("s"))
    assert dq == Op(DEQUANTIZE, name="dq", users=ANY, transparent=True, input=Const("w"), scale=Var("s"))
    assert dq.code == "wrong-op"
    mine = dequantized(Var("v"), family=CONV, users=ONE, code="no-dq")
    assert mine == Op(CONV, users=ONE, code="no-dq", transparent=True, input=Var("v"))


def conv_relu(
    *,
    w_shape: tuple[int | str, ...] = (4, 3, 3, 3),
    w_dtype: str = "float32",
    bias: tuple[int, ...] | None = (4,),
    bias_values: tuple[int, ...] | None = None,
    transposed: bool = False,
    groups: int = 1,
) -> GraphSnapshot:
    """x -> conv(w, b) -> relu -> output; the checks below look at the conv from the relu."""
    g = GraphBuilder()
    x = g.input("x", (1, 3, 8, 8))
    w = g.parameter("w", w_shape, w_dtype)
    b = None if bias is None else g.buffer("b", bias, values=bias_values)
    args: dict[str, Arg] = {"stride": (1, 1), "padding": (0, 0), "dilation": (1, 1), "groups": groups}
    if transposed:
        args["output_padding"] = (0, 0)
    target = "aten.conv_transpose2d.input" if transposed else "aten.conv2d.default"
    c = g.call(target, name="conv", out=(1, 4, 6, 6), input=x, weight=w, bias=b, **args)
    g.output(g.call("aten.relu.default", name="relu", out=(1, 4, 6, 6), self=c))
    return g.build()


CONV_RELU = Op(
    RELU, name="relu", self=Op(CONV, name="conv", input=Var("x"), weight=Const("w"), bias=Const("b", optional=True))
)


def _keep(p: Planner) -> RewritePlan:
    return p.finish([])


def why(snap: GraphSnapshot, *checks: Check) -> Reason | None:
    """The reason the conv-relu rule with ``checks`` (built now) declines at the relu, or None."""
    r = rule("t", CONV_RELU, *checks, plan=_keep)
    assert {c.label for c in checks} <= {c.label for c in r.checks}
    result: Result[RewritePlan, Reason] = r.plan_at(snap, snap.node("relu"))
    return result.failure() if isinstance(result, Failure) else None


def test_need_dtype_reason_and_check() -> None:
    check = need.dtype("w", ["float32", "bfloat16"])
    assert (check.label, check.reads, check.codes) == ("dtype(w)", ("w",), frozenset({"unsupported-dtype"}))
    assert "unsupported-dtype" in rule("t", CONV_RELU, check, plan=_keep).codes
    assert why(conv_relu(), check) is None
    assert why(conv_relu(w_dtype="bfloat16"), check) is None
    expected = UnsupportedDtype(node="conv", role="weight", dtype="float16", path="relu.self/conv.weight")
    assert why(conv_relu(w_dtype="float16"), check) == expected


def test_need_rank_reason_and_check() -> None:
    check = need.rank("w", {5, 3})
    assert (check.label, check.reads, check.codes) == ("rank(w)", ("w",), frozenset({"unsupported-rank"}))
    expected = UnsupportedRank(node="conv", rank=4, allowed=(3, 5), of="dims", path="relu.self/conv.weight")
    assert why(conv_relu(), check) == expected
    assert expected.message == "conv has 4 dims, the rule handles (3, 5)"
    assert why(conv_relu(), need.rank("w", [4])) is None
    assert why(conv_relu(bias=None), need.rank("b", [1])) is None  # an absent optional: nothing to check


def test_need_channels_reason_and_check() -> None:
    check = need.channels("b", of="w", conv="conv")
    assert (check.label, check.reads) == ("channels(b)", ("b", "w", "conv"))
    assert check.codes == frozenset({"channel-mismatch"})
    assert need.channels("b", of="w").reads == ("b", "w")
    assert why(conv_relu(), check) is None
    assert why(conv_relu(), need.channels("b", of="w")) is None
    assert why(conv_relu(bias=None), check) is None  # no bias: nothing to check
    # transposed: (IC, OC/g, kh, kw), so 4 output channels from (3, 4, 3, 3)
    assert why(conv_relu(w_shape=(3, 4, 3, 3), transposed=True), check) is None
    bad = why(conv_relu(w_shape=(3, 4, 3, 3), bias=(2,), transposed=True), check)
    assert bad == ChannelMismatch(node="conv", expected=4, found=2, path="relu.self/conv.bias")
    # without the conv: output channels lead, one group
    assert why(conv_relu(w_shape=(3, 3, 3, 3), bias=(3,)), need.channels("b", of="w")) is None
    # grouped: (OC, IC/g, ...); the output channels must split into the groups
    assert why(conv_relu(w_shape=(4, 1, 3, 3), groups=4), check) is None
    split = why(conv_relu(w_shape=(6, 1, 3, 3), bias=(6,), groups=4), check)
    assert split == ChannelMismatch(node="conv", expected=6, found=6, path="relu.self/conv.bias")
    assert why(conv_relu(bias=(5,)), check) == ChannelMismatch(
        node="conv", expected=4, found=5, path="relu.self/conv.bias"
    )
    symbolic = why(conv_relu(w_shape=("s0", 3, 3, 3)), check)
    assert symbolic == ChannelMismatch(node="conv", expected=-1, found=4, path="relu.self/conv.bias")


def test_need_channels_of_a_scalar_constant_checks_nothing() -> None:
    g = GraphBuilder()
    x, w, b, s = (
        g.input("x", (1, 3, 8, 8)),
        g.parameter("w", (4, 3, 3, 3)),
        g.parameter("b", (4,)),
        g.parameter("s", ()),
    )
    c = g.call("aten.conv2d.default", name="conv", out=(1, 4, 6, 6), input=x, weight=w, bias=b)
    g.output(g.call("aten.mul.Tensor", name="mul", out=(1, 4, 6, 6), self=c, other=s))
    snap = g.build()
    pattern = Op(MUL, name="mul", self=Op(CONV, name="conv", bias=Const("b")), other=Const("s"))
    r = rule("t", pattern, need.channels("b", of="s", conv="conv"), plan=_keep)
    assert not isinstance(r.plan_at(snap, snap.node("mul")), Failure)


def test_match_values_reads_small_integer_constants() -> None:
    seen: list[tuple[tuple[int, ...] | None, ...]] = []

    def look(match: Match) -> Reason | None:
        seen.append((match.values("b"), match.values("w"), match.values("x"), match.values("nothing")))
        return None

    assert why(conv_relu(bias_values=(1, 2, 3, 4)), need.check(look, codes=["x"])) is None
    assert seen == [((1, 2, 3, 4), None, None, None)]


def test_binding_conflict_shows_both_values() -> None:
    pattern = Op(CONV, name="conv", stride=Var("s"), padding=Var("s"))
    r = rule("t", pattern, plan=_keep)
    snap = conv_relu()
    reason = r.plan_at(snap, snap.node("conv")).failure()
    assert reason == BindingConflict(node="conv", name="s", first="(1, 1)", second="(0, 0)", path="conv.padding")


def test_a_planners_own_reason_keeps_its_node_and_path() -> None:
    own = Declined(code="mine", node="conv", detail="no")

    def refuse(p: Planner) -> Result[RewritePlan, Reason]:
        return Failure(own)

    r = rule("t", CONV_RELU, plan=refuse)
    snap = conv_relu()
    assert r.plan_at(snap, snap.node("relu")).failure() == own


class HandWritten:
    """A rule written by hand (no pattern): declines at the relu, plans (nothing) elsewhere."""

    name = "hand"

    def anchors(self, snap: GraphSnapshot) -> list[NodeSnapshot]:
        return [n for n in snap.nodes if n.op == "call_function"]

    def plan_at(self, snap: GraphSnapshot, node: NodeSnapshot) -> Result[RewritePlan, Reason]:
        if node.name == "relu":
            return Failure(Malformed(node=node.name, detail=f"hand-written, {snap.dialect}"))
        return Success(RewritePlan(rule=self.name, anchor=node.name))


def test_explain_a_hand_written_and_a_pattern_rule() -> None:
    snap = conv_relu()
    attempt = explain(snap, HandWritten(), snap.node("relu"))
    assert (attempt.rule, attempt.anchor, attempt.reason, dict(attempt.bindings), attempt.depth) == (
        "hand",
        "relu",
        Malformed(node="relu", detail="hand-written, aten"),
        {},
        0,
    )
    assert explain(snap, HandWritten(), snap.node("conv")).reason is None
    r = rule("t", CONV_RELU, need.dtype("w", ["float16"]), plan=_keep)
    attempt = explain(snap, r, snap.node("relu"))
    assert (attempt.rule, attempt.anchor) == ("t", "relu")
    assert attempt.reason == UnsupportedDtype(node="conv", role="weight", dtype="float32", path="relu.self/conv.weight")
    assert set(attempt.bindings) == {"relu", "conv", "x", "w", "b"}
    assert explain(snap, rule("t", CONV_RELU, plan=_keep), snap.node("relu")).reason is None


def _drop(p: Planner, relu: Bound, c: Bound) -> RewritePlan:
    return p.replace(relu, NodeRef(c.name))


DROP_RELU = rule("drop-relu", Op(RELU, name="relu", self=Op(CONV, name="c", users=ANY)), plan=_drop)
SECOND = rule("second", Op(RELU, name="relu"), plan=_keep)
CONV_F16 = rule("conv-f16", Op(CONV, name="conv", weight=Const("w")), need.dtype("w", ["float16"]), plan=_keep)


def test_attempts_follow_the_stages() -> None:
    snap = conv_relu()
    rules = [DROP_RELU, SECOND, CONV_F16]
    report = plan(snap, rules)
    # the relu is gone when the second rule runs: only the first one considered it
    (first,) = attempts(report, rules, "relu")
    assert (first.rule, first.anchor, first.reason) == ("drop-relu", "relu", None)
    (conv,) = attempts(report, rules, "conv")
    assert (conv.rule, conv.anchor) == ("conv-f16", "conv")
    assert conv.reason == UnsupportedDtype(node="conv", role="weight", dtype="float32", path="conv.weight")
    # a report without stages: every rule looks at the snapshot planned on
    flat = attempts(replace(report, stages=()), rules, "relu")
    assert [(a.rule, a.reason) for a in flat] == [("drop-relu", None), ("second", None)]
    # a reason found after matching (here: given by an adapter) is the one reported
    no = Declined(code="adapter-says-no", node="relu", detail="no")
    late = plan(snap, rules, declined={("drop-relu", "relu"): no})
    assert next((a.rule, a.reason) for a in attempts(late, rules, "relu")) == ("drop-relu", no)
    assert attempts(report, rules, "nowhere") == ()


# --- fxpure.rules ----------------------------------------------------------------------------------


def test_conv1d_with_a_per_tensor_dequantized_weight() -> None:
    g = GraphBuilder()
    w, x = g.buffer("w", (6, 4, 3), "int8"), g.input("x", (2, 4, 16))
    qd = "quantized_decomposed.dequantize_per_tensor.default"
    q: dict[str, Arg] = {"scale": 0.5, "zero_point": 0, "quant_min": -127, "quant_max": 127, "dtype": DTypeArg("int8")}
    dq = g.call(qd, name="dqw", out=(6, 4, 3), input=w, **q)
    conv: dict[str, Arg] = {"stride": (1,), "padding": (0,), "dilation": (1,), "groups": 1}
    g.output(g.call("aten.conv1d.default", name="conv", out=(2, 6, 14), input=x, weight=dq, bias=None, **conv))
    snap = g.build()
    (p,) = plan(snap, [conv1d_to_conv2d()]).plans
    (w2,) = p.constants
    assert (w2.name, w2.kind) == ("w_2d", "buffer")
    assert w2.expr == Unsqueeze(x=Source(key="w", spec=snap.constants["w"].spec), dim=2)
    (dq2,) = (n for n in p.nodes if n.name == "dqw_2d")
    assert (dq2.target, dq2.args, dq2.provenance) == (qd, (NodeRef("w_2d"), 0.5, 0, -127, 127, DTypeArg("int8")), "dqw")
    assert dq2.spec == spec(6, 4, 1, 3)
    (conv2d,) = (n for n in p.nodes if n.target == "aten.conv2d.default")
    assert conv2d.args[1] == NodeRef("dqw_2d")


def test_quantized_conv_fallback_plan() -> None:
    for per_channel in (True, False):
        g = qconv(groups=6, cin=6, cout=6, per_channel=per_channel)
        (p,) = plan(g, [quantized_conv()]).plans
        assert p.instead_of is not None and (p.instead_of.code, p.instead_of.node) == ("channel-alignment", "conv")
        assert p.erase == ("conv",)  # the weight's dequantize is left to be pruned once unused
        (weight,) = p.constants
        assert (weight.name, weight.kind) == ("w_dequantized", "buffer")
        assert isinstance(weight.expr, Dequantize)
        if not per_channel:
            assert weight.expr.zero_point == Fill(shape=(), value=0.0, dtype="float32")
            assert weight.expr.axis is None
        (conv,) = p.nodes
        assert (conv.name, conv.args[1]) == ("conv_float", NodeRef("w_dequantized"))
    (r,) = plan(qconv(groups=6, cin=6, cout=6), [quantized_conv(fallback="none")]).rejections
    assert (r.reason.code, r.reason.node) == ("channel-alignment", "conv")
    (p,) = plan(qconv(per_channel=False, zeros=(2,)), [quantized_conv()]).plans
    (weight,) = p.constants
    assert isinstance(weight.expr, Dequantize)
    assert weight.expr.zero_point == Fill(shape=(), value=2.0, dtype="float32")


def test_quantized_conv_constants_keep_their_kind_and_are_padded_only_where_needed() -> None:
    def constants(**knobs: Any) -> list[tuple[str, str, str]]:
        (p,) = plan(qconv(**knobs), [quantized_conv(fallback="none")]).plans
        return [(c.name, c.kind, type(c.expr).__name__) for c in p.constants]

    aligned = [("w_packed", "buffer", "Reshape"), ("w_sums", "constant", "SumOver")]
    assert constants() == aligned
    assert constants(groups=8) == aligned  # depthwise (3, 3, 8): the channels, last, are aligned
    padded = [("w_sums", "constant", "PadTo"), ("scales_padded", "buffer", "PadTo"), ("b_padded", "parameter", "PadTo")]
    assert constants(cin=6, cout=6) == [("w_packed", "buffer", "PadTo"), *padded]  # 54 -> 56 columns
    assert constants(cin=8, cout=6) == [("w_packed", "buffer", "Reshape"), *padded]  # 72 columns: aligned
    # per tensor: a new scale vector (a constant) from the one scale
    assert constants(per_channel=False) == [*aligned, ("w_scales_padded", "constant", "Fill")]
    # grouped transposed: one scale per output channel of a group (12), already aligned
    assert constants(transposed=True, k=2, stride=2, padding=0, cin=16, cout=24, groups=2) == aligned


def test_split_group_conv_nodes_name_their_functions() -> None:
    (p,) = plan(grouped_conv(groups=2), [split_group_conv()]).plans
    assert [(n.name, n.target, n.source_fn) for n in p.nodes] == [
        ("conv_x0", "aten.slice.Tensor", "getitem"),
        ("conv_g0", "aten.conv2d.default", "conv2d"),
        ("conv_x1", "aten.slice.Tensor", "getitem"),
        ("conv_g1", "aten.conv2d.default", "conv2d"),
        ("conv_cat", "aten.cat.default", "cat"),
    ]
    assert p.nodes[-1].args == ((NodeRef("conv_g0"), NodeRef("conv_g1")), 1)


def test_q8ta_node_arguments_end_with_the_geometry() -> None:
    knobs: list[dict[str, Any]] = [{}, {"transposed": True, "k": 2, "stride": 2, "padding": 0, "cout": 12}]
    tails = []
    for kn in knobs:
        (p,) = plan(qconv(**kn), [quantized_conv(fallback="none")]).plans
        (q8ta,) = (n for n in p.nodes if n.target.startswith("et_vk"))
        assert (q8ta.name, q8ta.provenance) == ("conv_q8ta", "conv")
        tails.append((q8ta.target, q8ta.args[9:]))
    # kernel, stride, padding, [output padding: transposed only], dilation, groups, activation
    assert tails == [
        ("et_vk.q8ta_conv2d.default", ((3, 3), (1, 1), (1, 1), (1, 1), 1, "relu")),
        ("et_vk.q8ta_conv2d_transposed.default", ((2, 2), (2, 2), (0, 0), (0, 0), (1, 1), 1, "relu")),
    ]


def test_split_group_conv_reasons_name_the_conv_and_the_range_is_inclusive() -> None:
    cases: list[tuple[dict[str, Any], int, str]] = [
        ({"groups": 8, "cin": 8, "cout": 8}, 10, "depthwise-conv"),
        ({"groups": 4, "cin": 8, "cout": 10}, 10, "malformed-node"),
        ({"groups": 6, "cin": 12, "cout": 12}, 4, "groups-out-of-range"),
    ]
    for knobs, high, code in cases:
        (r,) = plan(grouped_conv(**knobs), [split_group_conv(max_groups=high)]).rejections
        assert (r.reason.code, r.reason.node) == (code, "conv")
    for low, high in ((2, 4), (4, 10)):
        assert plan(grouped_conv(groups=4), [split_group_conv(min_groups=low, max_groups=high)]).plans


def test_concat_parallel_linears_slices_by_default_and_names_the_functions() -> None:
    assert concat_parallel_linears().split is False
    nodes = {split: plan(parallel(), [concat_parallel_linears(split=split)]).plans[0].nodes for split in (False, True)}
    parts = [(f"lin{i}_part", "getitem") for i in range(3)]
    assert [(n.name, n.source_fn) for n in nodes[False]] == [("lin0_cat", None), *parts]
    assert [(n.name, n.source_fn) for n in nodes[True]] == [("lin0_cat", None), ("lin0_split", "split"), *parts]


def test_linear_to_conv2d_reasons_in_full() -> None:
    (r,) = plan(linear(bias="matrix", lead=(2,), spelling="addmm"), [linear_to_conv2d()]).rejections
    detail = "lin: bias (2, 6) is not one value per output feature (6,)"
    assert r.reason == Declined(code="bias-not-per-channel", node="lin", path="lin.self", detail=detail)
    g = linear()
    for unknown in ("x", "lin"):  # the input's shape, the output's
        nodes = [replace(n, spec=None) if n.name == unknown else n for n in g.nodes]
        (r,) = plan(snapshot(nodes, g.constants), [linear_to_conv2d()]).rejections
        detail = "input, weight or output has no known shape"
        assert r.reason == Malformed(node="lin", path="lin.input", detail=detail)


def test_quantized_conv_reasons_in_full() -> None:
    qc = quantized_conv(fallback="none")
    g = qconv()

    def without_spec(name: str) -> GraphSnapshot:
        return snapshot([replace(n, spec=None) if n.name == name else n for n in g.nodes], g.constants, dialect="edge")

    w = g.constants["w"]
    symbolic_w = g.constants.set("w", replace(w, spec=replace(w.spec, shape=("s0", 8, 3, 3))))
    malformed = [
        (without_spec("dqx0"), "input has no known (N, C, H, W) shape"),
        (without_spec("q0"), "output has no known (N, C, H, W) shape"),
        (qconv(groups=3, cin=6, cout=8), "weight (8, 2, 3, 3) does not split into 3 groups"),
        (snapshot(g.nodes, symbolic_w, dialect="edge"), "weight shape ('s0', 8, 3, 3) is not a static 2D conv weight"),
    ]
    for snap, detail in malformed:
        (r,) = plan(snap, [qc]).rejections
        assert r.reason == Malformed(node="conv", path="conv", detail=detail)
    unknown = g.constants.set("zp", replace(g.constants["zp"], values=None))
    (r,) = plan(snapshot(g.nodes, unknown, dialect="edge"), [qc]).rejections
    detail = "weight of conv: zero points are not a known constant"
    assert r.reason == Declined(code="asymmetric-weight", node="conv", path="conv", detail=detail)
    declined: list[tuple[dict[str, Any], str, str]] = [
        (
            {"zeros": (0, 1, 0, 0, 0, 0, 0, 0)},
            "asymmetric-weight",
            "weight of conv: zero points (0, 1, 0, 0) are not all 0",
        ),
        ({"per_channel": False, "zeros": (2,)}, "asymmetric-weight", "weight of conv: zero points (2,) are not all 0"),
        (
            {"groups": 6, "cin": 6, "cout": 6},
            "channel-alignment",
            "conv: depthwise output channels is 6, not a multiple of 4",
        ),
        ({"transposed": True, "dilation": 2}, "no-kernel", "conv: transposed conv with dilation (2, 2) (kernel: 1)"),
        ({"axis": 1}, "no-kernel", "conv: weight quantized per channel on axis 1, not 0"),
    ]
    for knobs, code, detail in declined:
        (r,) = plan(qconv(**knobs), [qc]).rejections
        assert r.reason == Declined(code=code, node="conv", path="conv", detail=detail)


def test_conv1d_string_padding_reason_names_the_conv() -> None:
    g = conv1d(target="aten.conv1d.padding", padding="same", stride=1, dialect="edge")
    (r,) = plan(g, [conv1d_to_conv2d()]).rejections
    assert (r.reason.code, r.reason.node) == ("string-padding", "conv")


def test_a_reason_about_a_models_own_flatten_points_at_it() -> None:
    g = flattened()  # x (2, 3, 4) -> the model's view (2, 12) -> addmm: the view stays
    nodes = [replace(n, spec=spec(2, "s0")) if n.name == "lin_in" else n for n in g.nodes]
    (r,) = plan(snapshot(nodes, g.constants, dialect="edge"), [linear_to_conv2d()]).rejections
    assert r.reason == SymbolicShape(node="lin", path="lin.mat1/lin_in", role="input", shape=(2, "s0"))

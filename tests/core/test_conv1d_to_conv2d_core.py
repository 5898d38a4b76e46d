"""conv1d_to_conv2d on hand-built snapshots: the plan for every spelling, every reason with its exact
code and pattern path, shared weights, dynamic sizes, dequantized weights, and composition with
split_group_conv."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from fxpure import NodeRef, plan, snapshot, verify
from fxpure.families import SCHEMAS
from fxpure.rules import split_group_conv
from fxpure.rules.conv1d_to_conv2d import conv1d_to_conv2d
from fxpure.schema import bind
from fxpure.snapshot import Arg, DTypeArg, GraphSnapshot
from fxpure.testing import GraphBuilder, spec
from fxpure.weights import Slice, Source, Unsqueeze

RULE = conv1d_to_conv2d()
TRANSPOSED = ("aten.conv_transpose1d.default",)


def conv1d(
    *,
    target: str = "aten.conv1d.default",
    dialect: str = "aten",
    lifted: bool = True,
    transposed: bool = False,
    groups: int = 1,
    cin: int = 4,
    cout: int = 6,
    k: int = 3,
    stride: int = 2,
    padding: int | str = 1,
    dilation: int = 1,
    output_padding: int = 0,
    bias: bool = True,
    batch: int | str = 2,
    length: int | str = 16,
    out_length: int | str = 8,
    channels: int | str | None = None,
    unbatched: bool = False,
    weight: str = "param",  # "param" | "input" | "dq" | "dq-of-input"
    axis: int = 0,
    shared: str = "",  # "" | "conv" (a second conv1d) | "output" (the weight is also an output)
) -> GraphSnapshot:
    """x -> conv (1D, in the spelling ``target``) -> output, with a knob per plan shape and reason."""
    g = GraphBuilder(dialect=dialect, lifted=lifted)
    transposed = transposed or target in TRANSPOSED
    w_shape = (cin, cout // groups, k) if transposed else (cout, cin // groups, k)
    if weight in ("param", "dq"):
        w = g.parameter("w", w_shape, "int8" if weight == "dq" else "float32", key="m.w")
    else:
        w = g.input("w", w_shape, "int8" if weight == "dq-of-input" else "float32")
    b = g.parameter("b", (cout,), key="m.b") if bias else None
    scales = g.buffer("scales", (w_shape[axis],)) if weight.startswith("dq") else None
    zps = g.buffer("zps", (w_shape[axis],), "int64", values=[0] * w_shape[axis]) if scales else None
    x_shape = (cin, length) if unbatched else (batch, cin if channels is None else channels, length)
    x = g.input("x", x_shape)
    if scales is not None:
        dq: dict[str, Arg] = {"input": w, "scale": scales, "zero_point": zps, "axis": axis}
        dq.update(quant_min=-127, quant_max=127, dtype=DTypeArg("int8"))
        w = g.call("quantized_decomposed.dequantize_per_channel.default", name="dqw", out=w_shape, **dq)
    args: dict[str, Arg] = {"input": x, "weight": w, "bias": b, "stride": (stride,), "padding": padding}
    if target == "aten.convolution.default":
        args.update(dilation=(dilation,), transposed=transposed, output_padding=(output_padding,))
    elif transposed:
        args.update(output_padding=(output_padding,), dilation=(dilation,))
    else:
        args.update(dilation=(dilation,))
    args["groups"] = groups
    out = (cout, out_length) if unbatched else (batch, cout, out_length)
    y = g.call(target, name="conv", out=out, **args)
    extra: list[Arg] = []
    if shared == "conv":
        extra.append(g.call(target, name="conv_b", out=out, **args))
    elif shared == "output":
        extra.append(w)
    g.output(y, *extra)
    return g.build()


SPELLINGS: list[tuple[dict[str, Any], str, dict[str, Arg]]] = [
    # (knobs, the conv2d target, its arguments besides input, weight and bias)
    (
        {},
        "aten.conv2d.default",
        {"stride": (1, 2), "padding": (0, 1), "dilation": (1, 1), "groups": 1},
    ),
    (
        {"target": "aten.conv1d.padding", "padding": "same", "stride": 1, "out_length": 16},
        "aten.conv2d.padding",
        {"stride": (1, 1), "padding": "same", "dilation": (1, 1), "groups": 1},
    ),
    (
        {"target": "aten.conv1d.padding", "padding": "valid", "stride": 1, "dilation": 2, "out_length": 12},
        "aten.conv2d.padding",
        {"stride": (1, 1), "padding": "valid", "dilation": (1, 2), "groups": 1},
    ),
    (
        {"target": "aten.conv_transpose1d.default", "output_padding": 1, "groups": 2, "out_length": 32},
        "aten.conv_transpose2d.input",
        {"stride": (1, 2), "padding": (0, 1), "output_padding": (0, 1), "groups": 2, "dilation": (1, 1)},
    ),
    (
        {"target": "aten.conv_transpose1d.default", "dilation": 2},
        "aten.conv_transpose2d.input",
        {"stride": (1, 2), "padding": (0, 1), "output_padding": (0, 0), "groups": 1, "dilation": (1, 2)},
    ),
    (
        {"target": "aten.convolution.default", "groups": 2},
        "aten.convolution.default",
        {
            "stride": (1, 2),
            "padding": (0, 1),
            "dilation": (1, 1),
            "transposed": False,
            "output_padding": (0, 0),
            "groups": 2,
        },
    ),
    (
        {"target": "aten.convolution.default", "transposed": True, "output_padding": 1, "out_length": 32},
        "aten.convolution.default",
        {
            "stride": (1, 2),
            "padding": (0, 1),
            "dilation": (1, 1),
            "transposed": True,
            "output_padding": (0, 1),
            "groups": 1,
        },
    ),
]


def _bind(snap: GraphSnapshot, name: str) -> dict[str, Arg]:
    """A node's arguments by schema name (what a backend reads)."""
    return dict(bind(snap.node(name), SCHEMAS[snap.node(name).target]).unwrap())


@pytest.mark.parametrize("lifted", [True, False])
@pytest.mark.parametrize(("knobs", "target", "args"), SPELLINGS)
def test_plan_for_every_aten_spelling(knobs: dict[str, Any], target: str, args: dict[str, Arg], lifted: bool) -> None:
    g = conv1d(lifted=lifted, **knobs)
    report = plan(g, [RULE])
    assert report.rejections == ()
    (p,) = report.plans
    after = verify(report.after).unwrap()
    x2, y2, y = after.node("conv_in_2d"), after.node("conv_2d"), after.node("conv_out_1d")
    assert (x2.target, x2.args) == ("aten.unsqueeze.default", (NodeRef("x"), 2))
    assert x2.spec == spec(2, 4, 1, 16)
    assert y2.target == target
    got = _bind(after, "conv_2d")
    assert (got["input"], got["weight"], got["bias"]) == (
        NodeRef("conv_in_2d"),
        NodeRef("conv_weight_2d"),
        NodeRef("b"),
    )
    assert {k: got[k] for k in args} == args
    out = g.node("conv").spec
    assert out is not None and y2.spec == spec(2, 6, 1, out.shape[-1])  # type: ignore[union-attr]
    assert (y.target, y.args, y.spec) == ("aten.squeeze.dims", (NodeRef("conv_2d"), (2,)), out)
    assert after.outputs == ("conv_out_1d",)
    w = after.constants["conv_weight_2d"]
    assert w.source == Unsqueeze(x=Source(key="w", spec=g.constants["w"].spec), dim=2)
    w_shape = g.constants["w"].spec.shape
    assert w.spec == spec(*w_shape[:2], 1, w_shape[2])
    assert after.node("conv_weight_2d").op == ("placeholder" if lifted else "get_attr")
    assert "w" not in after.constants and "conv" not in after.index  # nothing left of the 1D conv
    assert {after.node(n).provenance for n in ("conv_in_2d", "conv_2d", "conv_out_1d")} == {"conv"}
    # quantizers see each new node as the user-level function it is
    assert y2.source_fn == target.split(".")[1]
    assert (x2.source_fn, y.source_fn) == ("unsqueeze", "squeeze")
    assert p.erase == ("conv",) and p.replace == (("conv", "conv_out_1d"),)


@pytest.mark.parametrize(
    "knobs",
    [{}, {"transposed": True, "output_padding": 1, "out_length": 32}, {"groups": 2, "bias": False}],
)
def test_edge_spells_convolution_and_copy_views(knobs: dict[str, Any]) -> None:
    g = conv1d(target="aten.convolution.default", dialect="edge", **knobs)
    after = plan(g, [RULE]).after
    assert after.node("conv_in_2d").target == "aten.unsqueeze_copy.default"
    assert after.node("conv_2d").target == "aten.convolution.default"
    y = after.node("conv_out_1d")
    assert (y.target, y.args) == ("aten.squeeze_copy.dims", (NodeRef("conv_2d"), (2,)))
    conv = after.node("conv_2d")
    t = bool(knobs.get("transposed"))
    want = (NodeRef("conv_in_2d"), NodeRef("conv_weight_2d"), NodeRef("b") if knobs.get("bias", True) else None)
    assert conv.args[:3] == want
    assert conv.args[3:] == ((1, 2), (0, 1), (1, 1), t, (0, knobs.get("output_padding", 0)), knobs.get("groups", 1))


def test_edge_conv1d_spelling_becomes_convolution() -> None:
    g = conv1d(dialect="edge")  # not what to_edge writes, but a spelling the family knows
    conv = plan(g, [RULE]).after.node("conv_2d")
    assert conv.target == "aten.convolution.default"
    assert conv.args[3:] == ((1, 2), (0, 1), (1, 1), False, (0, 0), 1)


def test_dynamic_batch_and_length_stay_symbolic() -> None:
    g = conv1d(batch="s0", length="s1", out_length="(s1 + 1)//2")
    report = plan(g, [RULE])
    assert len(report.plans) == 1
    after = report.after
    assert after.node("conv_in_2d").spec == spec("s0", 4, 1, "s1")
    assert after.node("conv_2d").spec == spec("s0", 6, 1, "(s1 + 1)//2")
    assert after.node("conv_out_1d").spec == spec("s0", 6, "(s1 + 1)//2")
    # no size from an example input is written into a node: only the unit dim and the conv's own ints
    assert after.node("conv_in_2d").args == (NodeRef("x"), 2)
    assert after.node("conv_out_1d").args == (NodeRef("conv_2d"), (2,))


def test_weight_shared_by_two_convs_is_unsqueezed_once() -> None:
    report = plan(conv1d(shared="conv"), [RULE])
    assert len(report.plans) == 2
    after = report.after
    assert after.node("conv_2d").args[1] == after.node("conv_b_2d").args[1] == NodeRef("conv_weight_2d")
    assert sorted(after.constants) == ["b", "conv_weight_2d"]


def test_weight_also_read_elsewhere_is_left_as_it_is() -> None:
    g = conv1d(shared="output")
    after = plan(g, [RULE]).after
    assert after.constants["w"] == g.constants["w"]  # the other reader still gets the 3D weight
    assert after.outputs == ("conv_out_1d", "w")
    assert after.node("conv_2d").args[1] == NodeRef("conv_weight_2d")


# (C0, C1, K) -> (C0, C1, 1, K): the kernel axis moves past the new unit dim
@pytest.mark.parametrize(("axis", "normal"), [(0, 0), (-3, 0), (1, 1), (2, 3), (-1, 3)])
def test_dequantized_weight_is_unsqueezed_behind_a_new_dequantize(axis: int, normal: int) -> None:
    g = conv1d(weight="dq", axis=axis, transposed=axis == 1, target="aten.convolution.default", out_length=32)
    report = plan(g, [RULE])
    assert report.rejections == ()
    after = report.after
    dq = after.node("dqw_2d")
    assert dq.target == "quantized_decomposed.dequantize_per_channel.default"
    assert dq.args[:4] == (NodeRef("w_2d"), NodeRef("scales"), NodeRef("zps"), normal)
    assert dq.args[4:] == (-127, 127, DTypeArg("int8"))
    w = after.constants["w_2d"]
    assert w.source == Unsqueeze(x=Source(key="w", spec=g.constants["w"].spec), dim=2)
    assert w.spec.dtype == "int8" and w.kind == "buffer"
    assert dq.spec == spec(*w.spec.shape)
    assert after.node("conv_2d").args[1] == NodeRef("dqw_2d")
    assert {"w", "dqw"}.isdisjoint(after.index)  # the 3D weight and its dequantize are gone


@pytest.mark.parametrize(
    ("knobs", "code", "path", "message"),
    [
        ({"weight": "input"}, "not-constant", "conv.weight", "weight of conv is not a constant"),
        ({"weight": "dq-of-input"}, "not-constant", "conv.weight/dqw.input", "weight of conv is not a constant"),
        ({"channels": "s1"}, "symbolic-shape", "conv.input", "input of conv has symbolic shape"),
        ({"unbatched": True}, "malformed-node", "conv", "input has shape (4, 16), not (N, C) and 1 spatial dims"),
        (
            {"target": "aten.conv1d.padding", "padding": "same", "stride": 1, "dialect": "edge"},
            "string-padding",
            "conv",
            "padding='same' has no aten.convolution.default spelling",
        ),
    ],
)
def test_each_reason(knobs: dict[str, Any], code: str, path: str, message: str) -> None:
    g = conv1d(**knobs)
    report = plan(g, [RULE])
    assert report.plans == () and report.after == g
    (r,) = report.rejections
    assert (r.rule, r.node, r.reason.code, r.reason.path) == ("conv1d-to-conv2d", "conv", code, path)
    assert message in r.reason.message


def test_symbolic_output_channels_decline() -> None:
    g = conv1d()
    nodes = [replace(n, spec=spec(2, "s2", 8)) if n.name == "conv" else n for n in g.nodes]
    (r,) = plan(snapshot(nodes, g.constants), [RULE]).rejections
    assert (r.reason.code, r.reason.path) == ("symbolic-shape", "conv")
    assert "output of conv" in r.reason.message


def test_malformed_conv_is_a_reason() -> None:
    g = conv1d(target="aten.convolution.default")
    nodes = [replace(n, args=(*n.args[:6], "yes", *n.args[7:])) if n.name == "conv" else n for n in g.nodes]
    (r,) = plan(snapshot(nodes, g.constants), [RULE]).rejections
    assert (r.reason.code, r.node) == ("malformed-node", "conv")


def test_2d_and_3d_convs_are_not_candidates() -> None:
    g = GraphBuilder()
    x = g.input("x", (1, 4, 8, 8))
    w = g.parameter("w", (6, 4, 3, 3))
    y = g.call("aten.conv2d.default", name="conv", input=x, weight=w, out=(1, 6, 6, 6))
    g.output(y)
    report = plan(g.build(), [RULE])
    assert report.plans == () and report.rejections == ()


def test_after_split_group_conv_the_sliced_weights_are_constants() -> None:
    """ET PR #22213: after a grouped-conv split, upstream saw graph-local slices and gave up."""
    g = conv1d(groups=2, cin=4, cout=6)
    report = plan(g, [split_group_conv(), conv1d_to_conv2d()])
    assert [p.rule for p in report.plans] == ["split-group-conv", "conv1d-to-conv2d", "conv1d-to-conv2d"]
    assert report.rejections == ()
    after = verify(report.after).unwrap()
    src = Source(key="w", spec=g.constants["w"].spec)
    for i in range(2):
        w = after.constants[f"conv_g{i}_weight_2d"]
        assert w.source == Unsqueeze(x=Slice(x=src, dim=0, start=3 * i, stop=3 * i + 3), dim=2)
        assert after.node(f"conv_g{i}_2d").target == "aten.conv2d.default"
        assert after.node(f"conv_g{i}_2d").provenance == "conv"
    # only the live, twice-derived weights are left: no slice is materialised on its own
    assert sorted(c for c in after.constants if "weight" in c) == ["conv_g0_weight_2d", "conv_g1_weight_2d"]
    assert not [n for n in after.nodes if n.target.startswith("aten.conv1d")]


def _quantized(after: str) -> GraphSnapshot:
    """int8 x -> dequantize -> conv1d -> ``after`` ("q": a quantize; "relu": relu, quantize;
    "two": a quantize and another reader) -> output."""
    g = GraphBuilder()
    params: tuple[Arg, ...] = (0.05, 3, -128, 127, DTypeArg("int8"))
    xq, w = g.input("xq", (2, 4, 16), "int8"), g.parameter("w", (6, 4, 3))
    x = g.node("quantized_decomposed.dequantize_per_tensor.default", (xq, *params), name="x", out=(2, 4, 16))
    y: Arg = g.call("aten.conv1d.default", name="conv", out=(2, 6, 14), input=x, weight=w)
    if after == "relu":
        y = g.call("aten.relu.default", name="relu", out=(2, 6, 14), self=y)
    out = (0.1, -2, -128, 127, DTypeArg("int8"))
    q = g.node("quantized_decomposed.quantize_per_tensor.default", (y, *out), name="q", out=(2, 6, 14))
    g.output(q, *((y,) if after == "two" else ()))
    return g.build()


@pytest.mark.parametrize("after", ["q", "relu", "two"])
def test_a_quantized_conv_keeps_dequantize_conv_quantize_around_its_views(after: str) -> None:
    snap = _quantized(after)
    new = plan(snap, [RULE]).after
    calls = [n for n in new.nodes if n.op == "call_function"]
    names = [n.name for n in calls]
    want = ["x", "conv_in_2d", "conv_in_2d_q", "conv_in_2d_dq", "conv_2d", "conv_2d_q", "conv_2d_dq", "conv_out_1d"]
    if after == "two":  # the conv's value is read unquantized too: no parameters to round it with
        want = [n for n in want if not n.startswith("conv_2d_")]
    assert names[: len(want)] == want
    by = {n.name: n for n in calls}
    assert by["conv_in_2d_q"].args == (NodeRef("conv_in_2d"), *snap.node("x").args[1:])
    assert by["conv_in_2d_q"].target == "quantized_decomposed.quantize_per_tensor.default"
    assert by["conv_in_2d_q"].spec == spec(2, 4, 1, 16, dtype="int8")
    assert by["conv_in_2d_dq"].args == (NodeRef("conv_in_2d_q"), *snap.node("x").args[1:])
    assert by["conv_in_2d_dq"].spec == spec(2, 4, 1, 16)
    assert by["conv_2d"].args[0] == NodeRef("conv_in_2d_dq")
    if after != "two":
        assert by["conv_2d_q"].args == (NodeRef("conv_2d"), *snap.node("q").args[1:])
        assert by["conv_out_1d"].args[0] == NodeRef("conv_2d_dq")

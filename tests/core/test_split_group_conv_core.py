"""split_group_conv on hand-built snapshots: plan shapes, every rejection, composition with fusion."""

from __future__ import annotations

from dataclasses import replace

import pytest

import fxpure
from fxpure import GraphSnapshot, NodeRef, NodeSnapshot, plan, verify
from fxpure.rules import fuse_conv_bn, split_group_conv
from fxpure.snapshot import DTypeArg
from fxpure.testing import GraphBuilder
from fxpure.weights import Slice, Source, infer_spec
from tests.core.build import conv_bn, grouped_conv, spec


@pytest.mark.parametrize("lifted", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    ("target", "rank"),
    [
        ("aten.conv2d.default", 2),
        ("aten.conv1d.default", 1),
        ("aten.convolution.default", 2),
        ("aten.convolution.default", 1),
    ],
)
def test_plan_shape(target: str, rank: int, bias: bool, lifted: bool) -> None:
    g = grouped_conv(groups=4, cin=8, cout=12, rank=rank, bias=bias, target=target, lifted=lifted)
    report = plan(g, [split_group_conv()])
    assert report.rejections == ()
    (p,) = report.plans
    after = verify(report.after).unwrap()
    for i in range(4):  # one slice of the input per group (a split would pin a dynamic batch on edge)
        part = after.node(f"conv_x{i}")
        assert part.target == "aten.slice.Tensor" and part.args == (NodeRef("x"), 1, 2 * i, 2 * i + 2)
        assert part.spec == spec(1, 2, *(6,) * rank)
    convs = [n for n in after.nodes if n.target == target]
    assert [c.name for c in convs] == [f"conv_g{i}" for i in range(4)]
    for i, c in enumerate(convs):
        assert c.args[0] == NodeRef(f"conv_x{i}") and c.args[1] == NodeRef(f"conv_w{i}")
        assert c.args[-1] == 1 and c.spec == spec(1, 3, *(4,) * rank)
        assert c.args[2] == (NodeRef(f"conv_b{i}") if bias else None)
        w = after.constants[f"conv_w{i}"]
        assert w.source == Slice(x=Source(key="w", spec=g.constants["w"].spec), dim=0, start=3 * i, stop=3 * i + 3)
        assert w.spec == spec(3, 2, *(3,) * rank)
    cat = after.node("conv_cat")
    assert cat.args == (tuple(NodeRef(f"conv_g{i}") for i in range(4)), 1) and cat.spec == g.node("conv").spec
    assert after.outputs == ("conv_cat",)
    assert "w" not in after.constants and "b" not in after.constants  # the grouped weight is gone
    assert {n.provenance for n in after.nodes if n.name.startswith("conv_")} - {None} == {"conv"}
    assert p.anchor == "conv" and p.erase == ("conv",)


@pytest.mark.parametrize(
    ("knobs", "code", "message"),
    [
        ({"groups": 12, "cin": 24, "cout": 24}, "groups-out-of-range", "groups=12, allowed 2..10"),
        ({"groups": 8, "cin": 8, "cout": 8}, "depthwise-conv", "in = out = groups = 8"),
        ({"target": "aten.convolution.default", "transposed": True}, "transposed-conv", "transposed"),
        ({"rank": 3, "target": "aten.convolution.default"}, "unsupported-rank", "3 spatial dims"),
        ({"weight_is_input": True}, "not-constant", "weight of conv"),
        ({"bias_is_input": True}, "not-constant", "bias of conv"),
        ({"channels": "s1"}, "symbolic-shape", "input of conv"),
        ({"groups": 4, "cin": 8, "cout": 10}, "malformed-node", "do not split"),
    ],
)
def test_each_rejection(knobs: dict[str, object], code: str, message: str) -> None:
    g = grouped_conv(**knobs)  # type: ignore[arg-type]
    report = plan(g, [split_group_conv()])
    assert report.plans == () and report.after == g
    (r,) = report.rejections
    assert (r.rule, r.node, r.reason.code) == ("split-group-conv", "conv", code)
    assert message in r.reason.message


@pytest.mark.parametrize(
    ("name", "shape", "path", "message"),
    [
        ("conv", (1, "c", 4, 4), "conv", "output of conv has symbolic shape (1, 'c', 4, 4)"),
        ("w", ("o", 2, 3, 3), "conv.weight", "weight of conv has symbolic shape ('o', 2, 3, 3)"),
    ],
)
def test_symbolic_output_channels_or_weight_are_rejected(
    name: str, shape: tuple[int | str, ...], path: str, message: str
) -> None:
    g = grouped_conv()
    nodes = [replace(n, spec=spec(*shape)) if n.name == name else n for n in g.nodes]
    consts = {k: replace(c, spec=spec(*shape)) if k == name else c for k, c in g.constants.items()}
    (r,) = plan(fxpure.snapshot(nodes, consts), [split_group_conv()]).rejections
    assert (r.node, r.reason.code, r.reason.node, r.reason.path, r.reason.message) == (
        "conv",
        "symbolic-shape",
        "conv",
        path,
        message,
    )


def _dequantized_weight_conv(groups: int, cin: int, cout: int) -> GraphSnapshot:
    """A PT2E conv: its int8 weight dequantized per channel at run time."""
    g = GraphBuilder()
    x, w = g.input("x", (1, cin, 6, 6)), g.parameter("w", (cout, cin // groups, 3, 3), dtype="int8")
    scale, zp = g.buffer("scale", (cout,)), g.buffer("zp", (cout,), dtype="int64")
    dq = g.call(
        "quantized_decomposed.dequantize_per_channel.default",
        name="dq",
        input=w,
        scale=scale,
        zero_point=zp,
        axis=0,
        quant_min=-127,
        quant_max=127,
        dtype=DTypeArg("int8"),
        out=(cout, cin // groups, 3, 3),
    )
    g.output(g.call("aten.conv2d.default", name="conv", input=x, weight=dq, groups=groups, out=(1, cout, 4, 4)))
    return g.build()


@pytest.mark.parametrize(
    ("groups", "code", "message"),
    [
        # depthwise first: the weight's kind does not matter to a conv the rule never splits
        (8, "depthwise-conv", "conv is depthwise (in = out = groups = 8)"),
        (2, "quantized-weight", "weight of conv is quantized (dq): split the grouped conv before quantizing"),
    ],
)
def test_a_conv_of_a_dequantized_weight_is_declined_for_what_it_is(groups: int, code: str, message: str) -> None:
    (r,) = plan(_dequantized_weight_conv(groups, 8, 8), [split_group_conv()]).rejections
    assert (r.node, r.reason.code, r.reason.message) == ("conv", code, message)


def test_policy_is_a_parameter() -> None:
    g = grouped_conv(groups=6, cin=12, cout=12)
    assert plan(g, [split_group_conv()]).plans
    (r,) = plan(g, [split_group_conv(max_groups=4)]).rejections
    assert r.reason.message == "groups=6, allowed 2..4"


def test_regular_convs_are_not_candidates() -> None:
    report = plan(grouped_conv(groups=1, cin=4, cout=4), [split_group_conv()])
    assert report.plans == () and report.rejections == ()


def test_symbolic_batch_is_fine() -> None:
    report = plan(grouped_conv(batch="s0"), [split_group_conv()])
    assert len(report.plans) == 1
    assert report.after.node("conv_g0").spec == spec("s0", 3, 4, 4)


def test_fuse_then_split_slices_the_fused_weight() -> None:
    g = conv_bn(groups=2)
    report = plan(g, [fuse_conv_bn(), split_group_conv()])
    assert [p.rule for p in report.plans] == ["fuse-conv-bn", "split-group-conv"]
    after = report.after
    (fuse, _) = report.plans
    fused_w, fused_b = (c.expr for c in fuse.constants)
    w0 = after.constants["conv_bn_w0"].source
    assert w0 == Slice(x=fused_w, dim=0, start=0, stop=4)
    b1 = after.constants["conv_bn_b1"].source
    assert b1 == Slice(x=fused_b, dim=0, start=4, stop=8)
    # nothing fused survives unsliced: only the live (sliced) constants remain
    assert sorted(after.constants) == ["conv_bn_b0", "conv_bn_b1", "conv_bn_w0", "conv_bn_w1"]
    assert infer_spec(w0).unwrap() == spec(4, 2, 3, 3)
    # meta provenance points at the original conv, not the intermediate fused one
    assert after.node("conv_bn_g0").provenance == "conv"


def test_names_are_deterministic_and_collision_free() -> None:
    g = grouped_conv()
    taken = NodeSnapshot(name="conv_w0", op="placeholder", target="conv_w0", spec=spec(1))
    g2 = fxpure.snapshot([taken, *g.nodes], g.constants)
    a, b = plan(g2, [split_group_conv()]).after, plan(g2, [split_group_conv()]).after
    assert a == b
    assert "conv_w0_1" in a.constants and a.node("conv_g0").args[1] == NodeRef("conv_w0_1")


def test_edge_dialect_uses_the_copy_slice() -> None:
    g = grouped_conv(target="aten.convolution.default")
    edge = replace(g, dialect="edge")
    after = plan(edge, [split_group_conv()]).after
    assert after.node("conv_x0").target == "aten.slice_copy.Tensor"


@pytest.mark.parametrize(("low", "high"), [(0, 10), (1, 10), (5, 4), (2, "3"), (2.0, 10), (True, 10)])
def test_a_groups_range_that_is_no_range_of_groups_is_refused_when_the_rule_is_made(low: object, high: object) -> None:
    # min_groups 0 or 1 (groups=1 is never split), a range upside down, or a string (the rule
    # compared it with an int on the first grouped conv: a TypeError out of adapters.transform)
    with pytest.raises(ValueError, match=r"2 <= min_groups <= max_groups, got"):
        split_group_conv(min_groups=low, max_groups=high)  # type: ignore[arg-type]
    assert split_group_conv(min_groups=4, max_groups=4).name == "split-group-conv"  # one number of groups

"""``fxpure.layout``: which views any strides allow, and the three rules whose replacement has other
strides declining where a reader needs the value's own (exact code, path and node), on hand-built
snapshots. Torch-free."""

from __future__ import annotations

import pytest

from fxpure import plan
from fxpure.layout import layout_reader, only_splits
from fxpure.plan import Rule
from fxpure.rules import concat_parallel_linears, conv1d_to_conv2d, linear_to_conv2d, split_group_conv
from fxpure.snapshot import Dim, GraphSnapshot
from fxpure.testing import GraphBuilder


@pytest.mark.parametrize(
    ("src", "dst", "ok"),
    [
        ((2, 3, 4), (2, 3, 4), True),  # the same shape
        ((2, 12), (2, 3, 4), True),  # a split
        (("s0", 12), ("s0", 3, 4), True),  # a split after a symbolic dim
        ((2, 3), (2, 1, 3, 1), True),  # 1s added
        ((2, 1, 3), (2, 3), True),  # a 1 dropped
        ((2, 3, 4), (6, 4), False),  # a merge
        ((2, 3, 4), (2, 12), False),
        ((2, 3), (6,), False),
        (("s0", 3), ("3*s0",), False),  # a symbolic merge
        (("s0", 12), ("s0", 3, "s1"), False),  # a split into a symbolic part
        ((2, 3, 4), (2, 3), False),  # fewer elements
        ((2, 3), (2, 3, 4), False),  # more
        ((4, 6), (2, 12), False),  # the same size, other boundaries
        ((6, 5), (2, 3, 5), True),  # a split, then a dim kept
        (("4*s0", 16), ("s0", 2, 2, 4, 4), True),  # a symbolic product split (Swin's window reverse)
        (("4*s0",), ("2*s0", 2), True),
        (("s0*s1", 3), ("s1", "s0", 3), True),
        (("4*s0",), (8, "s0"), False),  # a part larger than the size
        (("4*s0",), ("s1", 4), False),  # another symbol
        (("s0", "s1"), ("s0*s1",), False),  # a symbolic merge
        (("4*s0",), ("s0", 2), False),  # fewer elements
        (("s0 + 1",), ("s0 + 1",), True),  # kept as it is
        (("s0 + 1", 2), ("s0", 2), False),  # a sum: no product to split
        ((6,), ("s0 + 1",), False),
    ],
)
def test_only_splits(src: tuple[Dim, ...], dst: tuple[Dim, ...], ok: bool) -> None:
    assert only_splits(src, dst) is ok


def _read_by(target: str, out: tuple[Dim, ...]) -> GraphSnapshot:
    """x (2, 3, 4) -> relu -> a reader of the relu's value as ``out``."""
    g = GraphBuilder()
    r = g.call("aten.relu.default", name="r", self=g.input("x", (2, 3, 4)), out=(2, 3, 4))
    if target == "aten.as_strided.default":
        g.output(g.node(target, (r, out, (1,) * len(out)), name="v", out=out))
    else:
        g.output(g.node(target, (r, out), name="v", out=out))
    return g.build()


@pytest.mark.parametrize(
    ("target", "out", "sensitive"),
    [
        ("aten.view.default", (6, 4), True),
        ("aten._unsafe_view.default", (24,), True),
        ("aten.view.default", (2, 3, 2, 2), False),
        ("aten.view_copy.default", (24,), False),  # edge's view copies
        ("aten.reshape.default", (24,), False),  # copies when it must
        ("aten.as_strided.default", (2, 3, 4), True),  # reads by strides whatever the shape
    ],
)
def test_layout_reader(target: str, out: tuple[int, ...], sensitive: bool) -> None:
    reason = layout_reader(_read_by(target, out), "r", path="p")
    if not sensitive:
        assert reason is None
        return
    assert reason is not None and (reason.code, reason.node, reason.path) == ("layout-sensitive-reader", "r", "p")
    assert reason.message == f"v ({target}) reads r as {out} by its strides, which the replacement may change"


def _linear(view: tuple[int, ...]) -> GraphSnapshot:
    """x (2, 5, 8) -> linear (6 features) -> aten.view."""
    g = GraphBuilder()
    x, w = g.input("x", (2, 5, 8)), g.parameter("w", (6, 8))
    y = g.call("aten.linear.default", name="lin", out=(2, 5, 6), input=x, weight=w, bias=None)
    g.output(g.call("aten.view.default", name="v", out=view, self=y, size=view))
    return g.build()


def _conv1d(view: tuple[int, ...]) -> GraphSnapshot:
    """x (2, 4, 16) -> conv1d (6 channels, kernel 1) -> aten.view."""
    g = GraphBuilder()
    x, w = g.input("x", (2, 4, 16)), g.parameter("w", (6, 4, 1))
    y = g.call("aten.conv1d.default", name="conv", out=(2, 6, 16), input=x, weight=w, bias=None)
    g.output(g.call("aten.view.default", name="v", out=view, self=y, size=view))
    return g.build()


def _kv(view: tuple[int, ...]) -> GraphSnapshot:
    """x (2, 5, 8) -> k, v linears (4 features each); k -> aten.view."""
    g = GraphBuilder()
    x = g.input("x", (2, 5, 8))
    k, v = (
        g.call("aten.linear.default", name=n, out=(2, 5, 4), input=x, weight=g.parameter(f"w{n}", (4, 8)), bias=None)
        for n in ("k", "v")
    )
    g.output(g.call("aten.view.default", name="kv", out=view, self=k, size=view), v)
    return g.build()


CASES = [
    (linear_to_conv2d(), _linear, (2, 30), (2, 5, 2, 3), "lin", "lin"),
    (conv1d_to_conv2d(), _conv1d, (2, 96), (2, 6, 4, 4), "conv", "conv"),
    (concat_parallel_linears(), _kv, (40,), (2, 5, 2, 2), "k", "lin"),
]


@pytest.mark.parametrize(("rule", "build", "merging", "splitting", "node", "path"), CASES)
def test_a_rule_whose_result_has_other_strides_declines_where_a_view_merges_dims(
    rule: Rule, build: object, merging: tuple[int, ...], splitting: tuple[int, ...], node: str, path: str
) -> None:
    assert callable(build)
    split = plan(build(splitting), [rule])
    assert len(split.plans) == 1 and not split.rejections
    merged = plan(build(merging), [rule])
    assert not merged.plans
    (no,) = [j for j in merged.rejections if j.node == node]  # (the group's input: too few linears left)
    assert (no.node, no.reason.code, no.reason.node, no.reason.path) == (node, "layout-sensitive-reader", node, path)
    assert no.reason.message.startswith(f"{'kv' if node == 'k' else 'v'} (aten.view.default) reads {node} as {merging}")


def test_a_rank_2_linear_result_is_contiguous_whatever_reads_it() -> None:
    g = GraphBuilder()
    x, w = g.input("x", (10, 8)), g.parameter("w", (6, 8))
    y = g.call("aten.linear.default", name="lin", out=(10, 6), input=x, weight=w, bias=None)
    g.output(g.call("aten.view.default", name="v", out=(60,), self=y, size=(60,)))
    assert len(plan(g.build(), [linear_to_conv2d()]).plans) == 1


def test_edge_views_copy() -> None:
    g = GraphBuilder(dialect="edge")
    x, w = g.input("x", (2, 4, 16)), g.parameter("w", (6, 4, 1))
    y = g.call(
        "aten.convolution.default",
        name="conv",
        out=(2, 6, 16),
        input=x,
        weight=w,
        bias=None,
        stride=(1,),
        padding=(0,),
        dilation=(1,),
        transposed=False,
        output_padding=(0,),
        groups=1,
    )
    g.output(g.call("aten.view_copy.default", name="v", out=(192,), self=y, size=(192,)))
    assert len(plan(g.build(), [conv1d_to_conv2d()]).plans) == 1


def test_a_view_of_unknown_shape_or_of_a_value_of_unknown_shape_may_merge() -> None:
    g = GraphBuilder()
    r = g.node("aten.relu.default", (g.input("x", (2, 3)),), name="r")  # no spec
    g.output(g.node("aten.view.default", (r, (6,)), name="v", out=(6,)))
    reason = layout_reader(g.build(), "r", path="p")
    assert (
        reason is not None
        and reason.message == "v (aten.view.default) reads r as (6,) by its strides, which the replacement may change"
    )
    g = GraphBuilder()
    r = g.call("aten.relu.default", name="r", self=g.input("x", (2, 3)), out=(2, 3))
    g.output(g.node("aten.view.default", (r, (6,)), name="v"))  # no spec
    reason = layout_reader(g.build(), "r", path="p")
    assert reason is not None and "reads r as an unknown shape by its strides" in reason.message


def test_the_reason_is_located_at_the_linears_reshape_back_where_the_spelling_has_one() -> None:
    # aten's addmm spelling of a rank 3 linear (x viewed flat, addmm, viewed back), read by a merging view
    g = GraphBuilder()
    x, w, b = g.input("x", (2, 5, 8)), g.parameter("w", (6, 8)), g.parameter("b", (6,))
    flat = g.call("aten.view.default", name="lin_in", out=(10, 8), self=x, size=(10, 8))
    t = g.call("aten.permute.default", name="lin_t", out=(8, 6), self=w, dims=(1, 0))
    y = g.call("aten.addmm.default", name="lin", out=(10, 6), self=b, mat1=flat, mat2=t)
    back = g.call("aten.view.default", name="lin_out", out=(2, 5, 6), self=y, size=(2, 5, 6))
    k = g.call("aten.linear.default", name="k", out=(2, 5, 6), input=x, weight=g.parameter("wk", (6, 8)), bias=None)
    g.output(g.call("aten.view.default", name="v", out=(2, 30), self=back, size=(2, 30)), k)
    for rule in (linear_to_conv2d(), concat_parallel_linears()):
        (no,) = [j for j in plan(g.build(), [rule]).rejections if j.reason.code == "layout-sensitive-reader"]
        assert (no.reason.node, no.reason.path) == ("lin_out", "lin.user/lin_out")


def _linear_then(*after: str) -> GraphSnapshot:
    """x (2, 5, 8) -> linear -> each op of ``after`` in turn -> aten.view merging (2, 30)."""
    g = GraphBuilder()
    x, w = g.input("x", (2, 5, 8)), g.parameter("w", (6, 8))
    y = g.call("aten.linear.default", name="lin", out=(2, 5, 6), input=x, weight=w, bias=None)
    for op in after:
        if op == "relu":
            y = g.call("aten.relu.default", name="relu", out=(2, 5, 6), self=y)
        elif op == "linear":  # a product lays its result out afresh
            y = g.call(
                "aten.linear.default", name="lin2", out=(2, 5, 6), input=y, weight=g.parameter("w2", (6, 6)), bias=None
            )
        elif op == "add":  # an input added: the walk up goes on past it, to the relu
            y = g.call("aten.add.Tensor", name="add", out=(2, 5, 6), self=y, other=g.input("z", (2, 5, 6)))
        else:  # a view of another value, whose size only comes from the linear's, viewed again
            size = g.node("aten.sym_size.int", (y, 0), name="size")
            other = g.call("aten.relu.default", name="other", out=(2, 5, 6), self=g.input("z", (2, 5, 6)))
            flat = g.node("aten.view.default", (other, (size, 30)), name="flat", out=(2, 30))
            g.output(g.node("aten.view.default", (flat, (60,)), name="v", out=(60,)))
            return g.build()
    g.output(g.call("aten.view.default", name="v", out=(2, 30), self=y, size=(2, 30)))
    return g.build()


def test_a_reader_behind_ops_that_pass_the_strides_on_counts() -> None:
    (no,) = plan(_linear_then("relu"), [linear_to_conv2d()]).rejections
    assert (no.node, no.reason.code) == ("lin", "layout-sensitive-reader")
    assert no.reason.message == (
        "v (aten.view.default) reads relu as (2, 30) (which has lin's strides) by its strides, "
        "which the replacement may change"
    )


def test_the_walk_up_goes_past_an_input_to_every_other_operand() -> None:
    (no,) = plan(_linear_then("relu", "add"), [linear_to_conv2d()]).rejections
    assert (no.node, no.reason.code) == (
        "lin",
        "layout-sensitive-reader",
    ) and "reads add as (2, 30)" in no.reason.message


def test_the_first_reader_found_is_named() -> None:
    g = GraphBuilder()
    r = g.call("aten.relu.default", name="r", self=g.input("x", (2, 3, 4)), out=(2, 3, 4))
    g.output(*(g.node("aten.view.default", (r, (6, 4)), name=v, out=(6, 4)) for v in ("v1", "v2")))
    reason = layout_reader(g.build(), "r")
    assert reason is not None and reason.message.startswith("v1 ")


def _grouped(reader: str) -> GraphSnapshot:
    """x (1, 4, 6, 6) -> conv (groups 2) -> ``reader``: a merging view, or as_strided behind a relu."""
    g = GraphBuilder()
    x, w = g.input("x", (1, 4, 6, 6)), g.parameter("w", (4, 2, 1, 1))
    y = g.call("aten.conv2d.default", name="conv", out=(1, 4, 6, 6), input=x, weight=w, bias=None, groups=2)
    if reader == "view":
        g.output(g.call("aten.view.default", name="v", out=(1, 144), self=y, size=(1, 144)))
    else:
        r = g.call("aten.relu.default", name="relu", out=(1, 4, 6, 6), self=y)
        g.output(g.node("aten.as_strided.default", (r, (1, 4, 6, 6), (144, 36, 6, 1)), name="s", out=(1, 4, 6, 6)))
    return g.build()


def test_a_grouped_conv_is_split_under_a_merging_view_and_not_when_read_by_strides() -> None:
    rule = split_group_conv()
    assert len(plan(_grouped("view"), [rule]).plans) == 1  # the cat is laid out as the conv's output here
    (no,) = plan(_grouped("strided"), [rule]).rejections
    assert (no.node, no.reason.code, no.reason.path) == ("conv", "layout-sensitive-reader", "conv")


def test_a_product_lays_its_result_out_afresh_and_a_size_passes_no_strides() -> None:
    behind = plan(_linear_then("linear"), [linear_to_conv2d()])
    assert [p.anchor for p in behind.plans] == ["lin"]  # lin2 is the view's: declined
    assert [(j.node, j.reason.code) for j in behind.rejections] == [("lin2", "layout-sensitive-reader")]
    assert len(plan(_linear_then("size"), [linear_to_conv2d()]).plans) == 1


def test_views_false_counts_only_readers_by_strides() -> None:
    merged = _linear_then("relu")
    assert layout_reader(merged, "lin", views=False) is None and layout_reader(merged, "lin") is not None
    g = GraphBuilder(dialect="edge")
    r = g.call("aten.relu.default", name="r", self=g.input("x", (2, 3)), out=(2, 3))
    g.output(g.node("aten.as_strided_copy.default", (r, (3, 2), (2, 1)), name="s", out=(3, 2)))
    reason = layout_reader(g.build(), "r", views=False)
    assert reason is not None and reason.message.startswith("s (aten.as_strided_copy.default) reads r as (3, 2)")


def test_a_control_flow_op_reads_its_operands_strides_and_not_its_predicates() -> None:
    # relu(x) is an operand of a cond (its branches may view it): the cond counts as a reader, through
    # what passed the strides on; its predicate, a 0-d value, has none to pass
    g = GraphBuilder()
    x = g.input("x", (2, 3, 4))
    r = g.call("aten.relu.default", name="r", self=x, out=(2, 3, 4))
    pred = g.node("aten.gt.Scalar", (g.node("aten.sum.default", (x,), name="s", out=()), 0), name="p", out=())
    branch = g.node("get_attr_like", (), name="true_graph_0")
    g.output(g.node("higher_order.cond", (pred, branch, branch, (r,)), name="cond", out=(2, 3, 4)))
    snap = g.build()
    reason = layout_reader(snap, "r")
    assert reason is not None and reason.message == (
        "cond (higher_order.cond) reads r in a graph of its own, which may read it by its strides (fxpure does"
        " not look in), which the replacement may change"
    )
    behind = layout_reader(snap, "x")
    assert behind is not None and behind.message.startswith(
        "cond (higher_order.cond) reads r (which has x's strides) in a graph of its own"
    )
    assert layout_reader(snap, "s") is None and layout_reader(snap, "p") is None

"""concat_parallel_linears on hand-built snapshots: every plan shape and every reason code."""

from __future__ import annotations

import gc
import importlib
import json
import sys
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import replace

import pytest
from returns.result import Failure, Result

from fxpure import NodeRef, plan, rewrite, snapshot, verify
from fxpure.pattern import Match, Root, match
from fxpure.reasons import Declined, Malformed, Reason, SymbolicShape
from fxpure.rules.concat_parallel_linears import concat_parallel_linears
from fxpure.serial import to_data
from fxpure.snapshot import Arg, GraphSnapshot, NodeSnapshot, TensorSpec
from fxpure.testing import GraphBuilder, spec
from fxpure.weights import Concat, Fill, Source

RULE = concat_parallel_linears()
SLICE = {"aten": "aten.slice.Tensor", "edge": "aten.slice_copy.Tensor"}
SPLIT = {"aten": "aten.split_with_sizes.default", "edge": "aten.split_with_sizes_copy.default"}


def parallel(
    *,
    outs: Sequence[int | str] = (6, 4, 4),
    bias: Sequence[bool] = (True, False, True),
    form: str = "aten",
    rank: int = 3,
    batch: int | str = 2,
    seq: int | str = 3,
    features: int | str = 8,
    lifted: bool = True,
    weight_input: int | None = None,
    bias_input: int | None = None,
    dtypes: Mapping[int, str] | None = None,
    rows: Mapping[int, int] | None = None,
    cols: Mapping[int, int] | None = None,
    shared_view: bool = False,
    flat_user: int | None = None,
    late_size: bool = False,
) -> GraphSnapshot:
    """x -> linear_i(W_i, b_i) for each i -> output (linear 1 through a relu), in one spelling:
    ``aten`` (aten.linear), ``edge`` (permute_copy + addmm/mm, inside view_copy for rank 3) or
    ``edge-linear`` (edge with linear preserved). Linear i's product is ``lin{i}``. Knobs for
    every rejection: a weight or bias computed at run time, another dtype, weight rows that do
    not match the output (``rows``) or the input (``cols``), a flat output also read by a relu (``flat_user``); and
    ``late_size``: out0 reshapes with a size computed after the other linears' outputs."""
    g = GraphBuilder(dialect="aten" if form == "aten" else "edge", lifted=lifted)
    dtypes, rows, cols = dtypes or {}, rows or {}, cols or {}
    lead: tuple[int | str, ...] = (batch, seq) if rank == 3 else (batch,)
    x = g.input("x", (*lead, features))
    nd = form == "edge" and rank == 3
    sizes: tuple[Arg, ...] = lead
    numel: Arg = batch * seq if isinstance(batch, int) and isinstance(seq, int) else 0
    if nd and not all(isinstance(d, int) for d in lead):
        sizes = tuple(g.node("aten.sym_size.int", (x, d), name=f"sym{d}") for d in range(2))
        numel = g.node("_operator.mul", sizes, name="numel")
    flat_dim = numel if isinstance(numel, int) else f"{batch}*{seq}"
    results: list[NodeRef] = []
    view: NodeRef | None = None
    for i, (o, has_bias) in enumerate(zip(outs, bias, strict=True)):
        dtype = dtypes.get(i, "float32")
        w_shape = (rows.get(i, o), cols.get(i, features))
        w = g.input(f"w{i}", w_shape) if i == weight_input else g.parameter(f"w{i}", w_shape, dtype, key=f"l{i}.w")
        b = None
        if has_bias:
            b = g.input(f"b{i}", w_shape[:1]) if i == bias_input else g.parameter(f"b{i}", w_shape[:1], dtype)
        out = spec(*lead, o, dtype=dtype)
        if form != "edge":
            results.append(g.call("aten.linear.default", name=f"lin{i}", out=out, input=x, weight=w, bias=b))
            continue
        if nd and (view is None or not shared_view):
            view = g.call("aten.view_copy.default", name=f"flat{i}", out=(flat_dim, features), self=x, size=(numel, 8))
        t = g.call("aten.permute_copy.default", name=f"t{i}", out=(features, o), self=w, dims=(1, 0))
        mat = view if nd and view is not None else x
        prod = spec(flat_dim, o, dtype=dtype) if nd else out
        if b is None:
            y = g.call("aten.mm.default", name=f"lin{i}", out=prod, self=mat, mat2=t)
        else:
            y = g.call("aten.addmm.default", name=f"lin{i}", out=prod, self=b, mat1=mat, mat2=t)
        if i == flat_user:
            results.append(g.call("aten.relu.default", name=f"flat_relu{i}", out=prod, self=y))
        if nd and not (late_size and i == 0):
            y = g.call("aten.view_copy.default", name=f"out{i}", out=out, self=y, size=(*sizes, o))
        results.insert(i, y)
    if late_size:  # out0 reads a size computed after the other linears' outputs
        late = g.node("aten.sym_size.int", (x, 0), name="late")
        size = (late, sizes[1], outs[0])
        results[0] = g.call("aten.view_copy.default", name="out0", out=spec(*lead, outs[0]), self=results[0], size=size)
    results[1] = g.call("aten.relu.default", name="act1", out=spec(*lead, outs[1]), self=results[1])
    g.output(*results)
    return g.build()


def outer(form: str, rank: int, i: int) -> str:
    """The node that carries linear i's result."""
    return f"out{i}" if form == "edge" and rank == 3 else f"lin{i}"


def calls(s: GraphSnapshot) -> list[str]:
    return [n.name for n in s.nodes if n.op == "call_function"]


def src(g: GraphSnapshot, key: str) -> Source:
    return Source(key=key, spec=g.constants[key].spec)


def widths(after: GraphSnapshot) -> tuple[int, ...]:
    """The column count of every slice the rule made, in order (each checked to follow the last)."""
    parts = [n for n in after.nodes if n.name.endswith("_part")]
    assert all(n.target in SLICE.values() for n in parts)
    starts, ends = [n.args[2] for n in parts], [n.args[3] for n in parts]
    assert starts == [0, *ends[:-1]]
    return tuple(int(e) - int(a) for a, e in zip(starts, ends, strict=True))  # type: ignore[arg-type]


FORMS = [("aten", 3, True), ("aten", 2, False), ("edge", 2, True), ("edge", 3, True), ("edge-linear", 3, True)]
PARTS = ["lin0_part", "lin1_part", "lin2_part", "act1"]
JOINED_NODES = {
    ("aten", 3): ["lin0_cat", *PARTS],
    ("aten", 2): ["lin0_cat", *PARTS],
    ("edge-linear", 3): ["lin0_cat", *PARTS],
    ("edge", 2): ["t0_cat", "lin0_cat", *PARTS],
    ("edge", 3): ["flat0", "t0_cat", "lin0_cat", "out0_cat", *PARTS],
}


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize(("form", "rank", "lifted"), FORMS)
def test_plan_shape(form: str, rank: int, lifted: bool, split: bool) -> None:
    g = parallel(form=form, rank=rank, lifted=lifted)
    report = plan(g, [concat_parallel_linears(split=split)])
    assert report.rejections == ()
    (p,) = report.plans
    assert (p.rule, p.anchor) == ("concat-parallel-linears", "x")
    after = verify(report.after).unwrap()
    nodes = JOINED_NODES[(form, rank)]
    assert calls(after) == (nodes if not split else [*nodes[: -len(PARTS)], "lin0_split", *PARTS])
    lead = (2, 3) if rank == 3 else (2,)
    # one weight (14, 8): the three stacked; one bias: the two biases with zeros for the linear without
    assert sorted(after.constants) == ["lin0_cat_bias", "lin0_cat_weight"]
    weight, bias = after.constants["lin0_cat_weight"], after.constants["lin0_cat_bias"]
    assert weight.source == Concat(xs=(src(g, "w0"), src(g, "w1"), src(g, "w2")), dim=0)
    assert bias.source == Concat(xs=(src(g, "b0"), Fill(shape=(4,), value=0.0, dtype="float32"), src(g, "b2")), dim=0)
    assert (weight.spec, bias.spec) == (spec(14, 8), spec(14))
    assert after.node("lin0_cat_weight").op == ("placeholder" if lifted else "get_attr")
    # the linear, in the first one's spelling, with 14 outputs, cut 6 / 4 / 4 along the last dim
    joined = NodeRef("out0_cat" if (form, rank) == ("edge", 3) else "lin0_cat")
    assert after.node(joined.name).spec == spec(*lead, 14)
    specs = (spec(*lead, 6), spec(*lead, 4), spec(*lead, 4))
    bounds = ((0, 6), (6, 10), (10, 14))
    if split:
        whole = after.node("lin0_split")
        assert (whole.target, whole.args, whole.spec) == (SPLIT[g.dialect], (joined, (6, 4, 4), rank - 1), specs)
    for i in range(3):
        part = after.node(f"lin{i}_part")
        args = (NodeRef("lin0_split"), i) if split else (joined, rank - 1, *bounds[i])
        assert (part.target, part.args, part.spec) == ("getitem" if split else SLICE[g.dialect], args, specs[i])
        # the part stands for its linear: meta (module stack, stack trace) from it, spelled as y[..., a:b]
        assert (part.provenance, part.source_fn) == (f"lin{i}", "getitem")
    # every use of each linear now reads its part
    assert after.outputs == ("lin0_part", "act1", "lin2_part")
    assert after.node("act1").args == (NodeRef("lin1_part"),)
    assert p.replace == tuple((outer(form, rank, i), f"lin{i}_part") for i in range(3))
    lin = after.node("lin0_cat")
    if form == "edge":
        t = after.node("t0_cat")
        assert t.args == (NodeRef("lin0_cat_weight"), (1, 0)) and t.spec == spec(8, 14)
        x = NodeRef("flat0" if rank == 3 else "x")
        assert lin.target == "aten.addmm.default" and lin.args == (NodeRef("lin0_cat_bias"), x, NodeRef("t0_cat"))
    else:
        assert lin.target == "aten.linear.default"
        assert lin.args == (NodeRef("x"), NodeRef("lin0_cat_weight"), NodeRef("lin0_cat_bias"))
    if (form, rank) == ("edge", 3):
        assert after.node("out0_cat").args == (NodeRef("lin0_cat"), (2, 3, 14))


@pytest.mark.parametrize("form", ["aten", "edge"])
def test_without_any_bias_there_is_no_bias(form: str) -> None:
    g = parallel(form=form, rank=2, bias=(False, False, False))
    after = plan(g, [RULE]).after
    assert sorted(after.constants) == ["lin0_cat_weight"]
    lin = after.node("lin0_cat")
    if form == "edge":
        assert lin.target == "aten.mm.default" and lin.args == (NodeRef("x"), NodeRef("t0_cat"))
    else:
        assert lin.args[:2] == (NodeRef("x"), NodeRef("lin0_cat_weight")) and lin.args[2:] in ((), (None,))


def test_with_every_bias_the_biases_are_stacked() -> None:
    g = parallel(bias=(True, True, True))
    bias = plan(g, [RULE]).after.constants["lin0_cat_bias"]
    assert bias.source == Concat(xs=(src(g, "b0"), src(g, "b1"), src(g, "b2")), dim=0)


def test_a_first_linear_without_bias_becomes_an_addmm() -> None:
    g = parallel(form="edge", rank=3, outs=(3, 5), bias=(False, True))
    after = verify(plan(g, [RULE]).after).unwrap()
    lin = after.node("lin0_cat")
    assert lin.target == "aten.addmm.default"
    assert lin.args == (NodeRef("lin0_cat_bias"), NodeRef("flat0"), NodeRef("t0_cat"))
    zeros = Fill(shape=(3,), value=0.0, dtype="float32")
    assert after.constants["lin0_cat_bias"].source == Concat(xs=(zeros, src(g, "b1")), dim=0)


@pytest.mark.parametrize("outs", [(4, 4), (1, 7, 2), (16, 4, 4, 8), (3, 1, 4, 1, 5)])
@pytest.mark.parametrize("form", ["aten", "edge"])
def test_any_number_of_any_sizes(outs: tuple[int, ...], form: str) -> None:
    n = len(outs)
    g = parallel(outs=outs, bias=tuple(i % 2 == 0 for i in range(n)), form=form)
    report = plan(g, [RULE])
    assert report.rejections == () and len(report.plans) == 1
    after = verify(report.after).unwrap()
    assert after.constants["lin0_cat_weight"].spec == spec(sum(outs), 8)
    assert widths(after) == outs
    assert tuple(after.node(f"lin{i}_part").spec for i in range(n)) == tuple(spec(2, 3, o) for o in outs)


@pytest.mark.parametrize(
    ("knobs", "rejected", "joined"),
    [
        ({"weight_input": 1}, {("lin1", "not-constant")}, (6, 4)),
        ({"bias_input": 2}, {("lin2", "not-constant")}, (6, 4)),
        ({"dtypes": {2: "float16"}}, {("lin2", "dtype-mismatch")}, (6, 4)),
        ({"outs": (6, "s5", 4)}, {("lin1", "symbolic-shape")}, (6, 4)),
        ({"rows": {0: 5}}, {("lin0", "malformed-node")}, (4, 4)),
        ({"cols": {2: 7}}, {("lin2", "malformed-node")}, (6, 4)),
        ({"form": "edge", "flat_user": 1}, {("lin1", "output-shared")}, (6, 4)),
        (
            {"weight_input": 1, "outs": (6, 4), "bias": (True, True)},
            {("x", "too-few-linears"), ("lin1", "not-constant")},
            None,
        ),
        ({"features": "s9"}, {("x", "symbolic-shape")}, None),
        (
            {"dtypes": {0: "float16", 1: "bfloat16"}},
            {("x", "too-few-linears"), ("lin0", "dtype-mismatch"), ("lin1", "dtype-mismatch")},
            None,
        ),
    ],
)
def test_each_rejection(
    knobs: dict[str, object], rejected: set[tuple[str, str]], joined: tuple[int, ...] | None
) -> None:
    g = parallel(**knobs)  # type: ignore[arg-type]
    report = plan(g, [RULE])
    got = {(r.node, r.reason.code) for r in report.rejections}
    assert got == rejected
    assert {c for _, c in got} <= RULE.codes
    assert all(r.rule == "concat-parallel-linears" for r in report.rejections)
    if joined is None:
        assert report.plans == () and report.after == g  # declined: untouched
        return
    assert len(report.plans) == 1
    after = verify(report.after).unwrap()
    assert widths(after) == joined
    for node, _ in rejected:
        assert node in after.index  # the linear that cannot join is left as it was
        assert after.node(node) == g.node(node)


def test_reasons_say_what_is_wrong() -> None:
    def reasons(**knobs: object) -> dict[str, str]:
        return {r.node: r.reason.message for r in plan(parallel(**knobs), [RULE]).rejections}  # type: ignore[arg-type]

    # (an input of the program, named as one: no node computes it)
    assert (
        reasons(weight_input=1)["lin1"] == "weight of lin1 is not a constant tensor (it is w1, an input of the program)"
    )
    assert reasons(bias_input=2)["lin2"] == "bias of lin2 is not a constant tensor (it is b2, an input of the program)"
    assert reasons(dtypes={2: "float16"})["lin2"] == "lin2 computes in float16, its input is float32"
    assert reasons(outs=(6, "s5", 4))["lin1"] == "output of lin1 has symbolic shape (2, 3, 's5')"
    assert reasons(form="edge", flat_user=1)["lin1"] == "output of lin1 is also used by flat_relu1"
    assert "input features of x has symbolic shape" in reasons(features="s9")["x"]
    few = reasons(weight_input=1, outs=(6, 4), bias=(True, True))["x"]
    assert few == "x is read by 2 linears, 1 of which can join (lin1: not-constant)"


def test_anchors_are_the_input_and_the_linears_that_cannot_join() -> None:
    g = parallel(weight_input=1, dtypes={2: "float16"}, outs=(6, 4, 4, 2), bias=(True, True, True, False))
    assert [n.name for n in RULE.anchors(g)] == ["x", "lin1", "lin2"]
    assert [n.name for n in RULE.anchors(parallel())] == ["x"]
    # asked directly, a linear that joins points at the input; an unrelated node is no anchor
    joins = RULE.plan_at(g, g.node("lin0")).failure()
    assert (joins.code, joins.message) == ("malformed-node", "lin0: lin0 joins the linears of x there")
    other = RULE.plan_at(g, g.node("act1")).failure()
    assert (other.code, other.message) == ("malformed-node", "act1: act1 is not an anchor of concat-parallel-linears")


def test_one_linear_is_no_candidate() -> None:
    g = GraphBuilder()
    x = g.input("x", (2, 8))
    w = g.parameter("w", (6, 8))
    y = g.call("aten.linear.default", name="lin", out=(2, 6), input=x, weight=w)
    g.output(y, g.call("aten.relu.default", name="r", out=(2, 8), self=x))
    report = plan(g.build(), [RULE])
    assert report.plans == () and report.rejections == ()


def test_a_weight_used_elsewhere_stays_and_one_used_twice_is_stacked_twice() -> None:
    g = GraphBuilder()
    w = g.parameter("w", (4, 8))
    x, y = g.input("x", (2, 8)), g.input("y", (2, 8))
    q = g.call("aten.linear.default", name="q", out=(2, 4), input=x, weight=w)
    k = g.call("aten.linear.default", name="k", out=(2, 4), input=x, weight=w)
    other = g.call("aten.linear.default", name="other", out=(2, 4), input=y, weight=w)
    g.output(q, k, other)
    s = g.build()
    report = plan(s, [RULE])
    assert [p.anchor for p in report.plans] == ["x"]
    after = verify(report.after).unwrap()
    w_src = src(s, "w")
    assert after.constants["q_cat_weight"].source == Concat(xs=(w_src, w_src), dim=0)
    assert after.constants["w"] == s.constants["w"] and after.node("other") == s.node("other")  # untouched
    # without the other reader, the old weight goes
    g2 = GraphBuilder()
    w2, x2 = g2.parameter("w", (4, 8)), g2.input("x", (2, 8))
    g2.output(*(g2.call("aten.linear.default", name=n, out=(2, 4), input=x2, weight=w2) for n in ("q", "k")))
    assert "w" not in plan(g2.build(), [RULE]).after.constants


def test_a_shared_flat_view_is_kept_for_the_joined_linear() -> None:
    g = parallel(form="edge", rank=3, shared_view=True)
    report = plan(g, [RULE])
    after = verify(report.after).unwrap()
    assert calls(after)[0] == "flat0" and after.node("lin0_cat").args[1] == NodeRef("flat0")


def test_edge_reshapes_of_unjoined_linears_stay() -> None:
    g = parallel(form="edge", rank=3, weight_input=1)
    after = verify(plan(g, [RULE]).after).unwrap()
    assert {"flat1", "t1", "lin1", "out1"} <= set(after.index)
    assert {"flat2", "t2", "lin2", "out2"}.isdisjoint(after.index)


def test_the_new_nodes_go_before_the_earliest_output_with_what_they_read() -> None:
    # out0 is written last and reads a size computed after out1 and out2: the joined linear is
    # spelled after the linear whose output comes first, so it reads nothing defined later
    g = parallel(form="edge", rank=3, late_size=True, batch="s0", seq=3)
    assert g.index["late"] > g.index["out2"]
    report = plan(g, [RULE])
    assert len(report.plans) == 1 and report.rejections == ()
    after = verify(report.after).unwrap()
    assert after.node("out1_cat").args[1] == (NodeRef("sym0"), NodeRef("sym1"), 14)


@pytest.mark.parametrize("form", ["aten", "edge", "edge-linear"])
def test_dynamic_batch_and_sequence_stay_symbolic(form: str) -> None:
    g = parallel(form=form, batch="s0", seq="s1")
    report = plan(g, [RULE])
    assert report.rejections == ()
    after = verify(report.after).unwrap()
    parts = tuple(after.node(f"lin{i}_part").spec for i in range(3))
    assert parts == (spec("s0", "s1", 6), spec("s0", "s1", 4), spec("s0", "s1", 4))
    if form == "edge":
        assert after.node("out0_cat").args[1] == (NodeRef("sym0"), NodeRef("sym1"), 14)
        assert after.node("lin0_cat").spec == spec("s0*s1", 14)
        assert after.node("flat0").args[1] == (NodeRef("numel"), 8)
    else:
        assert after.node("lin0_cat").spec == spec("s0", "s1", 14)


def test_nested_groups_join_in_one_pass() -> None:
    # the outer group takes a's uses; the inner group reads a (so does not claim it) and gets a's part
    g = GraphBuilder()
    ws = [g.parameter(f"w{i}", (8, 8)) for i in range(4)]
    x = g.input("x", (2, 8))
    a = g.call("aten.linear.default", name="a", out=(2, 8), input=x, weight=ws[0])
    b = g.call("aten.linear.default", name="b", out=(2, 8), input=x, weight=ws[1])
    c = g.call("aten.linear.default", name="c", out=(2, 8), input=a, weight=ws[2])
    d = g.call("aten.linear.default", name="d", out=(2, 8), input=a, weight=ws[3])
    g.output(b, c, d)
    report = plan(g.build(), [RULE])
    assert [p.anchor for p in report.plans] == ["x", "a"] and report.rejections == ()
    after = verify(report.after).unwrap()
    assert sorted(after.constants) == ["a_cat_weight", "c_cat_weight"]
    assert calls(after) == ["a_cat", "a_part", "b_part", "c_cat", "c_part", "d_part"]
    assert after.node("c_cat").args[:2] == (NodeRef("a_part"), NodeRef("c_cat_weight"))
    assert after.outputs == ("b_part", "c_part", "d_part")


def test_a_second_pass_finds_nothing_more() -> None:
    after = plan(parallel(form="edge"), [RULE]).after
    again = plan(after, [RULE])
    assert again.plans == () and again.rejections == ()


def test_plans_are_deterministic_data() -> None:
    g = parallel(form="edge")
    a, b = plan(g, [RULE]), plan(g, [RULE])
    assert a.plans == b.plans and a.after == b.after
    assert rewrite(g, a.plans).unwrap() == a.after
    json.dumps(to_data(a.plans))  # plain data, for --json and golden files


def test_unknown_shapes_are_declined() -> None:
    g = GraphBuilder()
    w0, w1 = g.parameter("w0", (4, 8)), g.parameter("w1", (2, 8))
    x = g.input("x", (2, 8))
    y = g.call("aten.relu.default", name="y", out=None, self=x)  # no known shape
    a = g.call("aten.linear.default", name="a", out=(2, 4), input=y, weight=w0)
    b = g.call("aten.linear.default", name="b", out=(2, 2), input=y, weight=w1)
    c = g.call("aten.linear.default", name="c", out=(2, 4), input=x, weight=w0)
    d = g.call("aten.linear.default", name="d", out=None, input=x, weight=w1)
    g.output(a, b, c, d)
    report = plan(g.build(), [RULE])
    got = {(r.node, r.reason.code, r.reason.message) for r in report.rejections}
    assert got == {
        ("y", "malformed-node", "y: y has no known shape"),
        ("x", "too-few-linears", "x is read by 2 linears, 1 of which can join (d: malformed-node)"),
        ("d", "malformed-node", "d: d has no known output or weight shape"),
    }
    assert report.plans == ()


def reshaped(form: str) -> GraphSnapshot:
    """Two linears reading a reshape of x in the model itself (``form``: ``aten``, ``edge``: mm on it, lin0
    also read by a relu, ``edge3``: each mm in its own flatten of the reshape and back)."""
    g = GraphBuilder(dialect="aten" if form == "aten" else "edge")
    view = "aten.view.default" if form == "aten" else "aten.view_copy.default"
    xv = g.call(view, name="xv", out=(6, 8), self=g.input("x", (2, 3, 8)), size=(6, 8))
    ys = []
    for i in range(2):
        w = g.parameter(f"w{i}", (4, 8))
        if form == "aten":
            ys.append(g.call("aten.linear.default", name=f"lin{i}", out=(6, 4), input=xv, weight=w))
            continue
        flat = g.call(view, name=f"flat{i}", out=(6, 8), self=xv, size=(6, 8)) if form == "edge3" else xv
        t = g.call("aten.permute_copy.default", name=f"t{i}", out=(8, 4), self=w, dims=(1, 0))
        ys.append(g.call("aten.mm.default", name=f"lin{i}", out=(6, 4), self=flat, mat2=t))
        if form == "edge3":
            ys[-1] = g.call(view, name=f"out{i}", out=(3, 2, 4), self=ys[-1], size=(3, 2, 4))
    extra = [g.call("aten.relu.default", name="r", out=(6, 4), self=ys[0])] if form != "edge3" else []
    if form == "aten":  # lin0 also read by a reshape back
        extra.append(g.call(view, name="back", out=(2, 3, 4), self=ys[0], size=(2, 3, 4)))
    g.output(*ys, *extra)
    return g.build()


@pytest.mark.parametrize("form", ["aten", "edge", "edge3"])
def test_linears_reading_a_reshape_of_the_input_join_there(form: str) -> None:
    report = plan(reshaped(form), [RULE])
    outs = ("out0", "out1") if form == "edge3" else ("lin0", "lin1")
    assert report.rejections == () and [(p.anchor, p.replace) for p in report.plans] == [
        ("xv", ((outs[0], "lin0_part"), (outs[1], "lin1_part")))
    ]


def test_a_matmul_that_is_no_linear_is_no_candidate() -> None:
    g = GraphBuilder(dialect="edge")
    g.output(g.call("aten.mm.default", name="mm", out=(2, 4), self=g.input("a", (2, 8)), mat2=g.input("b", (8, 4))))
    report = plan(g.build(), [RULE])
    assert report.plans == () and report.rejections == ()


def test_group_reasons_in_full() -> None:
    def reasons(g: GraphSnapshot) -> list[Reason]:
        return [r.reason for r in plan(g, [RULE]).rejections]

    def declined(detail: str) -> Declined:
        return Declined(code="too-few-linears", node="x", detail=detail)

    g = GraphBuilder()  # q before k: the reason lists them in the graph's order
    x = g.input("x", (2, 8))
    g.output(
        *(g.call("aten.linear.default", name=n, out=(2, 4), input=x, weight=g.input(f"w{n}", (4, 8))) for n in "qk")
    )
    assert reasons(g.build())[0] == declined(
        "x is read by 2 linears, 0 of which can join (q: not-constant; k: not-constant)"
    )
    edge = parallel(form="edge", flat_user=1, weight_input=0, outs=(6, 4), bias=(True, True))
    assert reasons(edge)[0] == declined(
        "x is read by 2 linears, 0 of which can join (lin0: not-constant; lin1: output-shared)"
    )
    assert reasons(parallel(features="s9")) == [SymbolicShape(node="x", role="input features", shape=(2, 3, "s9"))]


def test_member_reasons_in_full() -> None:
    def reasons(g: GraphSnapshot) -> list[Reason]:
        return [r.reason for r in plan(g, [RULE]).rejections]

    def bias0(shape: tuple[int, ...], dtype: str = "float32") -> GraphSnapshot:
        g = parallel()
        return snapshot(g.nodes, g.constants.set("b0", replace(g.constants["b0"], spec=spec(*shape, dtype=dtype))))

    def malformed(node: str, shapes: str) -> Malformed:
        return Malformed(node=node, detail=f"{node} does not compute a linear: {shapes}")

    assert reasons(parallel(rows={0: 5})) == [
        malformed("lin0", "weight (5, 8), bias (5,), output (2, 3, 6), input (2, 3, 8)")
    ]
    assert reasons(parallel(cols={1: 7})) == [
        malformed("lin1", "weight (4, 7), bias None, output (2, 3, 4), input (2, 3, 8)")
    ]
    assert reasons(bias0((5,))) == [malformed("lin0", "weight (6, 8), bias (5,), output (2, 3, 6), input (2, 3, 8)")]
    for shape in [(1,), (), (3, 1), (2, 3, 6)]:  # torch broadcasts these to the output: a linear, not per feature
        detail = f"lin0: bias {shape} is not one value per output feature (6,)"
        assert reasons(bias0(shape)) == [
            Declined(code="bias-not-per-channel", node="lin0", detail=detail, path="lin.bias")
        ]
    assert reasons(bias0((4, 6)))[0].code == "malformed-node"  # (4, 6) does not broadcast to (2, 3, 6)
    detail = "lin0 computes in float16, float32, its input is float32"
    assert reasons(bias0((6,), "float16")) == [Declined(code="dtype-mismatch", node="lin0", detail=detail)]
    g = GraphBuilder()  # lin0 has a 0-d output
    x = g.input("x", (2, 8))
    outs = (spec(), spec(2, 4), spec(2, 4))
    g.output(
        *(
            g.call("aten.linear.default", name=f"lin{i}", out=o, input=x, weight=g.parameter(f"w{i}", (4, 8)))
            for i, o in enumerate(outs)
        )
    )
    assert reasons(g.build()) == [Malformed(node="lin0", detail="lin0 has no known output or weight shape")]


def test_a_lone_linear_asked_directly_is_no_anchor() -> None:
    g = GraphBuilder()
    g.output(
        g.call(
            "aten.linear.default", name="lin", out=(2, 6), input=g.input("x", (2, 8)), weight=g.parameter("w", (6, 8))
        )
    )
    s = g.build()
    detail = "lin is not an anchor of concat-parallel-linears"
    assert RULE.plan_at(s, s.node("lin")) == Failure(Malformed(node="lin", detail=detail))


def test_one_rule_object_plans_each_snapshot_on_its_own() -> None:
    # the rule keeps what it found on the last snapshot it planned on: each snapshot, and the
    # first one again, gets its own answer, as from a fresh rule
    rule = concat_parallel_linears()
    joins, declined = parallel(), parallel(weight_input=1, outs=(6, 4), bias=(True, True))
    for g in (joins, declined, joins, declined):
        got, fresh = plan(g, [rule]), plan(g, [concat_parallel_linears()])
        assert (got.plans, got.rejections, got.after) == (fresh.plans, fresh.rejections, fresh.after)
    assert [r.reason.code for r in plan(declined, [rule]).rejections] == ["too-few-linears", "not-constant"]
    assert len(plan(joins, [rule]).plans) == 1


def test_the_rule_keeps_no_snapshot_alive() -> None:
    rule, g = concat_parallel_linears(), parallel()
    assert len(plan(g, [rule]).plans) == 1
    alive = weakref.ref(g)
    del g
    gc.collect()
    assert alive() is None


def test_each_linear_is_matched_once_on_a_snapshot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # as a linear that can join, which also says which input it reads: once, for anchors and every
    # plan_at; a linear that cannot join (lin1: its weight is computed) once more, for its input
    calls: list[str] = []

    def counted(pattern: Root, snap: GraphSnapshot, node: NodeSnapshot) -> Result[Match, Reason]:
        calls.append(node.name)
        return match(pattern, snap, node)

    module = importlib.import_module("fxpure.rules.concat_parallel_linears")  # (fxpure.rules exports the rule
    # function under the same name) and each as a member once: what anchors found, plan_at reuses
    joined: list[str] = []
    join = module._join

    def counted_join(node: NodeSnapshot, joins: Result[Match, Reason], x: TensorSpec) -> object:
        joined.append(node.name)
        return join(node, joins, x)

    monkeypatch.setattr(module, "match", counted)
    monkeypatch.setattr(module, "_join", counted_join)
    # (one run: a second, on the joined snapshot, matches again there)
    g = parallel(weight_input=1, outs=(6, 4, 4, 2), bias=(True, True, True, False))
    rule = replace(concat_parallel_linears(), repeat=False)
    report = plan(g, [rule])
    assert len(report.plans) == 1 and [r.node for r in report.rejections] == ["lin1"]
    for node in ("x", "lin0", "lin1"):
        rule.plan_at(g, g.node(node))
    assert sorted(calls) == ["lin0", "lin1", "lin1", "lin2", "lin3"]
    assert sorted(joined) == ["lin0", "lin1", "lin2", "lin3"]


def test_a_linear_of_an_input_without_static_features_points_at_the_input() -> None:
    g = parallel(features="s9")
    assert [r.node for r in plan(g, [RULE]).rejections] == ["x"]  # rejected once, for the whole group
    detail = "lin0 joins the linears of x there"
    assert RULE.plan_at(g, g.node("lin0")) == Failure(Malformed(node="lin0", detail=detail))


def test_one_rule_object_in_two_threads_answers_each_for_its_own_snapshot() -> None:
    # two threads share the rule and replace what it keeps in turn: neither may read the other's
    rule = concat_parallel_linears()
    graphs = [parallel(), parallel(weight_input=1, outs=(6, 4), bias=(True, True))]
    want = [concat_parallel_linears().plan_at(g, g.node("x")) for g in graphs]
    wrong: list[int] = []

    def ask(i: int) -> None:
        for _ in range(10000):
            if rule.plan_at(graphs[i], graphs[i].node("x")) != want[i]:
                wrong.append(i)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert wrong == []


def test_what_the_rule_found_goes_with_its_snapshot() -> None:
    rule, g = concat_parallel_linears(), parallel()
    report = plan(g, [rule])
    assert len(report.plans) == 1
    assert len(rule._last) == 1  # what anchors and plan_at read (private: nothing public shows it)
    del g, report
    gc.collect()
    assert rule._last == []


def test_linears_no_other_can_share_an_input_with_leave_the_rest_to_join() -> None:
    # a lone linear first (its input read by no other product), then a product of a literal (hand-made),
    # then the three of x: the three join
    g = GraphBuilder()
    y, x = g.input("y", (2, 8)), g.input("x", (2, 8))
    lone = g.call("aten.linear.default", name="lone", out=(2, 4), input=y, weight=g.parameter("wl", (4, 8)))
    lit = g.node("aten.linear.default", (2.0, g.parameter("wt", (4, 8))), name="lit", out=(2, 4))
    outs = [
        g.call("aten.linear.default", name=f"lin{i}", out=(2, 4), input=x, weight=g.parameter(f"w{i}", (4, 8)))
        for i in range(3)
    ]
    g.output(lone, lit, *outs)
    report = plan(g.build(), [concat_parallel_linears()])
    assert [p.anchor for p in report.plans] == ["x"] and report.rejections == ()


Chain = tuple[str, tuple[int, ...], int]  # what a linear reads: a view of this source, these sizes, this deep
VIEWED: tuple[Chain, ...] = (("h", (2, 3, 8), 1),) * 3


def viewed(chains: Sequence[Chain] = VIEWED) -> GraphSnapshot:
    """Edge linears each reading its own chain of views of a value (``to_edge`` writes them so for a
    value the model wrote in place): linear i reads ``depth`` view_copys of ``source`` (``h`` or
    ``h2``, relus of x; ``rand0``, ``rand1``..., random tensors like h) as ``sizes``, the last named
    ``v{i}``; flattened, an mm, and back (rank 3), or an mm (rank 2)."""
    g = GraphBuilder(dialect="edge")
    x = g.input("x", (2, 3, 8))
    sources: dict[str, NodeRef] = {}
    outs = []
    for i, (source, sizes, depth) in enumerate(chains):
        if source not in sources and source.startswith("h"):
            sources[source] = g.call("aten.relu.default", name=source, out=(2, 3, 8), self=x)
        elif source not in sources:
            sources[source] = g.node("aten.rand_like.default", (x,), name=source, out=(2, 3, 8))
        v = sources[source]
        for d in range(depth):
            v = g.call(
                "aten.view_copy.default", name=f"v{i}" if d == depth - 1 else None, out=sizes, self=v, size=sizes
            )
        flat = (
            g.call("aten.view_copy.default", name=f"flat{i}", out=(6, 8), self=v, size=(6, 8)) if len(sizes) == 3 else v
        )
        w = g.parameter(f"w{i}", (4, 8))
        t = g.call("aten.permute_copy.default", name=f"t{i}", out=(8, 4), self=w, dims=(1, 0))
        mm = g.call("aten.mm.default", name=f"lin{i}", out=(6, 4), self=flat, mat2=t)
        back = (*sizes[:-1], 4)
        outs.append(
            g.call("aten.view_copy.default", name=f"out{i}", out=back, self=mm, size=back) if len(sizes) == 3 else mm
        )
    g.output(*outs)
    return g.build()


def test_linears_reading_equal_views_of_one_value_join_and_the_other_views_go() -> None:
    report = plan(viewed(), [RULE])
    assert report.rejections == () and [(p.anchor, p.replace) for p in report.plans] == [
        ("v0", (("out0", "lin0_part"), ("out1", "lin1_part"), ("out2", "lin2_part")))
    ]
    after = verify(report.after).unwrap()
    assert {"v1", "v2", "flat1", "flat2"}.isdisjoint(after.index) and {"h", "v0"} <= set(after.index)
    assert all(after.users[n.name] for n in after.nodes if n.op == "call_function")  # nothing dead


def test_views_of_a_written_value_are_no_equal_values() -> None:
    # the program writes h (in an aten program, views share its storage): each view is its own value
    two = VIEWED[:2]
    for written in ({"h"}, {"v1"}):
        snap = replace(viewed(two), written=frozenset(written))
        assert plan(snap, [RULE]).plans == ()
    assert len(plan(replace(viewed(two), written=frozenset({"x"})), [RULE]).plans) == 1


def test_views_of_other_values_or_to_other_sizes_are_other_values() -> None:
    # views of h and h2, of two random tensors (each its own value, however it is computed), and
    # to other sizes with the same features: the linears read other inputs
    for chains in (
        (("h", (2, 3, 8), 1), ("h2", (2, 3, 8), 1)),
        (("rand0", (2, 3, 8), 1), ("rand1", (2, 3, 8), 1)),
        (("h", (2, 3, 8), 1), ("h", (6, 8), 1)),
    ):
        report = plan(viewed(chains), [RULE])
        assert report.plans == () and report.rejections == (), chains


@pytest.mark.parametrize("depth", [2, 3, 2000])
def test_views_of_views_join_however_deep_and_each_chain_goes_whole(depth: int) -> None:
    # (2,000 views deep: no recursion)
    report = plan(viewed((("h", (2, 3, 8), depth),) * 2), [RULE])
    assert len(report.plans) == 1 and report.rejections == ()
    after = verify(report.after).unwrap()
    assert all(after.users[n.name] for n in after.nodes if n.op == "call_function")


@pytest.mark.parametrize("malformed", [False, True])
def test_a_product_of_two_activations_beside_linears_of_its_input_is_no_member(malformed: bool) -> None:
    # mm(x, y): no linear, where a weight stored (in, out) would be one (x @ W); nor is mm(x, t()) of
    # a malformed transpose (found by the fuzz: it was declined wrong-op, no code of the rule's)
    g = GraphBuilder()
    x, y = g.input("x", (2, 8)), g.input("y", (8, 4))
    w1, w2, w3 = g.parameter("w1", (6, 8)), g.parameter("w2", (4, 8)), g.parameter("w3", (8, 5))
    a = g.call("aten.linear.default", name="a", input=x, weight=w1, out=(2, 6))
    b = g.call("aten.linear.default", name="b", input=x, weight=w2, out=(2, 4))
    other = g.node("aten.t.default", (), name="t", out=(8, 4)) if malformed else y
    c = g.call("aten.mm.default", name="c", self=x, mat2=other, out=(2, 4))
    d = g.call("aten.mm.default", name="d", self=x, mat2=w3, out=(2, 5))  # x @ W: a member
    g.output(a, b, c, d)
    report = plan(g.build(), [RULE])
    assert report.rejections == () and [len(p.replace) for p in report.plans] == [3]


QARGS: dict[str, Arg] = {"zero_point": 0, "quant_min": -128, "quant_max": 127, "dtype": "int8"}


def quantize(g: GraphBuilder, x: NodeRef, shape: tuple[int, ...], name: str) -> NodeRef:
    """``x`` quantized per tensor to int8 (scale 0.1)."""
    out = spec(*shape, dtype="int8")
    return g.call("quantized_decomposed.quantize_per_tensor.default", name=name, out=out, input=x, scale=0.1, **QARGS)


def dequantize(g: GraphBuilder, q: NodeRef, shape: tuple[int, ...], name: str, scale: float = 0.1) -> NodeRef:
    """``q`` dequantized per tensor (int8, ``scale``)."""
    target = "quantized_decomposed.dequantize_per_tensor.default"
    return g.call(target, name=name, out=shape, input=q, scale=scale, **QARGS)


def dequantized(*, scales: Sequence[float] = (0.1, 0.1, 0.1), int_weights: bool = False) -> GraphSnapshot:
    """PT2E's parallel linears (edge): x quantized once and dequantized once per linear, each
    dequantize a node of its own (``scales``: their scales); each weight a float parameter, or
    (``int_weights``) an int8 one dequantized per channel."""
    g = GraphBuilder(dialect="edge")
    x = g.input("x", (2, 8))
    q = quantize(g, x, (2, 8), "q")
    outs = []
    for i, s in enumerate(scales):
        dq = dequantize(g, q, (2, 8), f"dq{i}", s)
        if int_weights:
            w = g.call(
                "quantized_decomposed.dequantize_per_channel.default",
                name=f"dqw{i}",
                out=(4, 8),
                input=g.parameter(f"wq{i}", (4, 8), "int8"),
                scale=g.parameter(f"ws{i}", (4,)),
                zero_point=g.parameter(f"wz{i}", (4,), "int64"),
                axis=0,
                quant_min=-127,
                quant_max=127,
                dtype="int8",
            )
        else:
            w = g.parameter(f"w{i}", (4, 8))
        t = g.call("aten.permute_copy.default", name=f"t{i}", out=(8, 4), self=w, dims=(1, 0))
        outs.append(g.call("aten.mm.default", name=f"lin{i}", out=(2, 4), self=dq, mat2=t))
    g.output(*outs)
    return g.build()


def test_linears_each_reading_its_own_dequantize_of_one_value_join() -> None:
    # PT2E gives each linear its own dequantize of x: equal ones are one input (the linears were no
    # candidates, neither joined nor reported); the joined linear reads the first, the others go
    report = plan(dequantized(), [RULE])
    assert report.rejections == () and [p.anchor for p in report.plans] == ["dq0"]
    after = verify(report.after).unwrap()
    assert {"dq1", "dq2"}.isdisjoint(after.index) and {"q", "dq0"} <= set(after.index)
    # dequantizes of other parameters compute other values: no group
    other = plan(dequantized(scales=(0.1, 0.2, 0.3)), [RULE])
    assert other.plans == () and other.rejections == ()


def test_linears_of_dequantized_weights_are_reported_not_joined_into_float_weights() -> None:
    # a dequantized int8 weight is computed at run time: each linear is declined (joined, the int8
    # weights would have become one float one, four times their size), and so is the group
    report = plan(dequantized(int_weights=True), [RULE])
    assert report.plans == ()
    assert sorted((r.node, r.reason.code) for r in report.rejections) == [
        ("dq0", "too-few-linears"),
        ("lin0", "not-constant"),
        ("lin1", "not-constant"),
        ("lin2", "not-constant"),
    ]


def cloned(formats: Sequence[str | None] = (None, None), written: frozenset[str] = frozenset()) -> GraphSnapshot:
    """aten linears each reading its own clone of x (``formats``: each clone's memory format)."""
    g = GraphBuilder()
    x = g.input("x", (2, 8))
    outs = []
    for i, fmt in enumerate(formats):
        kwargs: dict[str, Arg] = {} if fmt is None else {"memory_format": fmt}
        c = g.call("aten.clone.default", name=f"c{i}", out=(2, 8), self=x, **kwargs)
        outs.append(
            g.call("aten.linear.default", name=f"lin{i}", out=(2, 4), input=c, weight=g.parameter(f"w{i}", (4, 8)))
        )
    g.output(*outs)
    return replace(g.build(), written=written)


def test_linears_each_reading_its_own_copy_of_one_value_join() -> None:
    # decompositions and to_edge copy a non-contiguous rank 4 input once per linear (expand, clone,
    # view, bmm): equal copies of one value are one input, unless the program writes it or a copy
    report = plan(cloned(), [RULE])
    assert report.rejections == () and [p.anchor for p in report.plans] == ["c0"]
    assert "c1" not in verify(report.after).unwrap().index
    for snap in (
        cloned(written=frozenset({"x"})),
        cloned(written=frozenset({"c1"})),
        cloned((None, "preserve_format")),
    ):
        assert plan(snap, [RULE]).plans == ()


@pytest.mark.parametrize("reader", ["view", "dequantize"])
def test_views_or_dequantizes_of_a_shared_view_of_a_written_value_are_no_equal_values(reader: str) -> None:
    # found by a review: h.view(...) twice of one view hv of h, h written in place between them (the
    # program records the write at h): the two were one input, and the later linear read h before
    # the write; likewise two dequantizes of a view of a quantized value written between them
    def graph(written: frozenset[str]) -> GraphSnapshot:
        g = GraphBuilder(dialect="aten")
        x = g.input("x", (3, 8))
        view = reader == "view"
        h = g.call("aten.relu.default", name="h", out=(3, 8), self=x) if view else quantize(g, x, (3, 8), "h")
        hv = g.call(
            "aten.view.default", name="hv", out=spec(3, 8, dtype="float32" if view else "int8"), self=h, size=(3, 8)
        )
        outs = []
        for i in range(2):
            if view:
                r = g.call("aten.view.default", name=f"r{i}", out=(3, 8), self=hv, size=(-1, 8))
            else:
                r = dequantize(g, hv, (3, 8), f"r{i}")
            outs.append(
                g.call("aten.linear.default", name=f"lin{i}", out=(3, 4), input=r, weight=g.parameter(f"w{i}", (4, 8)))
            )
        g.output(*outs)
        return replace(g.build(), written=written)

    assert [p.anchor for p in plan(graph(frozenset()), [RULE]).plans] == ["r0"]
    for written in ({"h"}, {"hv"}):
        report = plan(graph(frozenset(written)), [RULE])
        assert report.plans == () and report.rejections == (), written


def scaled(alphas: Sequence[int], rank3: bool) -> GraphSnapshot:
    """x -> edge addmm(b_i, x, W_i.T, alpha=alphas[i]) for each i (rank 3: inside view_copy reshapes)."""
    g = GraphBuilder(dialect="edge")
    x = g.input("x", (2, 3, 8) if rank3 else (2, 8))
    outs = []
    for i, a in enumerate(alphas):
        w, b = g.parameter(f"w{i}", (4, 8)), g.parameter(f"b{i}", (4,))
        t = g.call("aten.permute_copy.default", name=f"t{i}", out=(8, 4), self=w, dims=(1, 0))
        mat = g.call("aten.view_copy.default", name=f"flat{i}", out=(6, 8), self=x, size=(6, 8)) if rank3 else x
        scale: dict[str, Arg] = {} if a == 1 else {"alpha": a}
        y = g.call("aten.addmm.default", name=f"lin{i}", out=(6 if rank3 else 2, 4), self=b, mat1=mat, mat2=t, **scale)
        if rank3:
            y = g.call("aten.view_copy.default", name=f"out{i}", out=(2, 3, 4), self=y, size=(2, 3, 4))
        outs.append(y)
    g.output(*outs)
    return g.build()


@pytest.mark.parametrize("rank3", [False, True])
@pytest.mark.parametrize(
    ("alphas", "joined", "group"),
    [
        ((2, 2), [], "x is read by 2 linears, 0 of which can join (lin0: arg-mismatch; lin1: arg-mismatch)"),
        ((1, 2), [], "x is read by 2 linears, 1 of which can join (lin1: arg-mismatch)"),
        ((1, 2, 1), ["x"], None),
    ],
)
def test_an_addmm_scaled_by_alpha_is_a_linear_of_its_input_that_cannot_join(
    alphas: tuple[int, ...], joined: list[str], group: str | None, rank3: bool
) -> None:
    # an addmm whose alpha is not 1 matches no linear pattern: it still reads x, and says why it cannot join
    report = plan(scaled(alphas, rank3), [RULE])
    assert [p.anchor for p in report.plans] == joined
    members = [
        ("arg-mismatch", f"lin{i}", "lin.alpha", f"alpha of lin{i} is 2, expected 1 or 1.0")
        for i, a in enumerate(alphas)
        if a != 1
    ]
    too_few = [("too-few-linears", "x", "", group)] if group is not None else []
    assert [(r.reason.code, r.node, r.reason.path, r.reason.message) for r in report.rejections] == [*too_few, *members]

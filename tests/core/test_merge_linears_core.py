"""The outside author's ``merge-linears`` rule (``tests/merge_linears.py``) planned on hand-built
snapshots, torch-free: the merged weight and bias as expressions, each bias case, and its declines."""

from __future__ import annotations

import json

import pytest

from fxpure import NodeRef, plan
from fxpure.serial import to_data
from fxpure.testing import GraphBuilder, spec
from fxpure.weights import Binary, Cast, MatMul, Source, WeightExpr, infer_spec
from tests.merge_linears import GROWS, merge_linears


def _chain(inner_bias: bool, outer_bias: bool, dtype: str = "float32", hidden: int = 16) -> GraphBuilder:
    g = GraphBuilder()
    x, w1, w2 = (
        g.input("x", (2, 8), dtype),
        g.parameter("w1", (hidden, 8), dtype),
        g.parameter("w2", (4, hidden), dtype),
    )
    b1 = g.parameter("b1", (hidden,), dtype) if inner_bias else None
    b2 = g.parameter("b2", (4,), dtype) if outer_bias else None
    h = g.call("aten.linear.default", name="fc1", input=x, weight=w1, bias=b1, out=spec(2, hidden, dtype=dtype))
    g.output(g.call("aten.linear.default", name="fc2", input=h, weight=w2, bias=b2, out=spec(2, 4, dtype=dtype)))
    return g


def _source(g: GraphBuilder, key: str) -> Source:
    return Source(key=key, spec=g.build().constants[key].spec)


@pytest.mark.parametrize(("inner_bias", "outer_bias"), [(False, False), (True, False), (False, True), (True, True)])
def test_two_linears_are_planned_as_one_of_the_product_of_their_weights(inner_bias: bool, outer_bias: bool) -> None:
    g = _chain(inner_bias, outer_bias)
    report = plan(g.build(), [merge_linears])
    (p,) = report.plans
    assert not report.rejections  # fc1 reads an input, no linear: no candidate, nothing to report
    w1, w2 = _source(g, "w1"), _source(g, "w2")
    want: dict[str, WeightExpr] = {"fc2_merged_weight": MatMul(a=w2, b=w1)}
    if inner_bias:  # W2 @ b1 (+ b2)
        through = MatMul(a=w2, b=_source(g, "b1"))
        want["fc2_merged_bias"] = Binary(op="add", a=through, b=_source(g, "b2")) if outer_bias else through
    assert {c.name: c.expr for c in p.constants} == want
    assert [infer_spec(c.expr).unwrap().shape for c in p.constants] == [(4, 8), (4,)][: len(want)]
    bias = NodeRef("fc2_merged_bias") if inner_bias else NodeRef("b2") if outer_bias else None  # b2 as it is
    (new,) = p.nodes
    assert new.args == (NodeRef("x"), NodeRef("fc2_merged_weight"), *([bias] if bias else [])) and new.spec == spec(
        2, 4
    )
    assert set(p.erase) == {"fc1", "fc2"}
    # the plan as JSON (--json, golden files): the product a record like the others
    (weight,) = (c for c in json.loads(json.dumps(to_data(p)))["constants"] if c["name"] == "fc2_merged_weight")
    assert weight["expr"] == {"type": "MatMul", "a": to_data(w2), "b": to_data(w1)}


def test_a_float16_product_is_accumulated_in_float32_and_rounded_once() -> None:
    g = _chain(True, False, "float16")
    (p,) = plan(g.build(), [merge_linears]).plans
    w1, w2, b1 = (Cast(x=_source(g, k), dtype="float32") for k in ("w1", "w2", "b1"))
    exprs = {c.name: c.expr for c in p.constants}
    assert exprs == {
        "fc2_merged_weight": Cast(x=MatMul(a=w2, b=w1), dtype="float16"),
        "fc2_merged_bias": Cast(x=MatMul(a=w2, b=b1), dtype="float16"),
    }


def test_a_shared_inner_linear_and_a_bottleneck_are_declined() -> None:
    shared = _chain(False, False)
    fc1 = shared.build().node("fc1")
    shared.output(NodeRef("fc2"), NodeRef(fc1.name))  # fc1's output read twice
    narrow = _chain(False, False, hidden=2)  # 8 -> 2 -> 4: 32 weights merged, 24 as two
    for g, code in ((shared, "output-shared"), (narrow, GROWS)):
        report = plan(g.build(), [merge_linears])
        assert not report.plans
        assert {(j.node, j.reason.code) for j in report.rejections} == {("fc2", code)}


def test_a_chain_with_a_weight_computed_at_run_time_is_declined_saying_which() -> None:
    # a candidate is a linear of a linear whatever its weights: one the program computes is
    # declined not-constant at its place in the pattern, not skipped unreported
    for computed in ("w1", "w2"):
        g = GraphBuilder()
        x = g.input("x", (2, 8))
        w = {
            k: (g.input if k == computed else g.parameter)(k, shape) for k, shape in (("w1", (16, 8)), ("w2", (4, 16)))
        }
        h = g.call("aten.linear.default", name="fc1", input=x, weight=w["w1"], out=(2, 16))
        g.output(g.call("aten.linear.default", name="fc2", input=h, weight=w["w2"], out=(2, 4)))
        (no,) = plan(g.build(), [merge_linears]).rejections
        assert (no.node, no.reason.code) == ("fc2", "not-constant") and computed in no.reason.message

"""Tests that kill mutants `make mutate` found alive (MUTATION.md): the full reason records of the
``need.*`` checks, patterns and checks built while a test runs (mutmut swaps a function's body in
at call time, so a rule built at import is always the original one), ``explain``/``attempts``,
and the exact plans of the rules where their other tests only check the graph they lead to."""

from __future__ import annotations

import gc
import re
from dataclasses import replace
from functools import partial
from types import MappingProxyType
from typing import Any

import pytest
from pyrsistent import pmap
from returns.result import Failure, Result, Success

from fxpure import plan, snapshot, verify
from fxpure.families import ADD, ADDMM, BATCH_NORM, CONV, DEQUANTIZE, MM, MUL, RELU, TRANSPOSE
from fxpure.pattern import (
    ANY,
    ONE,
    Bound,
    Check,
    Const,
    Lit,
    Match,
    OneOf,
    Op,
    PatternError,
    Planner,
    Scalar,
    Site,
    Var,
    attempts,
    dequantized,
    explain,
    match,
    need,
    rule,
)
from fxpure.plan import MAX_RUNS, NewConstant, NewNode, RewritePlan, constant_operand, rewrite
from fxpure.reasons import (
    GENERIC_CODES,
    BindingConflict,
    ChannelMismatch,
    Declined,
    Malformed,
    NotConstant,
    NotScalar,
    Reason,
    SymbolicShape,
    TupleUsed,
    UnsupportedDtype,
    UnsupportedRank,
    WrongOp,
)
from fxpure.rules import (
    concat_parallel_linears,
    conv1d_to_conv2d,
    fuse_conv_bn,
    linear_to_conv2d,
    quantized_conv,
    split_group_conv,
)
from fxpure.snapshot import Arg, DTypeArg, GraphSnapshot, NodeRef, NodeSnapshot
from fxpure.testing import GraphBuilder, spec
from fxpure.weights import Binary, Cast, Dequantize, Fill, Permute, Source, Unsqueeze, WeightExpr
from tests.core.build import conv_bn, grouped_conv, qconv
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
    seen: list[tuple[tuple[int | float, ...] | None, ...]] = []

    def look(match: Match) -> Reason | None:
        seen.append((match.values("b"), match.values("w"), match.values("x"), match.values("nothing")))
        return None

    assert why(conv_relu(bias_values=(1, 2, 3, 4)), need.check(look, codes=["x"])) is None
    assert seen == [((1, 2, 3, 4), None, None, None)]
    # a Var bound to the constant's node reads it too (it was None: an outside author's zero
    # points, bound so, declined every program "unknown")
    snap = conv_relu(bias_values=(1, 2, 3, 4))
    m = match(Op(CONV, name="conv", input=Var("x"), bias=Var("b")), snap, snap.node("conv")).unwrap()
    assert (m.values("b"), m.values("x")) == ((1, 2, 3, 4), None)


@pytest.mark.parametrize(
    ("held", "dtype", "want"),
    [
        ((1.0,), "float16", (1.0,)),
        ((0.1,), "float16", (0.0999755859375,)),  # as the cast rounds it
        ((0.1,), "float64", (0.1,)),
        ((0.1,), "float32", (0.10000000149011612,)),
        ((3,), "float16", (3.0,)),  # an integer number cast to a float
        ((1.0,), "bfloat16", None),
        ((1.0, 2.0), "float16", None),  # more than one number
        (None, "float16", None),  # no data captured
    ],
)
def test_match_values_reads_a_number_the_program_casts(
    held: tuple[float, ...] | None, dtype: str, want: tuple[float, ...] | None
) -> None:
    # a float16 edge program's x * 1.0 lifts a float32 1.0 and casts it (found by an outside author)
    g = GraphBuilder(dialect="edge")
    x = g.input("x", (2,), dtype=dtype)
    shape = (len(held),) if held is not None and len(held) > 1 else ()
    k = g.constant("k", shape, values=held)
    cast = g.call(
        "dim_order_ops._to_dim_order_copy.default", name="cast", self=k, dtype=dtype, out=spec(*shape, dtype=dtype)
    )
    g.output(g.call("aten.mul.Tensor", name="mul", self=x, other=cast, out=spec(2, dtype=dtype)))
    snap = g.build()
    m = match(Op(MUL, self=Var("x"), other=Const("k")), snap, snap.node("mul")).unwrap()
    assert isinstance(m.bindings["k"], Cast) and m.values("k") == want
    assert m.values("x") is None and m.values("absent") is None


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

    r = rule("t", CONV_RELU, plan=refuse, codes=["mine"])
    snap = conv_relu()
    assert r.plan_at(snap, snap.node("relu")).failure() == replace(own, path="plan")  # placed at the plan
    own = replace(own, path="conv.weight")  # unless it says where
    assert r.plan_at(snap, snap.node("relu")).failure() == own
    assert "mine" in r.codes and r.plan_codes == {"mine"}
    # a code the rule does not list is a bug in the rule (rule.codes lists every code), as a check's
    with pytest.raises(TypeError, match=re.escape("planner refuse declined with 'mine', which it does not declare")):
        rule("u", CONV_RELU, plan=refuse, codes=["other"]).plan_at(snap, snap.node("relu"))


class HandWritten:
    """A rule written by hand (no pattern): declines at the relu, plans (nothing) elsewhere."""

    name = "hand"

    def anchors(self, snap: GraphSnapshot) -> list[NodeSnapshot]:
        return [n for n in snap.nodes if n.op == "call_function"]

    def plan_at(self, snap: GraphSnapshot, node: NodeSnapshot) -> Result[RewritePlan, Reason]:
        if node.name == "relu":
            return Failure(Malformed(node=node.name, detail=f"hand-written, {snap.dialect}"))
        return Success(RewritePlan(rule=self.name, anchor=node.name))


class SeesTheCollector:
    """A hand-written rule that records whether the cyclic collector ran while it planned, and can fail."""

    name = "sees-gc"

    def __init__(self, fail: bool = False) -> None:
        self.seen: list[bool] = []
        self.fail = fail

    def anchors(self, snap: GraphSnapshot) -> list[NodeSnapshot]:
        return [n for n in snap.nodes if n.op == "call_function"]

    def plan_at(self, snap: GraphSnapshot, node: NodeSnapshot) -> Result[RewritePlan, Reason]:
        self.seen.append(gc.isenabled())
        if self.fail:
            raise RuntimeError("a rule's bug")
        return Success(RewritePlan(rule=self.name, anchor=node.name))


def test_plan_pauses_the_cyclic_collector_and_restores_it_as_it_was() -> None:
    snap = conv_relu()
    assert gc.isenabled()
    seer = SeesTheCollector()
    plan(snap, [seer])
    assert seer.seen == [False, False] and gc.isenabled()
    failing = SeesTheCollector(fail=True)
    with pytest.raises(RuntimeError, match="a rule's bug"):
        plan(snap, [failing])
    assert failing.seen == [False] and gc.isenabled()  # restored on an error too
    gc.disable()
    try:
        plan(snap, [seer])  # paused by the caller: left paused
        assert not gc.isenabled()
    finally:
        gc.enable()


class Holds:
    """A hand-written rule that keeps what it made while it planned (a container the collector tracks)."""

    name = "holds"

    def __init__(self) -> None:
        self.made: list[list[int]] = []

    def anchors(self, snap: GraphSnapshot) -> list[NodeSnapshot]:
        return [n for n in snap.nodes if n.op == "call_function"]

    def plan_at(self, snap: GraphSnapshot, node: NodeSnapshot) -> Result[RewritePlan, Reason]:
        self.made.extend([i] for i in range(2000))
        return Success(RewritePlan(rule=self.name, anchor=node.name))


def test_plan_moves_what_it_made_to_the_oldest_generation_unscanned() -> None:
    gc.collect()
    holds = Holds()
    plan(conv_relu(), [holds])
    # no young collection waits to scan the 4,000 lists: they are in the oldest generation
    assert gc.get_count()[0] < 1000
    oldest = {id(o) for o in gc.get_objects(generation=2)}
    assert id(holds.made[0]) in oldest and id(holds.made[-1]) in oldest
    gc.freeze()  # a process that froze objects (before a fork, say): they stay frozen
    try:
        frozen = gc.get_freeze_count()
        plan(conv_relu(), [Holds()])
        # none unfrozen (an unfreeze would leave 0) and none added; a frozen object that dies
        # meanwhile leaves the permanent generation, so the count may fall (it did under mutmut)
        assert 0 < gc.get_freeze_count() <= frozen and gc.isenabled()
    finally:
        gc.unfreeze()


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
    # a candidate the pattern itself declines shows how far the pattern got, not what an adapter said
    declined = plan(snap, rules, declined={("conv-f16", "conv"): no})
    assert declined.rejections[-1].reason == no
    assert attempts(declined, rules, "conv")[0].reason == conv.reason


def _not_mine(relu: Bound) -> Reason | None:
    if relu.name == "b" or relu.name.endswith("_again"):
        return Declined(code="no", node=relu.name, detail="not this one")
    return None


def _again(p: Planner, relu: Bound) -> RewritePlan:
    return p.replace(relu, p.respell(relu, name=f"{relu.name}_again"))


def two_relus() -> GraphSnapshot:
    g = GraphBuilder()
    x = g.input("x", (2, 4))
    g.output(
        g.call("aten.relu.default", name="a", self=x, out=(2, 4)),
        g.call("aten.relu.default", name="b", self=x, out=(2, 4)),
    )
    return g.build()


def test_a_rule_with_repeat_runs_again_while_it_plans_and_reports_each_candidate_once() -> None:
    again = rule("again", Op(RELU, name="relu"), need.check(_not_mine, codes=["no"]), plan=_again, repeat=True)
    report = plan(two_relus(), [again])
    # run 1 re-spells a and declines b; run 2 declines b again and a_again (its own node): neither is
    # listed again; it planned nothing, so it stops
    assert [[p.anchor for p in s] for s in report.stages] == [["a"], []]
    assert [(r.node, r.reason.code) for r in report.rejections] == [("b", "no")]
    assert [(a.anchor, a.reason is None) for a in attempts(report, [again], "a")] == [("a", True), ("a_again", False)]
    assert [a.anchor for a in attempts(report, [again], "b")] == ["b"]  # the same attempt, once
    # a rule that always plans again stops after MAX_RUNS runs
    loop = rule("loop", Op(RELU, name="relu"), plan=_again, repeat=True)
    looped = plan(two_relus(), [loop])
    assert len(looped.stages) == MAX_RUNS and all(len(s) == 2 for s in looped.stages)
    assert looped.rejections == ()  # what it would plan next is its own nodes': nothing to report
    assert (
        "runs-exhausted" in loop.codes
        and "runs-exhausted" not in rule("once", Op(RELU, name="relu"), plan=_again).codes
    )
    assert len(attempts(looped, [loop, again], "a")) == MAX_RUNS + 1  # each run's, then the next rule's
    assert len(plan(two_relus(), [replace(loop, repeat=False)]).stages) == 1


def test_a_rule_with_repeat_rewrites_a_candidate_once() -> None:
    # an insertion keeps its anchor: run again, it was planned again in every run (eight sigmoids
    # after each relu, reported as sixteen plans, no rejection; an outside author's rule)
    def after_it(p: Planner, relu: Bound) -> RewritePlan:
        return p.replace(relu, p.call("aten.sigmoid.default", name="s", spec=relu.spec, self=NodeRef(relu.name)))

    report = plan(two_relus(), [rule("insert", Op(RELU, name="relu"), plan=after_it, repeat=True)])
    assert [[p.anchor for p in s] for s in report.stages] == [["a", "b"], []] and report.rejections == ()
    assert [n.target for n in report.after.nodes].count("aten.sigmoid.default") == 2


def test_a_later_stage_is_asked_about_the_node_an_earlier_one_made() -> None:
    # a depthwise conv and its batch norm: fused first, then the fused conv (made from "conv") is
    # declined by the split rule, which never sees "conv" itself
    g = GraphBuilder()
    x, w = g.input("x", (1, 4, 8, 8)), g.parameter("w", (4, 1, 3, 3))
    conv = g.call("aten.conv2d.default", name="conv", input=x, weight=w, groups=4, out=(1, 4, 6, 6))
    stats = {k: g.parameter(k, (4,)) for k in ("mean", "var")}
    bn = g.call(
        "aten.batch_norm.default",
        name="bn",
        input=conv,
        weight=None,
        bias=None,
        running_mean=stats["mean"],
        running_var=stats["var"],
        training=False,
        momentum=0.1,
        eps=1e-5,
        cudnn_enabled=False,
        out=(1, 4, 6, 6),
    )
    g.output(bn)
    rules = [fuse_conv_bn(), split_group_conv()]
    report = plan(g.build(), rules)
    fused = next(n.name for n in report.after.nodes if n.provenance == "conv")
    assert [(a.rule, a.anchor) for a in attempts(report, rules, "conv")] == [("split-group-conv", fused)]
    (split,) = attempts(report, rules, "conv")
    assert split.reason is not None and split.reason.code == "depthwise-conv"
    assert [a.rule for a in attempts(report, rules, fused)] == ["split-group-conv"]  # by its own name too


def _never(relu: Bound) -> Reason | None:
    return Declined(code="no", node=relu.name, detail="never")


def test_attempts_of_two_rules_at_one_node_keep_their_own_reasons() -> None:
    never = rule("never", Op(RELU, name="relu"), need.check(_never, codes=["no"]), plan=_keep)
    report = plan(conv_relu(), [never, SECOND])
    no = Declined(code="no", node="relu", detail="never", path="relu")
    # the second rule matches, and its plan (erasing a relu the output reads) fails after matching
    first, second = attempts(report, [never, SECOND], "relu")
    assert (first.rule, first.reason) == ("never", no)
    assert second.rule == "second" and second.reason is not None
    assert (second.reason.code, second.reason.message) == ("plan-conflict", "relu: erased but still read by output")
    # fewer rules than the report's stages: the attempts of those rules
    assert [a.rule for a in attempts(report, [never], "relu")] == ["never"]


def _fold(p: Planner, add: Bound, a: WeightExpr, b: WeightExpr) -> RewritePlan:
    return p.replace(add, p.const(Binary(op="add", a=a, b=b), f"{add.name}_folded"))


FOLD = rule("fold", Op(ADD, name="add", self=Const("a"), other=Const("b")), plan=_fold)


def test_attempts_keep_a_reason_a_later_stage_of_the_rule_made_moot() -> None:
    # add2 reads add1: the first stage folds add1 and declines add2 (not a constant yet), the second
    # stage folds add2; the report drops the first reason, the attempts still show it
    g = GraphBuilder()
    c1, c2, c3 = (g.parameter(f"c{i}", (4,)) for i in (1, 2, 3))
    add2 = g.call(
        "aten.add.Tensor", name="add2", self=g.call("aten.add.Tensor", name="add1", self=c1, other=c2), other=c3
    )
    g.output(g.call("aten.relu.default", self=add2))  # (a constant the program returned would stay computed)
    report = plan(g.build(), [FOLD, FOLD])
    assert [p.anchor for p in report.plans] == ["add1", "add2"] and report.rejections == ()
    first, second = attempts(report, [FOLD, FOLD], "add2")
    assert first.reason == NotConstant(node="add2", role="self", source="add1", path="add.self")
    assert second.reason is None


def test_lit_and_one_of_refuse_empty_choices_and_lit_binds_and_words_its_reason() -> None:
    with pytest.raises(PatternError, match=r"^Lit needs at least one allowed value$"):
        Lit()
    with pytest.raises(PatternError, match=r"^OneOf needs two or more alternatives$"):
        OneOf(Var("a"))
    text = "{node} slides by {value} along {role}, wants {expected}"
    pattern = Op(CONV, name="conv", stride=Lit((1, 1), name="s"), padding=Lit((1, 1), (2, 2), code="pad", text=text))
    snap = conv_relu()
    reason = rule("t", pattern, plan=_keep).plan_at(snap, snap.node("conv")).failure()
    assert (reason.code, reason.path) == ("pad", "conv.padding")
    assert reason.message == "conv slides by (0, 0) along padding, wants (1, 1) or (2, 2)"
    m = match(Op(CONV, name="conv", stride=Lit((1, 1), name="s")), snap, snap.node("conv")).unwrap()
    assert m.bindings["s"] == (1, 1) and m.sites["s"].path == "conv.stride"


def test_bound_ints_refuses_what_is_not_a_tuple_of_ints() -> None:
    snap = conv_relu()
    conv = Bound(node=snap.node("conv"), family=CONV, args={"stride": (1, 2), "groups": 1, "flags": (1, True)}, uses=())
    assert conv.ints("stride") == (1, 2)
    with pytest.raises(TypeError, match=r"^conv.groups is 1, not a tuple of ints$"):
        conv.ints("groups")
    with pytest.raises(TypeError, match=r"^conv.flags is \(1, True\), not a tuple of ints$"):
        conv.ints("flags")


def test_a_consumer_among_alternatives_is_reported_at_the_node_it_follows() -> None:
    g = GraphBuilder()
    c = g.call("aten.relu.default", name="first", self=g.input("x", (2,)))
    g.output(g.call("aten.t.default", name="t", self=c))
    snap = g.build()
    pattern = Op(RELU, name="first", user=OneOf(Op(RELU, code="not-relu"), Op(MUL, code="not-mul")))
    reason = match(pattern, snap, snap.node("first")).failure()
    expected = WrongOp(
        code="not-relu",
        node="first",
        role="output",
        producer="t",
        target="aten.t.default",
        expected="a relu",
        consumer=True,
        path="first.user/relu",
    )
    assert reason == expected
    # the consumer that matches is bound where it was found
    follows = Op(RELU, name="first", user=OneOf(Op(MUL), Op(TRANSPOSE, name="then")))
    assert match(follows, snap, snap.node("first")).unwrap().sites["then"].path == "first.user/then"


def test_need_static_reasons_in_full() -> None:
    whole, some = need.static("w"), need.static("w", dims=(0, -4))
    assert why(conv_relu(), whole) is None and why(conv_relu(), some) is None  # -4 is the first of 4 dims
    out = why(conv_relu(), need.static("w", dims=(0, 4)))
    assert out == Malformed(node="conv", detail="weight has no dims (0, 4): (4, 3, 3, 3)", path="relu.self/conv.weight")
    assert why(conv_relu(), need.static("w", dims=[-5])) == replace(
        out, detail="weight has no dims (-5,): (4, 3, 3, 3)"
    )
    symbolic = why(conv_relu(w_shape=("s0", 3, 3, 3)), whole)
    assert symbolic == SymbolicShape(node="conv", role="weight", shape=("s0", 3, 3, 3), path="relu.self/conv.weight")
    assert why(conv_relu(w_shape=("s0", 3, 3, 3)), need.static("w", dims=(1, 2, 3))) is None
    g = GraphBuilder()
    g.output(
        g.call("aten.relu.default", name="relu", self=g.call("aten.relu.default", name="r0", self=g.input("x", (2,))))
    )
    shapeless = rule("t", Op(RELU, name="relu", self=Var("x")), need.static("x"), plan=_keep)
    assert shapeless.plan_at(g.build(), g.build().node("relu")).failure() == Malformed(
        node="relu", detail="self has no known shape", path="relu.self"
    )


def test_need_channels_of_an_op_without_groups_counts_one_group() -> None:
    # the op named as ``conv`` is the relu: no groups, so one; 3 output channels (weight (3, ...))
    check = need.channels("b", of="w", conv="relu")
    assert why(conv_relu(w_shape=(3, 3, 3, 3), bias=(3,)), check) is None
    assert why(conv_relu(bias=(5,)), check) == ChannelMismatch(
        node="conv", expected=4, found=5, path="relu.self/conv.bias"
    )


def _unannotated(w):  # type: ignore[no-untyped-def]
    return None


def _bare(w: WeightExpr) -> bool:
    return True


def _number(w: WeightExpr) -> Reason | None:
    return 3  # type: ignore[return-value]


def _scale_of(w: WeightExpr, s: float) -> Reason | None:
    return None


class _Callable:
    def __call__(self, w: WeightExpr) -> Reason | None:
        return None

    def __repr__(self) -> str:
        return "<a check object>"


def test_checks_are_named_after_their_function_and_refuse_what_is_no_check() -> None:
    with pytest.raises(PatternError, match=r"^check _unannotated must declare its return type \(a Reason or None\)$"):
        need.check(_unannotated, codes=["x"])
    with pytest.raises(
        PatternError, match=r"^check _bare returns a bare bool: return a Reason \(with a code\) or None$"
    ):
        need.check(_bare, codes=["x"])  # type: ignore[arg-type]
    with pytest.raises(PatternError, match=r"^check _scale_of must list the reason codes it may return$"):
        need.check(_scale_of, codes=[])
    assert need.check(_scale_of, codes=["x"]).label == "_scale_of"
    assert need.check(partial(_scale_of, s=2.0), codes=["x"]).label == "_scale_of"  # a partial: its function
    assert need.check(_Callable(), codes=["x"]).label == "<a check object>"  # no name at all: its repr
    with pytest.raises(TypeError, match=r"^check _number returned 3, not a Reason or None$"):
        why(conv_relu(), need.check(_number, codes=["x"]))
    # ``at`` puts the binding reasons are located at first, the other reads after it
    located = need.check(_scale_of, codes=["x"], at="s")
    assert (located.label, located.reads, located.codes) == ("_scale_of", ("s", "w"), frozenset({"x"}))
    assert need.check(_scale_of, codes=["x"], at="w").reads == ("w", "s")


def test_need_spatial_rank_of_what_is_no_op_is_refused() -> None:
    check = need.spatial_rank("conv", [1, 3])
    assert (check.label, check.reads, check.codes) == ("spatial_rank(conv)", ("conv",), frozenset({"unsupported-rank"}))
    assert why(conv_relu(), check) == UnsupportedRank(node="conv", rank=2, allowed=(1, 3), path="relu.self/conv")
    with pytest.raises(PatternError, match="binds it by Var, not Op"):  # x is a node, not a matched op
        why(conv_relu(), need.spatial_rank("x", [1]))


def _nothing(p: Planner) -> RewritePlan:
    return p.finish([])


def _keyword_only(*, p: Planner) -> RewritePlan:
    return p.finish([])


def _no_planner() -> RewritePlan:
    return RewritePlan(rule="r", anchor="relu")


def test_a_rule_refuses_what_cannot_be_a_rule_and_says_what() -> None:
    for bad in (Var("x"), OneOf(Op(RELU), Var("x"))):
        with pytest.raises(
            PatternError,
            match=rf"^r: a rule's pattern is rooted at an Op \(or OneOf of Ops\), got {re.escape(repr(bad))}$",
        ):
            rule("r", bad, plan=_nothing)  # type: ignore[arg-type]
    assert rule("r", OneOf(Op(RELU), OneOf(Op(MUL), Op(ADD))), plan=_nothing).name == "r"
    with pytest.raises(PatternError, match=r"^r: 3 is not a Check \(wrap functions with need.check\)$"):
        rule("r", Op(RELU), 3, plan=_nothing)  # type: ignore[arg-type]
    for planner in (_no_planner, _keyword_only):
        with pytest.raises(PatternError, match=r"^r: the planner takes the Planner as its first parameter$"):
            rule("r", Op(RELU), plan=planner)


def test_pattern_mistakes_are_named_when_the_rule_is_built() -> None:
    with pytest.raises(PatternError, match=r"^user= takes an Op \(or OneOf of Ops\), got Var$"):
        rule("r", Op(RELU, user=Var("x")), plan=_nothing)
    with pytest.raises(PatternError, match=r"^mm has no argument 'input' \(it has: mat2, self\)$"):
        rule("r", Op(MM, input=Var("x")), plan=_nothing)
    with pytest.raises(PatternError, match=r"^conv.groups is not a tensor argument: Const cannot match it$"):
        rule("r", Op(CONV, groups=Const("g")), plan=_nothing)
    # on the root, on an operand and on a user= op (also among alternatives), out= is where it belongs
    assert "bn-stats" in rule("r", Op(BATCH_NORM, out=0, out_code="bn-stats"), plan=_nothing).codes
    inner = Op(RELU, self=Op(BATCH_NORM, name="bn", out=0, out_code="bn-stats"))
    assert "bn-stats" in rule("r", inner, plan=_nothing).codes
    users = OneOf(Op(BATCH_NORM, out=0, out_code="bn-stats"), Op(RELU, code="no-relu"))
    assert "bn-stats" in rule("r", Op(CONV, user=users), plan=_nothing).codes


def test_a_rules_codes_are_those_its_primitives_can_give() -> None:
    pattern = Op(
        MUL,
        name="m",
        self=OneOf(
            Op(CONV, code="no-conv", shared="conv-shared", weight=Const("w")), Op(MM, code="no-mm", self=Scalar("k"))
        ),
        other=Lit(2.0, code="not-two"),
        user=Op(RELU, code="no-relu", shared="relu-shared"),
    )
    codes = rule("r", pattern, plan=_nothing).codes - GENERIC_CODES
    # the relu's own shared code is not among them: it is the last node, nothing reads it in the pattern
    mine = {"no-conv", "conv-shared", "not-constant", "no-mm", "not-scalar", "not-two", "no-relu", "output-shared"}
    assert codes == mine - GENERIC_CODES
    # a name bound twice in one match can conflict; once in each alternative cannot
    assert "binding-conflict" not in rule("r", OneOf(Op(RELU, name="a"), Op(MUL, name="a")), plan=_nothing).codes
    twice = OneOf(Op(CONV, stride=Var("s"), padding=Var("s")), Op(MM, self=Var("s")))
    assert "binding-conflict" in rule("r", twice, plan=_nothing).codes
    assert "binding-conflict" in rule("r", Op(RELU, name="r", self=Op(RELU, name="r")), plan=_nothing).codes


def test_bound_scalars_refuse_what_they_are_not() -> None:
    snap = conv_relu()
    args: dict[str, Arg] = {"i": 3, "f": 2.5, "b": True, "s": "x"}
    conv = Bound(node=snap.node("conv"), family=CONV, args=args, uses=())
    assert (conv.int("i"), conv.float("i"), conv.float("f"), conv.bool("b")) == (3, 3.0, 2.5, True)
    for get, arg, what in [
        (conv.int, "f", "an int"),
        (conv.int, "b", "an int"),
        (conv.float, "b", "a number"),
        (conv.float, "s", "a number"),
        (conv.bool, "i", "a bool"),
    ]:
        with pytest.raises(TypeError, match=rf"^conv.{arg} is {re.escape(repr(args[arg]))}, not {what}$"):
            get(arg)


def test_planner_call_writes_keyword_only_arguments_as_keywords() -> None:
    snap = conv_relu()
    p = Planner("t", match(Op(RELU, name="relu"), snap, snap.node("relu")).unwrap())
    x = NodeRef("x")
    p.call("aten.addmm.default", name="mm", spec=None, self=x, mat1=x, mat2=x, beta=2.0)
    (node,) = p.finish([]).nodes
    assert (node.args, dict(node.kwargs), node.provenance) == ((x, x, x), {"beta": 2.0}, "relu")
    message = r"^no schema for my.op: pass its Schema, or use Planner.node \(positional arguments\)$"
    with pytest.raises(PatternError, match=message):
        p.call("my.op", name="n", spec=None)


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


# --- fxpure.plan, fxpure.snapshot, fxpure.testing --------------------------------------------------


def test_constant_operand_of_a_constant_a_node_and_a_literal() -> None:
    snap = conv_relu()
    assert constant_operand(snap, "conv", "weight", NodeRef("w")) == Success(Source(key="w", spec=spec(4, 3, 3, 3)))
    computed = constant_operand(snap, "relu", "self", NodeRef("conv")).failure()
    assert computed == NotConstant(node="relu", role="self", source="conv")
    literal = constant_operand(snap, "conv", "bias", 2.5).failure()
    assert literal == NotConstant(node="conv", role="bias", source="the literal 2.5", computed=False)
    assert literal.message == "bias of conv is not a constant tensor (it is the literal 2.5)"
    absent = constant_operand(snap, "conv", "bias", None).failure()
    assert absent.message == "bias of conv is not a constant tensor (it is absent)"


def test_a_rewrite_conflict_names_the_node() -> None:
    snap = conv_relu()
    keep_conv = RewritePlan(rule="r", anchor="relu", erase=("conv",))
    conflict = rewrite(snap, [keep_conv]).failure()
    assert (conflict.code, conflict.node, conflict.message) == (
        "plan-conflict",
        "conv",
        "conv: erased but still read by relu",
    )


def test_new_nodes_keep_their_keywords_and_follow_plan_names_the_rewrite_changed() -> None:
    # a plan's names are local: "w" and "relu" exist already, so the rewrite renames them, and a new
    # node's keyword arguments follow (a plain dict or list from a hand-written rule becomes a map or a
    # tuple too)
    snap = conv_relu()
    w = Source(key="w", spec=spec(4, 3, 3, 3))

    def plan_with(const: str, node: str, kwargs: Any, args: Any = None) -> GraphSnapshot:
        added = NewNode(
            name=node,
            target="aten.add.Tensor",
            args=args or (NodeRef("conv"),),
            kwargs=kwargs,
            spec=snap.node("relu").spec,
        )
        p = RewritePlan(
            rule="r",
            anchor="relu",
            constants=(NewConstant(name=const, expr=w),),
            nodes=(added,),
            replace=(("relu", node),),
            erase=("relu",),
        )
        return rewrite(snap, [p]).unwrap()

    clash = plan_with("w", "relu", pmap({"other": NodeRef("w"), "alpha": 2}))
    assert dict(clash.node("relu_1").kwargs) == {"other": NodeRef("w_1"), "alpha": 2}
    fresh = plan_with("k", "scaled", pmap({"other": NodeRef("k"), "alpha": 2}))
    assert dict(fresh.node("scaled").kwargs) == {"other": NodeRef("k"), "alpha": 2}
    plain = plan_with("k", "scaled", {"other": NodeRef("k")}, [NodeRef("conv")])
    assert plain.node("scaled").kwargs == pmap({"other": NodeRef("k")})
    assert plain.node("scaled").args == (NodeRef("conv"),)
    assert len({plain.node("scaled")}) == 1  # a snapshot node stays hashable


def test_node_arguments_by_position_then_keyword_and_users_of_any_name() -> None:
    node = NodeSnapshot(name="n", op="call_function", target="t", args=(1,), kwargs=pmap({"b": 2, "c": 3}))
    assert (node.arg(0, "a"), node.arg(1, "b"), node.arg(1, "c"), node.arg(2, "d")) == (1, 2, 3, None)
    snap = conv_relu()
    assert [u.name for u in snap.users_of("conv")] == ["relu"]
    assert snap.users_of("nowhere") == ()


def test_builder_getitem_names_and_shapes_its_projection() -> None:
    g = GraphBuilder()
    bn = g.node("my.split", (g.input("x", (4, 2)),), name="split", out=(spec(2, 2), spec(2, 2)))
    first, second = g.getitem(bn, 0, out=(2, 2)), g.getitem(bn, 1)
    g.output(first, second)
    snap = g.build()
    assert (first.name, second.name) == ("getitem", "getitem_1")
    assert (snap.node("getitem").args, snap.node("getitem").spec) == ((bn, 0), spec(2, 2))
    assert snap.node("getitem_1").spec is None


def test_verify_names_each_broken_invariant() -> None:
    snap = conv_relu()

    def broken(**fields: Any) -> tuple[str, str]:
        bad = verify(replace(snap, **fields)).failure()
        return bad.node, bad.detail

    info = snap.constants["w"]
    assert broken(constants=snap.constants.set("gone", info)) == ("gone", "constant without a node")
    users = {**snap.users, "x": ()}
    assert broken(users=MappingProxyType(users)) == ("<graph>", "users disagree with arguments")
    index = {**snap.index, "x": 7}
    assert broken(index=MappingProxyType(index)) == ("<graph>", "name index disagrees with node order")
    targets = {**snap.targets, "aten.relu.default": ()}
    assert broken(targets=MappingProxyType(targets)) == ("<graph>", "target index disagrees with the nodes")


def test_builder_buffers_keep_their_key_and_storage() -> None:
    g = GraphBuilder()
    g.output(g.buffer("b", (4,), key="bn.running_mean", storage="s0"), g.buffer("c", (4,)))
    snap = g.build()
    b, c = snap.constants["b"], snap.constants["c"]
    assert (b.kind, b.key, b.storage, c.key, c.storage) == ("buffer", "bn.running_mean", "s0", "c", None)


# --- fxpure.pattern: the matcher's edges ------------------------------------------------------------


def test_a_literal_where_an_op_or_a_tuple_was_expected() -> None:
    g = GraphBuilder()
    g.output(g.call("aten.relu.default", name="relu", self=2.0))
    snap = g.build()
    wrong = match(Op(RELU, self=Op(CONV)), snap, snap.node("relu")).failure()
    assert (wrong.code, wrong.path, wrong.message) == (
        "wrong-op",
        "relu.self/conv",
        "self of relu comes from 2.0 (a literal), not a convolution",
    )
    for lit in (Lit((2.0,)), Lit((2.0, 2.0))):
        mismatch = match(Op(RELU, self=lit), snap, snap.node("relu")).failure()
        assert (mismatch.code, mismatch.path) == ("arg-mismatch", "relu.self")
    conv = conv_relu()
    assert match(Op(CONV, stride=Lit(1)), conv, conv.node("conv")).failure().code == "arg-mismatch"  # (1, 1) is no 1


def _absent(match: Match) -> Reason | None:
    return Declined(code="absent", node=match.anchor, detail="no")


def test_checks_on_a_name_this_match_did_not_bind() -> None:
    # c is bound by the second alternative only: a check reading it on the first is located at itself
    pattern = Op(RELU, name="relu", self=OneOf(Op(CONV, name="conv"), Op(MUL, name="c")))
    snap = conv_relu()
    located = rule("t", pattern, need.check(_absent, codes=["absent"], at="c"), plan=_keep)
    assert located.plan_at(snap, snap.node("relu")).failure().path == "need._absent"
    # a built-in check has nothing to check there, as for an absent operand (the first alternative
    # is a linear in the mm spelling, say, which has no bias)
    static = rule("t", pattern, need.static("c"), plan=_keep)
    assert isinstance(static.plan_at(snap, snap.node("relu")), Success)


def test_bound_ref_refuses_what_is_not_a_node() -> None:
    conv = Bound(node=conv_relu().node("conv"), family=CONV, args={"input": NodeRef("x"), "groups": 1}, uses=())
    assert conv.ref("input") == NodeRef("x")
    with pytest.raises(TypeError, match=r"^conv.groups is 1, not a node$"):
        conv.ref("groups")


def test_respell_keeps_the_nodes_keywords() -> None:
    g = GraphBuilder(dialect="edge")
    x = g.input("x", (2, 2))
    g.output(g.call("aten.addmm.default", name="mm", self=x, mat1=x, mat2=x, beta=0.5))
    snap = g.build()
    m = match(Op(ADDMM, name="mm", beta=Var("beta")), snap, snap.node("mm")).unwrap()
    p = Planner("t", m)
    p.respell(m.bindings["mm"], name="mm2", mat2=NodeRef("y"))  # type: ignore[arg-type]
    (node,) = p.finish([]).nodes
    assert (node.args, dict(node.kwargs)) == ((x, x, NodeRef("y")), {"beta": 0.5})


def test_a_candidate_filter_sees_the_root_bound() -> None:
    seen: list[tuple[str, str, tuple[str, ...], Arg]] = []

    def grouped(root: Bound, snap: GraphSnapshot) -> bool:
        seen.append((root.name, root.family.name, root.uses, root.args["groups"]))
        return True

    r = rule("t", Op(CONV, name="conv"), plan=_keep, candidate=grouped)
    assert [n.name for n in r.anchors(conv_relu())] == ["conv"]
    assert seen == [("conv", "conv", ("conv",), 1)]


def _bad_constant(p: Planner, conv: Bound, w: WeightExpr) -> RewritePlan:
    p.const(Permute(x=w, dims=(0,)), "w_bad")
    return p.replace(conv, conv.ref("input"))


def test_a_plan_with_an_ill_typed_constant_is_declined_at_its_anchor() -> None:
    snap = conv_relu()
    r = rule("t", Op(CONV, name="conv", weight=Const("w")), plan=_bad_constant)
    reason = r.plan_at(snap, snap.node("conv")).failure()
    assert (reason.code, reason.node, reason.path) == ("bad-weight-expr", "conv", "plan.w_bad")
    assert reason.message == "permute (0,) does not fit rank 4"


def _keep_the_conv(p: Planner, relu: Bound, conv: Bound) -> RewritePlan:
    return p.finish([(relu, NodeRef(conv.name))], erase=[relu])


def test_finish_erases_only_what_it_is_told() -> None:
    snap = conv_relu()
    r = rule("t", Op(RELU, name="relu", self=Op(CONV, name="conv")), plan=_keep_the_conv)
    p = r.plan_at(snap, snap.node("relu")).unwrap()
    assert (p.erase, p.prune, p.replace) == (("relu",), (), (("relu", "conv"),))


def test_every_primitive_binds_where_it_read_and_words_its_reason() -> None:
    snap = conv_relu(bias=None)
    pattern = Op(CONV, name="conv", input=Var("x"), bias=Const("b", optional=True), stride=Lit((1, 1), name="s"))
    m = match(pattern, snap, snap.node("conv")).unwrap()
    assert {k: (s.node, s.role, s.path) for k, s in m.sites.items() if k != "conv"} == {
        "x": ("conv", "input", "conv.input"),
        "b": ("conv", "bias", "conv.bias"),
        "s": ("conv", "stride", "conv.stride"),
    }
    g = GraphBuilder()
    x = g.input("x", (2,))
    g.output(g.call("aten.add.Tensor", name="add", self=x, other=x, alpha=2))
    snap = g.build()
    m = match(Op(ADD, alpha=Scalar("a")), snap, snap.node("add")).unwrap()
    assert (m.bindings["a"], m.sites["a"]) == (2, Site("add", "alpha", "add.alpha"))
    computed = match(Op(ADD, other=Scalar("k"), alpha=Var("a")), snap, snap.node("add")).failure()
    assert computed == NotScalar(node="add", role="other", value="computed by 'x'", path="add.other")
    assert match(Op(ADD, self=Const("c"), alpha=Var("a")), snap, snap.node("add")).failure() == NotConstant(
        node="add", role="self", source="x, an input of the program", computed=False, path="add.self"
    )
    nowhere = match(Op(RELU), snap, snap.node("add")).failure()
    assert nowhere == Malformed(node="add", detail="aten.add.Tensor is not an anchor of this pattern")


def test_literals_are_shown_as_themselves_in_reasons() -> None:
    # exported programs do carry literals in tensor arguments (add(x, 2.5)); a Const or Scalar that
    # meets one names the literal, not "None", and never raises
    g = GraphBuilder()
    x = g.input("x", (2,))
    g.output(g.call("aten.add.Tensor", name="add", self=x, other=2.5, alpha=True))
    snap = g.build()
    assert match(Op(ADD, other=Const("c"), alpha=Var("a")), snap, snap.node("add")).failure() == NotConstant(
        node="add", role="other", source="the literal 2.5", computed=False, path="add.other"
    )
    assert match(Op(ADD, alpha=Scalar("a")), snap, snap.node("add")).failure() == NotScalar(
        node="add", role="alpha", value="True", path="add.alpha"
    )


def test_a_stray_tuple_reader_is_named_with_the_index_kept() -> None:
    snap = conv_bn(bn_target="aten.native_batch_norm.default", stats_used=True)
    (rejection,) = plan(snap, [fuse_conv_bn()]).rejections
    assert rejection.reason == TupleUsed(code="bn-stats-used", node="bn", user="bn_1", index=0, path="bn.out")


def test_commute_tries_the_swap_only_when_asked_and_keeps_naming_the_reader() -> None:
    g = GraphBuilder()
    x = g.input("x", (2,))
    c = g.parameter("c", (2,))
    g.output(g.call("aten.relu.default", name="relu", self=g.call("aten.mul.Tensor", name="mul", self=x, other=c)))
    snap = g.build()
    fixed = Op(MUL, self=Const("c"), other=Var("v"))
    assert match(fixed, snap, snap.node("mul")).failure() == NotConstant(
        node="mul", role="self", source="x, an input of the program", computed=False, path="mul.self"
    )
    assert match(Op(MUL, commute=True, self=Const("c"), other=Var("v")), snap, snap.node("mul")).unwrap().bindings[
        "v"
    ] == NodeRef("x")
    # a transparent op's operands are reported as its reader's argument, in either order: the swapped
    # order gets further here (c is a constant, x is not), so its reason is the one reported
    through = Op(RELU, self=Op(MUL, transparent=True, commute=True, self=Const("c"), other=Const("d")))
    assert match(through, snap, snap.node("relu")).failure() == NotConstant(
        node="relu", role="self", source="x, an input of the program", computed=False, path="relu.self/mul.self"
    )

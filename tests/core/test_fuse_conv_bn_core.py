"""fuse_conv_bn on hand-built snapshots: every plan shape and every rejection reason."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from pyrsistent import pmap
from returns.pipeline import is_successful

import fxpure
from fxpure import NodeRef, NodeSnapshot, plan, rewrite, verify
from fxpure.plan import MAX_RUNS
from fxpure.rules import fuse_conv_bn
from fxpure.serial import to_data
from fxpure.testing import GraphBuilder
from fxpure.weights import Binary, Source, WeightExpr, fold_batch_norm, subexpressions
from tests.core.build import BN_TARGETS, CONV_TARGETS, conv_bn, spec


@pytest.mark.parametrize("lifted", [True, False])
@pytest.mark.parametrize("bn_target", BN_TARGETS)
@pytest.mark.parametrize("conv_target", CONV_TARGETS)
@pytest.mark.parametrize("bias", [True, False])
def test_plans_every_spelling(conv_target: str, bn_target: str, bias: bool, lifted: bool) -> None:
    g = conv_bn(conv_target=conv_target, bn_target=bn_target, bias=bias, lifted=lifted, groups=2)
    report = plan(g, [fuse_conv_bn()])
    assert report.rejections == ()
    (p,) = report.plans
    assert p.anchor == "bn" and p.rule == "fuse-conv-bn"
    after = report.after
    assert verify(after).unwrap() == after
    assert [n.target for n in after.nodes if n.op == "call_function"] == [conv_target]
    (conv,) = (n for n in after.nodes if n.op == "call_function")
    assert conv.args[1] == NodeRef("conv_bn_weight") and conv.args[2] == NodeRef("conv_bn_bias")
    assert after.outputs == ("conv_bn",)
    # every old constant is dead and gone; the two folded ones are expressions
    assert sorted(after.constants) == ["conv_bn_bias", "conv_bn_weight"]
    # the planner folds the right constants, with the conv's layout (transposed, groups) and the BN's eps
    src = {k: Source(key=k, spec=info.spec) for k, info in g.constants.items()}
    want = fold_batch_norm(
        weight=src["w"],
        bias=src.get("b"),
        mean=src["mean"],
        var=src["var"],
        gamma=src["gamma"],
        beta=src["beta"],
        eps=1e-5,
        transposed=conv_target == "aten.conv_transpose2d.input",
        groups=2,
    ).unwrap()
    assert (after.constants["conv_bn_weight"].source, after.constants["conv_bn_bias"].source) == want
    assert after.constants["conv_bn_bias"].spec == spec(8)
    assert after.node("conv_bn_weight").op == ("placeholder" if lifted else "get_attr")


def test_non_affine_bn_folds_with_unit_scale() -> None:
    report = plan(conv_bn(affine=False), [fuse_conv_bn()])
    (p,) = report.plans
    read = {e.key for c in p.constants for e in subexpressions(c.expr) if isinstance(e, Source)}
    assert read == {"w", "b", "mean", "var"}  # gamma = 1 and beta = 0 are implied, not read


@pytest.mark.parametrize(
    ("knobs", "code"),
    [
        ({"training": True}, "bn-training-mode"),
        ({"conv_extra_user": True}, "conv-output-shared"),
        ({"bn_target": "aten.native_batch_norm.default", "stats_used": True}, "bn-stats-used"),
        ({"weight_is_input": True}, "not-constant"),
        ({"weight_dtype": "int8"}, "unsupported-dtype"),
        ({"bn_channels": 6}, "channel-mismatch"),
        ({"channels": "s0"}, "symbolic-shape"),
    ],
)
def test_each_rejection_reason(knobs: dict[str, object], code: str) -> None:
    g = conv_bn(**knobs)  # type: ignore[arg-type]
    report = plan(g, [fuse_conv_bn()])
    assert report.plans == ()
    (rejection,) = report.rejections
    assert rejection.reason.code == code and rejection.rule == "fuse-conv-bn"
    assert rejection.reason.message and code in str(rejection.reason)
    assert report.after == g


def test_producer_not_conv() -> None:
    g = conv_bn()
    nodes = [replace(n, target="aten.relu.default", args=(NodeRef("x"),)) if n.name == "conv" else n for n in g.nodes]
    g2 = fxpure.snapshot(nodes, g.constants)
    (rejection,) = plan(g2, [fuse_conv_bn()]).rejections
    assert rejection.reason.code == "producer-not-conv"
    assert "aten.relu.default" in rejection.reason.message


def test_malformed_bn_is_a_value_not_an_exception() -> None:
    g = conv_bn()
    nodes = [replace(n, args=n.args[:2]) if n.name == "bn" else n for n in g.nodes]
    (rejection,) = plan(fxpure.snapshot(nodes, g.constants), [fuse_conv_bn()]).rejections
    assert rejection.reason.code == "malformed-node"


def test_rewrite_is_pure_and_second_run_finds_nothing() -> None:
    g = conv_bn()
    copy_before = json.dumps(to_data(g), sort_keys=True)  # records, not the same objects
    first = plan(g, [fuse_conv_bn()])
    assert json.dumps(to_data(g), sort_keys=True) == copy_before
    again = plan(first.after, [fuse_conv_bn()])
    assert again.plans == () and again.rejections == ()


def test_overlapping_plans_conflict() -> None:
    g = conv_bn()
    (p,) = plan(g, [fuse_conv_bn()]).plans
    result = rewrite(g, [p, replace(p, anchor="other")])
    assert not is_successful(result)
    assert result.failure().code == "plan-conflict"


def test_erasing_a_live_node_is_a_conflict() -> None:
    g = conv_bn()
    (p,) = plan(g, [fuse_conv_bn()]).plans
    bad = replace(p, replace=())
    result = rewrite(g, [bad])
    assert result.failure().code == "plan-conflict"
    assert "still read" in result.failure().message


def test_identical_derived_constants_are_one_constant() -> None:
    g = conv_bn()
    (p,) = plan(g, [fuse_conv_bn()]).plans
    after = rewrite(g, [p]).unwrap()
    # a second plan deriving the same expression reuses the existing constant
    w_expr = after.constants["conv_bn_weight"].source
    assert w_expr is not None
    extra = fxpure.RewritePlan(
        rule="t",
        anchor="conv_bn",
        constants=(fxpure.NewConstant(name="again", expr=w_expr),),
        nodes=(
            fxpure.NewNode(
                name="c2",
                target="aten.conv2d.default",
                args=(NodeRef("x"), NodeRef("again"), NodeRef("conv_bn_bias")),
                spec=spec(1, 8, 6, 6),
            ),
        ),
        replace=(("conv_bn", "c2"),),
        erase=("conv_bn",),
    )
    final = rewrite(after, [extra]).unwrap()
    assert "again" not in final.constants
    assert final.node("c2").args[1] == NodeRef("conv_bn_weight")


def test_new_names_never_collide() -> None:
    g = conv_bn()
    nodes = list(g.nodes)
    nodes.insert(0, NodeSnapshot(name="conv_bn_weight", op="placeholder", target="conv_bn_weight", spec=spec(1)))
    taken = fxpure.snapshot(nodes, {**g.constants})
    after = plan(taken, [fuse_conv_bn()]).after
    assert "conv_bn_weight_1" in after.constants


def test_a_derived_constant_is_keyed_under_the_module_of_what_it_reads() -> None:
    # conv_bn's constants are all of module "m": an exported program's state dict keeps the fused
    # weight there (torch.export.unflatten puts it on that module), its node keeps its plain name
    after = plan(conv_bn(), [fuse_conv_bn()]).after
    assert after.constants["conv_bn_weight"].key == "m.conv_bn_weight"
    assert after.constants["conv_bn_bias"].key == "m.conv_bn_bias"
    # a key the program already uses is not taken
    taken = plan(fxpure.snapshot(conv_bn().nodes, conv_bn().constants, reserved=["m.conv_bn_weight"]), [fuse_conv_bn()])
    assert taken.after.constants["conv_bn_weight"].key == "m.conv_bn_weight_1"
    # a get_attr graph's new constants are attributes of the root module
    flat = plan(conv_bn(lifted=False), [fuse_conv_bn()]).after
    assert flat.constants["conv_bn_weight"].key == "conv_bn_weight"
    # constants of two modules: their common parent; of modules with no common parent: the root
    g = GraphBuilder()
    x = g.input("x", (2,))
    for n, k in (("a", "net.l1.a"), ("b", "net.l2.block.b"), ("c", "head.c"), ("d", "net.l2.d")):
        g.parameter(n, (2,), key=k)
    g.output(g.call("aten.mul.Tensor", name="y", self=x, other=NodeRef("a"), out=(2,)))
    snap = g.build()

    def key_of(expr: WeightExpr) -> str:
        new = fxpure.NewNode(name="y2", target="aten.mul.Tensor", args=(x, NodeRef("w")), spec=spec(2))
        p = fxpure.RewritePlan(
            rule="t",
            anchor="y",
            constants=(fxpure.NewConstant(name="w", expr=expr),),
            nodes=(new,),
            replace=(("y", "y2"),),
            erase=("y",),
        )
        return rewrite(snap, [p]).unwrap().constants["w"].key

    a_, b_, c_, d_ = (Source(key=n, spec=spec(2)) for n in "abcd")
    assert key_of(Binary(op="add", a=a_, b=b_)) == "net.w"
    assert key_of(Binary(op="add", a=a_, b=c_)) == "w"
    assert key_of(Binary(op="mul", a=b_, b=b_)) == "net.l2.block.w"
    assert key_of(Binary(op="mul", a=b_, b=d_)) == "net.l2.w"


def test_plans_and_reasons_serialise_to_json() -> None:
    from fxpure.serial import to_data

    report = plan(conv_bn(), [fuse_conv_bn()])
    text = json.dumps(to_data(report.plans[0]))
    assert '"Binary"' in text and '"rsqrt"' in text and '"conv_bn_weight"' in text
    rejected = plan(conv_bn(training=True), [fuse_conv_bn()])
    data = to_data(rejected.rejections[0])
    assert isinstance(data, dict)
    reason = data["reason"]
    assert isinstance(reason, dict) and reason["code"] == "bn-training-mode"


def test_snapshot_is_hashable_and_structural() -> None:
    a, b = conv_bn(), conv_bn()
    assert a == b and hash(a) == hash(b)
    assert a != conv_bn(bias=False)


def test_verify_detects_broken_invariants() -> None:
    g = conv_bn()
    swapped = [g.nodes[-1], *g.nodes[:-1]]
    assert verify(fxpure.snapshot(swapped, g.constants)).failure().code == "invalid-snapshot"
    dup = [*g.nodes, g.nodes[0]]
    assert "duplicate" in verify(fxpure.snapshot(dup, g.constants)).failure().message
    lying = replace(g, users=pmap({**g.users, "x": ()}))
    assert "users" in verify(lying).failure().message
    src = Source(key="zz", spec=spec(1))
    orphan = fxpure.snapshot(
        g.nodes, {**g.constants, "zz": fxpure.ConstantInfo(kind="buffer", key="zz", spec=src.spec)}
    )
    assert verify(orphan).failure().node == "zz"


def test_same_rule_twice_reports_each_candidate_once() -> None:
    # conv -> bn1 -> bn2: the rule's first run fuses bn1 and declines bn2 (its producer is a BN),
    # its second run fuses bn2 into the fused conv: bn2 is planned, not also declined; the rule
    # given twice finds nothing left the second time
    g = GraphBuilder()
    w, x = g.parameter("w", (4, 3, 3, 3)), g.input("x", (1, 3, 8, 8))
    stats = {k: g.buffer(k, (4,)) for k in ("m1", "v1", "m2", "v2")}
    c = g.call("aten.conv2d.default", name="conv", out=(1, 4, 6, 6), input=x, weight=w)
    y = c
    for i in (1, 2):
        y = g.call(
            "aten._native_batch_norm_legit_no_training.default",
            name=f"bn{i}",
            out=(spec(1, 4, 6, 6), spec(0), spec(0)),
            input=y,
            weight=None,
            bias=None,
            running_mean=stats[f"m{i}"],
            running_var=stats[f"v{i}"],
            momentum=0.1,
            eps=1e-5,
        )
        y = g.getitem(y, 0, name=f"y{i}", out=(1, 4, 6, 6))
    g.output(y)
    once = plan(g.build(), [fuse_conv_bn()])
    assert [[p.anchor for p in s] for s in once.stages] == [["bn1"], ["bn2"], []] and once.rejections == ()
    twice = plan(g.build(), [fuse_conv_bn(), fuse_conv_bn()])
    assert [p.anchor for p in twice.plans] == ["bn1", "bn2"] and twice.rejections == ()


def test_a_chain_of_more_batch_norms_than_runs_reports_the_next_one_runs_exhausted() -> None:
    # found by a review: the batch norm after the eighth fused one kept the reason its first run gave
    # (its input a batch norm, producer-not-conv), though another run would fuse it
    g = GraphBuilder()
    y = g.call(
        "aten.conv2d.default",
        name="conv",
        out=(1, 4, 6, 6),
        input=g.input("x", (1, 3, 8, 8)),
        weight=g.parameter("w", (4, 3, 3, 3)),
    )
    for i in range(MAX_RUNS + 2):
        y = g.call(
            "aten.batch_norm.default",
            name=f"bn{i}",
            out=(1, 4, 6, 6),
            input=y,
            weight=None,
            bias=None,
            running_mean=g.buffer(f"m{i}", (4,)),
            running_var=g.buffer(f"v{i}", (4,)),
            training=False,
            momentum=0.1,
            eps=1e-5,
            cudnn_enabled=False,
        )
    g.output(y)
    report = plan(g.build(), [fuse_conv_bn()])
    assert [p.anchor for p in report.plans] == [f"bn{i}" for i in range(MAX_RUNS)]
    codes = {r.node: r.reason.code for r in report.rejections}
    assert codes == {f"bn{MAX_RUNS}": "runs-exhausted", f"bn{MAX_RUNS + 1}": "producer-not-conv"}


def test_a_size_read_of_the_conv_is_answered_by_the_fused_conv() -> None:
    (p,) = plan(conv_bn(conv_reader="aten.sym_size.int"), [fuse_conv_bn()]).plans
    assert set(p.replace) == {("bn", "conv_bn"), ("conv", "conv_bn")} and set(p.erase) == {"bn", "conv"}
    after = rewrite(conv_bn(conv_reader="aten.sym_size.int"), [p]).unwrap()
    assert after.node("width").args == (NodeRef("conv_bn"), 3)
    assert verify(after).unwrap() == after
    (no,) = plan(conv_bn(conv_reader="aten.select.int"), [fuse_conv_bn()]).rejections  # its values: the conv stays
    assert (no.reason.code, no.reason.message) == ("conv-output-shared", "output of conv is also used by width")


@pytest.mark.parametrize("linear_first", [False, True])
@pytest.mark.parametrize("producer", ["conv", "linear", "linear-dropout", "relu"])
def test_each_batch_norm_rule_reports_its_own_batch_norms_only(producer: str, linear_first: bool) -> None:
    # run together (RULES), each batch norm after a linear was declined producer-not-conv by
    # fuse-conv-bn while fuse-linear-bn fused it, and each after a conv the other way round: a batch
    # norm is the candidate of the rule of its producer; of both where it is neither's
    from fxpure.rules import fuse_linear_bn

    g = GraphBuilder()
    x = g.input("x", (2, 4))
    if producer == "conv":
        x = g.call("aten.view.default", self=x, size=(2, 4, 1, 1), out=(2, 4, 1, 1))
        y = g.call("aten.conv2d.default", name="p", input=x, weight=g.parameter("w", (4, 4, 1, 1)), out=(2, 4, 1, 1))
    elif producer == "relu":
        y = g.call("aten.relu.default", name="p", self=x, out=(2, 4))
    else:
        y = g.call("aten.linear.default", name="p", input=x, weight=g.parameter("w", (4, 4)), bias=None, out=(2, 4))
        if producer == "linear-dropout":
            y = g.call("aten.dropout.default", self=y, p=0.5, train=True, out=(2, 4))
    stats = {k: g.buffer(k, (4,)) for k in ("running_mean", "running_var")}
    bn_args = dict(weight=None, bias=None, training=False, momentum=0.1, eps=1e-5, cudnn_enabled=False)
    out = (2, 4, 1, 1) if producer == "conv" else (2, 4)
    g.output(g.call("aten.batch_norm.default", name="bn", input=y, **stats, **bn_args, out=out))
    rules = [fuse_conv_bn(), fuse_linear_bn()]
    report = plan(g.build(), rules[::-1] if linear_first else rules)
    outcomes = {*((p.rule, "plan") for p in report.plans), *((r.rule, r.reason.code) for r in report.rejections)}
    assert (
        outcomes
        == {
            "conv": {("fuse-conv-bn", "plan")},
            "linear": {("fuse-linear-bn", "plan")},
            "linear-dropout": {("fuse-linear-bn", "arg-mismatch")},  # (a dropout in training mode)
            "relu": {("fuse-conv-bn", "producer-not-conv"), ("fuse-linear-bn", "producer-not-linear")},
        }[producer]
    )

"""fuse_linear_bn on hand-built snapshots: every spelling of the linear, the permuted (rank-3) form,
and every rejection reason with its exact code, node and pattern path."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

import fxpure
from fxpure import NodeRef, plan, verify
from fxpure.reasons import GENERIC_CODES, Declined, Malformed, Reason
from fxpure.rules.fuse_linear_bn import fuse_linear_bn
from fxpure.serial import to_data
from fxpure.snapshot import Arg, GraphSnapshot, NodeSnapshot
from fxpure.testing import GraphBuilder, spec
from fxpure.weights import Source, fold_batch_norm, sources

RULE = fuse_linear_bn()
IN, F, T = 5, 6, 3
Shape = tuple[int | str, ...]
BN_TARGETS = (
    "aten.batch_norm.default",
    "aten.native_batch_norm.default",
    "aten._native_batch_norm_legit_no_training.default",
)


def _linear(
    g: GraphBuilder, x: NodeRef, w: NodeRef, b: NodeRef | None, spelling: str, lead: Shape, beta: int
) -> NodeRef:
    """The linear in ``spelling``: aten ``linear``, or permute + ``addmm``/``mm`` (views around when rank 3)."""
    if spelling == "linear":
        return g.call("aten.linear.default", name="lin", out=(*lead, F), input=x, weight=w, bias=b)
    edge = g.dialect == "edge"
    t = g.call(
        "aten.permute_copy.default" if edge else "aten.permute.default", name="lin_t", out=(IN, F), self=w, dims=(1, 0)
    )
    view = "aten.view_copy.default" if edge else "aten.view.default"
    flat, rows = x, lead[0]
    if len(lead) == 2:
        rows = "s9" if isinstance(lead[0], str) else lead[0] * T
        flat = g.call(view, name="lin_in", out=(rows, IN), self=x, size=(-1, IN))
    if spelling == "addmm":
        prod = g.call("aten.addmm.default", name="lin", out=(rows, F), self=b, mat1=flat, mat2=t, beta=beta)
    else:
        prod = g.call("aten.mm.default", name="lin", out=(rows, F), self=flat, mat2=t)
    return g.call(view, name="lin_out", out=(*lead, F), self=prod, size=(-1, T, F)) if len(lead) == 2 else prod


def linear_bn(
    *,
    spelling: str = "linear",
    dialect: str = "aten",
    lifted: bool = True,
    bias: bool = True,
    rank: int = 2,
    swap: str | None = None,
    dims: tuple[int, ...] = (0, 2, 1),
    bn_target: str = "aten.batch_norm.default",
    bn_channels: int | None = None,
    affine: bool = True,
    training: bool = False,
    stats_used: bool = False,
    weight_is_input: bool = False,
    mean_is_input: bool = False,
    producer: str = "linear",
    extra_user: str | None = None,
    weight_dtype: str = "float32",
    out_features: int | str = F,
    seq: int = T,
    batch: int | str = 4,
    beta: int = 1,
    tied: bool = False,
) -> GraphSnapshot:
    """x -> linear (in ``spelling``) [-> permute/transpose] -> batch_norm -> output, with knobs for
    every rejection. ``rank=3``: x is [B, T, IN]; edge products are wrapped in views."""
    g = GraphBuilder(dialect=dialect, lifted=lifted)
    w_shape = (out_features, IN)
    w = None if weight_is_input else g.parameter("w", w_shape, weight_dtype, key="lin.weight")
    spelling = "mm" if spelling == "addmm" and not bias else spelling
    b = g.parameter("b", (F,), key="lin.bias") if bias and spelling != "mm" else None
    c = bn_channels if bn_channels is not None else F if rank == 2 or swap else seq
    mean = None if mean_is_input else g.buffer("mean", (c,), key="bn.running_mean")
    var = g.buffer("var", (c,), key="bn.running_var")
    gamma = g.parameter("gamma", (c,), key="bn.weight") if affine else None
    beta_ = g.parameter("beta", (c,), key="bn.bias") if affine else None
    lead: Shape = (batch,) if rank == 2 else (batch, seq)
    x = g.input("x", (*lead, IN))
    w = w or g.input("w", w_shape)
    mean = mean or g.input("mean", (c,))
    shape: Shape = (*lead, F)
    if producer == "linear":
        y = _linear(g, x, w, b, spelling, lead, beta)
    else:
        y = g.call("aten.relu.default", name="relu", out=shape, self=x)
    if swap == "permute":
        shape = tuple(shape[d] for d in dims)
        perm = "aten.permute_copy.default" if dialect == "edge" else "aten.permute.default"
        y = g.call(perm, name="perm", out=shape, self=y, dims=dims)
    elif swap == "transpose":
        shape = (shape[0], shape[2], shape[1])
        y = g.call("aten.transpose.int", name="perm", out=shape, self=y, dim0=dims[0], dim1=dims[1])
    elif swap == "flatten":  # an aten program's y.flatten(start_dim, end_dim)
        start, end = (d % len(shape) for d in dims)
        merged = math.prod(d for d in shape[start : end + 1] if isinstance(d, int))
        shape = (*shape[:start], merged, *shape[end + 1 :])
        y = g.call("aten.flatten.using_ints", name="flat", out=shape, self=y, start_dim=dims[0], end_dim=dims[1])
    args: dict[str, Arg] = {"input": y, "weight": gamma, "bias": beta_, "running_mean": mean, "running_var": var}
    if bn_target != "aten._native_batch_norm_legit_no_training.default":
        args["training"] = training
    args.update(momentum=0.1, eps=1e-5)
    if bn_target == "aten.batch_norm.default":
        results: list[Arg] = [g.call(bn_target, name="bn", out=shape, cudnn_enabled=False, **args)]
    else:
        bn = g.call(bn_target, name="bn", out=(spec(*shape), spec(0), spec(0)), **args)
        results = [g.getitem(bn, 0, name="bn_0", out=shape)]
        if stats_used:
            results.append(g.getitem(bn, 1, name="bn_1"))
    if extra_user is not None:
        results.append(NodeRef(extra_user))
    if tied:
        results.append(g.call("aten.linear.default", name="other", out=(*lead, F), input=x, weight=w))
    g.output(*results)
    return g.build()


def calls(s: GraphSnapshot) -> list[str]:
    return [n.target.removeprefix("aten.") for n in s.nodes if n.op == "call_function"]


def only_rejection(g: GraphSnapshot) -> fxpure.Reason:
    report = plan(g, [RULE])
    assert report.plans == () and report.after == g
    (rejection,) = report.rejections
    assert rejection.rule == "fuse-linear-bn" and rejection.node == "bn"
    return rejection.reason


EXPECTED = {  # spelling, dialect, rank -> the calls after the fold
    ("linear", "aten", 2): ["linear.default"],
    ("linear", "edge", 3): ["linear.default"],
    ("addmm", "edge", 2): ["permute_copy.default", "addmm.default"],
    ("mm", "edge", 2): ["permute_copy.default", "addmm.default"],
    ("addmm", "edge", 3): ["view_copy.default", "permute_copy.default", "addmm.default", "view_copy.default"],
    ("mm", "edge", 3): ["view_copy.default", "permute_copy.default", "addmm.default", "view_copy.default"],
    ("addmm", "aten", 2): ["permute.default", "addmm.default"],
}


@pytest.mark.parametrize("lifted", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("bn_target", BN_TARGETS)
@pytest.mark.parametrize(("spelling", "dialect", "rank"), sorted(EXPECTED))
def test_plans_every_spelling(spelling: str, dialect: str, rank: int, bn_target: str, bias: bool, lifted: bool) -> None:
    swap = "permute" if rank == 3 else None
    g = linear_bn(
        spelling=spelling, dialect=dialect, rank=rank, swap=swap, bn_target=bn_target, bias=bias, lifted=lifted
    )
    report = plan(g, [RULE])
    assert report.rejections == ()
    (p,) = report.plans
    assert (p.rule, p.anchor) == ("fuse-linear-bn", "bn")
    after = verify(report.after).unwrap()
    want = EXPECTED[(spelling, dialect, rank)] + (
        ["permute_copy.default" if dialect == "edge" else "permute.default"] if swap else []
    )
    assert calls(after) == want
    # every old constant is gone; the folded weight and bias are the only ones, read by the new product
    assert sorted(after.constants) == ["lin_bn_bias", "lin_bn_weight"]
    assert after.node("lin_bn_weight").op == ("placeholder" if lifted else "get_attr")
    product = after.node("lin_bn")
    if spelling == "linear":
        assert product.args[1:] == (NodeRef("lin_bn_weight"), NodeRef("lin_bn_bias"))
    else:  # mm became addmm(bias, x, permute(new weight))
        assert product.args[0] == NodeRef("lin_bn_bias") and product.args[2] == NodeRef("lin_t_bn")
        assert after.node("lin_t_bn").args == (NodeRef("lin_bn_weight"), (1, 0))
        assert product.args[1] == NodeRef("lin_in" if rank == 3 else "x")
    assert after.outputs == (
        ("perm_bn",) if swap else ("lin_out_bn",) if rank == 3 and spelling != "linear" else ("lin_bn",)
    )
    # the planner folds the right constants: the linear's weight and bias (if any), the BN's stats and eps
    src = {k: Source(key=k, spec=info.spec) for k, info in g.constants.items()}
    folded = fold_batch_norm(
        weight=src["w"],
        bias=src.get("b"),
        mean=src["mean"],
        var=src["var"],
        gamma=src["gamma"],
        beta=src["beta"],
        eps=1e-5,
    ).unwrap()
    assert (after.constants["lin_bn_weight"].source, after.constants["lin_bn_bias"].source) == folded
    assert after.constants["lin_bn_weight"].spec == spec(F, IN) and after.constants["lin_bn_bias"].spec == spec(F)


@pytest.mark.parametrize(
    ("swap", "dims", "op"),
    [
        ("permute", (0, 2, 1), "permute.default"),
        ("permute", (0, -1, 1), "permute.default"),
        ("transpose", (1, 2), "transpose.int"),
        ("transpose", (2, 1), "transpose.int"),
        ("transpose", (-1, 1), "transpose.int"),
    ],
)
def test_permuted_rank3_output_folds_and_keeps_the_permute(swap: str, dims: tuple[int, ...], op: str) -> None:
    # bn(permute(linear(x), [0, 2, 1])): the features reach dim 1; the BN becomes that permute of the new linear
    g = linear_bn(rank=3, swap=swap, dims=dims)
    after = verify(plan(g, [RULE]).after).unwrap()
    assert calls(after) == ["linear.default", op]
    perm = after.node("perm_bn")
    assert perm.args[0] == NodeRef("lin_bn") and perm.args[1:] == g.node("perm").args[1:]
    assert perm.spec == g.node("perm").spec == spec(4, F, T)
    assert after.outputs == ("perm_bn",)


@pytest.mark.parametrize(
    ("rank", "dims", "out"),
    [(3, (0, 1), (4 * T, F)), (3, (0, -2), (4 * T, F)), (2, (0, 0), (4, F)), (2, (-1, -1), (4, F))],
)
def test_a_flatten_to_n_f_folds_and_keeps_the_flatten(rank: int, dims: tuple[int, int], out: Shape) -> None:
    # bn(linear(x).flatten(0, 1)) in an aten program: the BN becomes that flatten of the new linear
    g = linear_bn(rank=rank, swap="flatten", dims=dims)
    assert g.node("flat").spec == spec(*out)
    report = plan(g, [RULE])
    assert report.rejections == () and len(report.plans) == 1
    after = verify(report.after).unwrap()
    assert calls(after) == ["linear.default", "flatten.using_ints"]
    flat = after.node("flat_bn")
    assert flat.args[0] == NodeRef("lin_bn") and flat.args[1:] == g.node("flat").args[1:] == dims
    assert flat.spec == g.node("flat").spec
    assert after.outputs == ("flat_bn",)


@pytest.mark.parametrize(
    ("dims", "channels", "out", "merged"),
    [((1, 2), T * F, (4, T * F), "1 to 2"), ((-2, -1), T * F, (4, T * F), "1 to 2"), ((1, 1), T, (4, T, F), "1 to 1")],
)
def test_a_flatten_that_leaves_the_features_off_dim_1_is_declined(
    dims: tuple[int, int], channels: int, out: Shape, merged: str
) -> None:
    reason = only_rejection(linear_bn(rank=3, swap="flatten", dims=dims, bn_channels=channels))
    detail = (
        f"bn normalises dim 1 of flat {out}, a reshape of the linear's output (4, {T}, {F}) (its dims {merged} "
        "merged): not its features"
    )
    assert reason == Declined(code="bn-axis-mismatch", node="bn", path="bn.input/flat", detail=detail)


def test_symbolic_sizes_stay_symbolic_in_every_new_node() -> None:
    g = linear_bn(spelling="mm", dialect="edge", rank=3, swap="permute", batch="s0")
    after = verify(plan(g, [RULE]).after).unwrap()
    assert after.node("lin_bn").spec == spec("s9", F)
    assert after.node("lin_out_bn").spec == spec("s0", T, F)
    assert after.node("perm_bn").spec == spec("s0", F, T)
    assert after.node("lin_out_bn").args[1] == (-1, T, F)  # the size argument is the program's own


def test_non_affine_bn_folds_with_unit_scale() -> None:
    g = linear_bn(affine=False)
    (p,) = plan(g, [RULE]).plans
    # gamma = 1 and beta = 0 are implied, not read
    assert set().union(*(sources(c.expr) for c in p.constants)) == {"w", "b", "mean", "var"}


def test_a_weight_shared_with_another_linear_is_left_as_it_is() -> None:
    g = linear_bn(tied=True)
    after = verify(plan(g, [RULE]).after).unwrap()
    assert after.constants["w"] == g.constants["w"]  # still read, unchanged, by the other linear
    assert after.node("other").args[1] == NodeRef("w")
    assert after.node("lin_bn").args[1] == NodeRef("lin_bn_weight")


def test_a_weight_transpose_another_node_reads_is_left_to_it() -> None:
    # tied weights: it was declined linear-output-shared, as if the linear's output were shared
    report = plan(linear_bn(spelling="addmm", dialect="edge", extra_user="lin_t"), [RULE])
    assert len(report.plans) == 1 and report.rejections == ()
    after = verify(report.after).unwrap()
    assert after.node("lin_t").args[0] == NodeRef("w") and "lin_t" in after.outputs
    assert after.node("lin_t_bn").args == (NodeRef("lin_bn_weight"), (1, 0))


@pytest.mark.parametrize(
    ("knobs", "code", "path", "node"),
    [
        ({"training": True}, "bn-training-mode", "bn.training", "bn"),
        ({"bn_target": BN_TARGETS[1], "stats_used": True}, "bn-stats-used", "bn.out", "bn"),
        ({"producer": "relu"}, "producer-not-linear", "bn.input/lin", "bn"),
        ({"extra_user": "lin"}, "linear-output-shared", "bn.input/lin", "lin"),
        (
            {"spelling": "addmm", "dialect": "edge", "rank": 3, "extra_user": "lin_out"},
            "linear-output-shared",
            "bn.input/lin_out",
            "lin_out",
        ),
        ({"rank": 3, "swap": "permute", "extra_user": "perm"}, "linear-output-shared", "bn.input/perm", "perm"),
        (
            {"spelling": "addmm", "dialect": "edge", "rank": 3, "swap": "permute", "extra_user": "lin"},
            "linear-output-shared",
            "bn.input/perm.self/lin_out.self/lin",
            "lin",
        ),
        ({"weight_is_input": True}, "not-constant", "bn.input/lin.weight", "lin"),
        (
            {"spelling": "addmm", "dialect": "edge", "weight_is_input": True},
            "not-constant",
            "bn.input/lin.mat2/lin_t.self",
            "lin_t",
        ),
        ({"mean_is_input": True}, "not-constant", "bn.running_mean", "bn"),
        ({"spelling": "addmm", "dialect": "edge", "beta": 2}, "arg-mismatch", "bn.input/lin.beta", "lin"),
        ({"weight_dtype": "int8"}, "unsupported-dtype", "bn.input/lin.weight", "lin"),
        ({"out_features": "s1"}, "symbolic-shape", "bn.input/lin.weight", "lin"),
        ({"bn_channels": 4}, "channel-mismatch", "bn.running_mean", "bn"),
        # BatchNorm1d(T) straight on a [B, T, F] output normalises T, not the features; even when T == F
        ({"rank": 3, "seq": 4}, "bn-axis-mismatch", "bn", "bn"),
        ({"rank": 3, "seq": F}, "bn-axis-mismatch", "bn", "bn"),
        ({"rank": 3, "seq": F, "spelling": "mm", "dialect": "edge"}, "bn-axis-mismatch", "bn", "bn"),
        # a permute that leaves another dim at 1
        (
            {"rank": 3, "swap": "permute", "dims": (1, 0, 2), "bn_channels": F},
            "bn-axis-mismatch",
            "bn.input/perm",
            "bn",
        ),
        ({"rank": 3, "swap": "transpose", "dims": (0, 2), "bn_channels": F}, "bn-axis-mismatch", "bn.input/perm", "bn"),
    ],
)
def test_each_rejection_reason(knobs: dict[str, object], code: str, path: str, node: str) -> None:
    reason = only_rejection(linear_bn(**knobs))  # type: ignore[arg-type]
    assert (reason.code, reason.path, reason.node) == (code, path, node)
    assert code in RULE.codes and reason.message and code in str(reason)


def test_axis_mismatch_says_which_dims() -> None:
    reason = only_rejection(linear_bn(rank=3, seq=F))
    assert reason.message == (
        "bn normalises dim 1 of the linear's output (4, 6, 6), but the linear's features are its last dim (2)"
    )


def _vector_linear_bn() -> GraphSnapshot:
    """x (IN,) -> linear -> permute (0,) -> batch_norm: a rank-1 output."""
    g = GraphBuilder()
    w, mean, var = g.parameter("w", (F, IN)), g.buffer("mean", (F,)), g.buffer("var", (F,))
    y = g.call("aten.linear.default", name="lin", out=(F,), input=g.input("x", (IN,)), weight=w, bias=None)
    y = g.call("aten.permute.default", name="perm", out=(F,), self=y, dims=(0,))
    bn: dict[str, Arg] = {"weight": None, "bias": None, "running_mean": mean, "running_var": var, "training": False}
    g.output(g.call(BN_TARGETS[0], name="bn", out=(F,), input=y, momentum=0.1, eps=1e-5, cudnn_enabled=False, **bn))
    return g.build()


def test_axis_reasons_in_full() -> None:
    def mismatch(path: str, detail: str) -> Declined:
        return Declined(code="bn-axis-mismatch", node="bn", path=path, detail=detail)

    def swapped(g: GraphSnapshot, new: NodeSnapshot) -> GraphSnapshot:
        return fxpure.snapshot([new if n.name == new.name else n for n in g.nodes], g.constants)

    features = "but the linear's features are its last dim"
    permuted = linear_bn(rank=3, swap="permute", bn_channels=F)
    cases: list[tuple[GraphSnapshot, Reason]] = [
        (  # a transpose that moves neither dim 1 nor the features: dim 1 stays
            linear_bn(rank=3, swap="transpose", dims=(0, 2), bn_channels=F),
            mismatch(
                "bn.input/perm", f"bn normalises dim 1 of the linear's output (4, 3, 6) (through perm), {features} (2)"
            ),
        ),
        (
            linear_bn(rank=2, swap="permute", dims=(1, 0), bn_channels=F),
            mismatch(
                "bn.input/perm", f"bn normalises dim 0 of the linear's output (4, 6) (through perm), {features} (1)"
            ),
        ),
        (
            linear_bn(rank=3, seq=4),
            mismatch("bn", f"bn normalises dim 1 of the linear's output (4, 4, 6), {features} (2)"),
        ),
        (
            linear_bn(rank=3, swap="permute", dims=(0, 2, 2), bn_channels=F),
            Malformed(node="perm", path="bn.input/perm", detail="(0, 2, 2) is not a permutation of 3 dims"),
        ),
        (
            swapped(permuted, replace(permuted.node("perm"), args=(NodeRef("lin"), 5))),
            Malformed(node="perm", path="bn.input/perm", detail="5 is not a permutation of 3 dims"),
        ),
        (
            _vector_linear_bn(),
            Malformed(node="perm", path="bn.input/perm", detail="(0,) is not a permutation of 1 dims"),
        ),
        (
            swapped(linear_bn(), replace(linear_bn().node("lin"), spec=None)),
            Malformed(node="bn", path="bn", detail="the linear's output has no known shape"),
        ),
    ]
    for g, reason in cases:
        assert only_rejection(g) == reason


def test_malformed_bn_is_a_value_not_an_exception() -> None:
    g = linear_bn()
    nodes = [replace(n, args=n.args[:2]) if n.name == "bn" else n for n in g.nodes]
    reason = only_rejection(fxpure.snapshot(nodes, g.constants))
    assert reason.code == "malformed-node"


def test_every_code_is_stable() -> None:
    assert sorted(RULE.codes - GENERIC_CODES) == [
        "arg-mismatch",
        "bn-axis-mismatch",
        "bn-stats-used",
        "bn-training-mode",
        "channel-mismatch",
        "linear-output-shared",
        "not-constant",
        "producer-not-linear",
        "runs-exhausted",
        "symbolic-shape",
        "unsupported-dtype",
        "unsupported-rank",
    ]


def test_rewrite_is_pure_and_second_run_finds_nothing() -> None:
    g = linear_bn(spelling="mm", dialect="edge")
    copy_before = json.dumps(to_data(g), sort_keys=True)  # records, not the same objects
    first = plan(g, [RULE])
    assert json.dumps(to_data(g), sort_keys=True) == copy_before
    again = plan(first.after, [RULE])
    assert again.plans == () and again.rejections == ()


@pytest.mark.parametrize("reader", ["aten.reshape_as.default", "aten.view_as.default", "aten.expand_as.default"])
@pytest.mark.parametrize("as_self", [False, True])
def test_a_reader_of_the_linears_sizes_only_moves_to_the_new_linear(reader: str, as_self: bool) -> None:
    # LeViT: bn(h.flatten(0, 1)).reshape_as(h) reads the linear's output h for its sizes only; a
    # reshape_as *of* h reads its values (the linear is shared)
    g = GraphBuilder()
    x, w = g.input("x", (2, 5, IN)), g.parameter("w", (F, IN), key="lin.weight")
    h = g.call("aten.linear.default", name="lin", out=(2, 5, F), input=x, weight=w)
    flat = g.call("aten.flatten.using_ints", name="flat", out=(10, F), self=h, start_dim=0, end_dim=1)
    stats = {k: g.buffer(k, (F,), key=f"bn.running_{k}") for k in ("mean", "var")}
    bn = g.call(
        "aten.batch_norm.default", name="bn", out=(10, F), input=flat, weight=None, bias=None,
        running_mean=stats["mean"], running_var=stats["var"], training=False, momentum=0.1, eps=1e-5,
        cudnn_enabled=False,
    )  # fmt: skip
    other = g.call("aten.relu.default", name="other", out=(10, F), self=bn)
    g.output(g.node(reader, (h, other) if as_self else (bn, h), name="back", out=(2, 5, F)))
    report = plan(g.build(), [RULE])
    if as_self:
        assert report.plans == () and [r.reason.code for r in report.rejections] == ["linear-output-shared"]
        return
    assert len(report.plans) == 1
    sized = report.after.node("back").args[1]
    assert isinstance(sized, NodeRef) and report.after.node(sized.name).target == "aten.linear.default"
    assert "lin" not in report.after.index and calls(report.after)[-1] == reader.removeprefix("aten.")


def test_a_batch_norm_of_no_linear_is_declined_naming_the_op_that_computes_its_input() -> None:
    # every spelling of the linear (and its permute or flatten) misses the same node: one noun, not the
    # list of the ops it may be spelled with; a tuple op's output read through getitem names the op
    g = GraphBuilder(dialect="edge")
    x = g.input("x", (2, F, 8, 8))
    pool = g.node(
        "aten.max_pool2d_with_indices.default",
        (x, (2, 2)),
        name="pool",
        out=(spec(2, F, 4, 4), spec(2, F, 4, 4, dtype="int64")),
    )
    stats = {k: g.buffer(k, (F,)) for k in ("mean", "var")}
    bn = g.call(
        "aten._native_batch_norm_legit_no_training.default",
        name="bn",
        input=g.getitem(pool, 0, name="pooled", out=(2, F, 4, 4)),
        weight=None,
        bias=None,
        running_mean=stats["mean"],
        running_var=stats["var"],
        momentum=0.1,
        eps=1e-5,
        out=(spec(2, F, 4, 4), spec(0), spec(0)),
    )
    g.output(g.getitem(bn, 0, out=(2, F, 4, 4)))
    (rejection,) = plan(g.build(), [RULE]).rejections
    assert (rejection.reason.code, rejection.reason.message) == (
        "producer-not-linear",
        "input of bn comes from pooled (output 0 of aten.max_pool2d_with_indices.default), "
        "not a linear (or a permute or flatten of one)",
    )

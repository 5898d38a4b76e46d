"""fuse_conv_bn: conv -> eval batch_norm  =>  conv with the batch norm folded into W, b."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import final

from returns.result import Failure, Result, Success

from fxpure.plan import NewConstant, NewNode, RewritePlan, constant_operand
from fxpure.reasons import (
    ChannelMismatch,
    NotAConv,
    OutputShared,
    Reason,
    StatsUsed,
    SymbolicShape,
    TrainingMode,
    UnsupportedDtype,
    first_failure,
)
from fxpure.snapshot import GraphSnapshot, NodeRef, NodeSnapshot
from fxpure.views import BATCH_NORM_SCHEMAS, BatchNormView, ConvView, batch_norm_view, conv_view, respell
from fxpure.weights import FLOAT_DTYPES, FoldBatchNorm, WeightExpr, infer_spec, out_channels

NAME = "fuse-conv-bn"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class _Match:
    bn: BatchNormView
    conv: ConvView
    conv_node: NodeSnapshot
    uses: tuple[str, ...]  # nodes whose uses move to the fused conv (bn, or its getitem(0)s)
    w: WeightExpr
    b: WeightExpr | None
    mean: WeightExpr
    var: WeightExpr
    gamma: WeightExpr | None
    beta: WeightExpr | None


def _operand(snap: GraphSnapshot, node: str, role: str, ref: NodeRef | None) -> Result[WeightExpr | None, Reason]:
    """The constant expression behind an optional operand."""
    return Success(None) if ref is None else constant_operand(snap, node, role, ref)


def _uses(snap: GraphSnapshot, bn: BatchNormView) -> Result[tuple[str, ...], Reason]:
    """Nodes whose uses the fused conv takes: bn itself, or every getitem(bn, 0)."""
    if not bn.tuple_output:
        return Success((bn.node,))
    users = snap.users_of(bn.node)
    for u in users:
        if u.target != "getitem" or u.args[1:2] != (0,):
            return Failure(StatsUsed(node=bn.node, user=u.name))
    return Success(tuple(u.name for u in users))


def _match(snap: GraphSnapshot, node: NodeSnapshot) -> Result[_Match, Reason]:
    # guard clauses: eval BN <- single-use conv with constant operands
    view = batch_norm_view(snap, node)
    if isinstance(view, Failure):
        return Failure(view.failure())
    bn = view.unwrap()
    if bn.training:
        return Failure(TrainingMode(node=bn.node))
    producer = snap.node(bn.x.name)
    conv = conv_view(snap, producer)
    if isinstance(conv, Failure):
        return Failure(NotAConv(node=bn.node, producer=producer.name, target=producer.target))
    others = tuple(u for u in snap.users.get(producer.name, ()) if u != bn.node)
    if others:
        return Failure(OutputShared(node=producer.name, users=others))
    c = conv.unwrap()
    uses = _uses(snap, bn)
    w, mean, var = (
        constant_operand(snap, c.node, "weight", c.w),
        constant_operand(snap, bn.node, "running_mean", bn.mean),
        constant_operand(snap, bn.node, "running_var", bn.var),
    )
    b, gamma, beta = (
        _operand(snap, c.node, "bias", c.b),
        _operand(snap, bn.node, "weight", bn.weight),
        _operand(snap, bn.node, "bias", bn.bias),
    )
    if (err := first_failure((uses, w, mean, var, b, gamma, beta))) is not None:
        return Failure(err)
    return Success(
        _Match(
            bn=bn,
            conv=c,
            conv_node=producer,
            uses=uses.unwrap(),
            w=w.unwrap(),
            b=b.unwrap(),
            mean=mean.unwrap(),
            var=var.unwrap(),
            gamma=gamma.unwrap(),
            beta=beta.unwrap(),
        )
    )


def _check_shapes(m: _Match) -> Result[_Match, Reason]:
    w, mean = infer_spec(m.w), infer_spec(m.mean)
    if isinstance(w, Failure) or isinstance(mean, Failure):
        return Failure(ChannelMismatch(node=m.bn.node, expected=-1, found=-1))
    ws, ms = w.unwrap(), mean.unwrap()
    if not ws.is_static:
        return Failure(SymbolicShape(node=m.conv.node, role="weight", shape=ws.shape))
    if ws.dtype not in FLOAT_DTYPES:
        return Failure(UnsupportedDtype(node=m.conv.node, role="weight", dtype=ws.dtype))
    oc = out_channels(ws, transposed=m.conv.transposed, groups=m.conv.groups)
    grouped = isinstance(ws.shape[0], int) and ws.shape[0] % m.conv.groups == 0
    if ms.shape != (oc,) or not isinstance(oc, int) or not grouped:
        return Failure(ChannelMismatch(node=m.bn.node, expected=oc if isinstance(oc, int) else -1, found=ms.numel))
    return Success(m)


def _plan(m: _Match) -> RewritePlan:
    conv = m.conv_node
    fold = FoldBatchNorm(
        part="weight",
        weight=m.w,
        bias=m.b,
        mean=m.mean,
        var=m.var,
        gamma=m.gamma,
        beta=m.beta,
        eps=m.bn.eps,
        transposed=m.conv.transposed,
        groups=m.conv.groups,
    )
    w_name, b_name, c_name = f"{conv.name}_bn_weight", f"{conv.name}_bn_bias", f"{conv.name}_bn"
    args, kwargs = respell(conv, {"weight": NodeRef(w_name), "bias": NodeRef(b_name)})
    return RewritePlan(
        rule=NAME,
        anchor=m.bn.node,
        constants=(
            NewConstant(name=w_name, expr=fold),
            NewConstant(name=b_name, expr=replace(fold, part="bias")),
        ),
        nodes=(
            NewNode(name=c_name, target=conv.target, args=args, kwargs=kwargs, spec=conv.spec, provenance=conv.name),
        ),
        replace=tuple((u, c_name) for u in m.uses),
        erase=(conv.name, m.bn.node, *(u for u in m.uses if u != m.bn.node)),
    )


@final
@dataclass(frozen=True, slots=True)
class FuseConvBn:
    """Fold every eval-mode batch norm into the convolution that feeds it."""

    name: str = NAME

    def anchors(self, snap: GraphSnapshot) -> Iterable[NodeSnapshot]:
        """Every batch norm node, in any spelling."""
        return (n for n in snap.nodes if n.op == "call_function" and n.target in BATCH_NORM_SCHEMAS)

    def plan_at(self, snap: GraphSnapshot, node: NodeSnapshot) -> Result[RewritePlan, Reason]:
        """The fusion plan at a batch norm, or the reason it cannot be fused."""
        return _match(snap, node).bind(_check_shapes).map(_plan)


def fuse_conv_bn() -> FuseConvBn:
    """The conv + batch-norm fusion rule.

    >>> fuse_conv_bn().name
    'fuse-conv-bn'
    """
    return FuseConvBn()

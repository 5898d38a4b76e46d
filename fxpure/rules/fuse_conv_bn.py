"""fuse_conv_bn: conv -> eval batch_norm  =>  conv with the batch norm folded into W, b."""

from __future__ import annotations

from returns.result import Result

from fxpure.families import CONV
from fxpure.linear import is_bias_add, is_linear
from fxpure.pattern import Bound, Const, OneOf, Op, PatternRule, Planner, eval_batch_norm, idle, need, rule
from fxpure.plan import RewritePlan
from fxpure.reasons import BadExpr
from fxpure.rules.fuse_linear_bn import read_by
from fxpure.snapshot import GraphSnapshot
from fxpure.weights import FLOAT_DTYPES, WeightExpr, fold_batch_norm

CONV_OP = Op(
    CONV,
    name="conv",
    code="producer-not-conv",
    shared="conv-output-shared",
    weight=Const("w"),
    bias=Const("b", optional=True),
)
# bn(conv(x, w, b?), gamma?, beta?, mean, var, training=False)[0], also through a dropout in eval mode
# (it goes) or a copy (edge spells a linear's eval dropout so: it stays, of the fused conv's output)
PATTERN = eval_batch_norm(
    OneOf(CONV_OP, *idle(CONV_OP, code="producer-not-conv", shared="conv-output-shared"), noun="a convolution")
)


def _plan(
    p: Planner,
    bn: Bound,
    conv: Bound,
    w: WeightExpr,
    b: WeightExpr | None,
    mean: WeightExpr,
    var: WeightExpr,
    gamma: WeightExpr | None,
    beta: WeightExpr | None,
) -> Result[RewritePlan, BadExpr]:
    folded = fold_batch_norm(
        weight=w,
        bias=b,
        mean=mean,
        var=var,
        gamma=gamma,
        beta=beta,
        eps=bn.float("eps"),
        transposed=conv.bool("transposed"),
        groups=conv.int("groups"),
    )

    def emit(wb: tuple[WeightExpr, WeightExpr]) -> RewritePlan:
        weight, bias = p.const(wb[0], f"{conv.name}_bn_weight"), p.const(wb[1], f"{conv.name}_bn_bias")
        new = p.respell(conv, name=f"{conv.name}_bn", weight=weight, bias=bias)
        return p.replace(bn, p.copied(new, "bn"))

    return folded.map(emit)


def _candidate(bn: Bound, snap: GraphSnapshot) -> bool:
    """Every batch norm but one of a linear (``fuse-linear-bn``'s to fuse or decline; read as that
    rule reads it, through a permute, reshape, dropout or copy)."""
    node = read_by(bn, snap)
    return node is None or not (is_linear(snap, node) or is_bias_add(snap, node))


FUSE_CONV_BN = rule(
    "fuse-conv-bn",
    PATTERN,
    need.static("w"),
    need.dtype("w", FLOAT_DTYPES),
    need.channels("mean", of="w", conv="conv"),
    plan=_plan,
    candidate=_candidate,
    repeat=True,  # a batch norm after a fused one (conv, bn, bn) fuses in the next run
)


def fuse_conv_bn() -> PatternRule:
    """The conv + batch-norm fusion rule: every eval batch norm folded into the conv before it.

    >>> from fxpure.reasons import GENERIC_CODES
    >>> sorted(fuse_conv_bn().codes - GENERIC_CODES)
    ['arg-mismatch', 'bn-stats-used', 'bn-training-mode', 'channel-mismatch', 'conv-output-shared', \
'not-constant', 'producer-not-conv', 'runs-exhausted', 'symbolic-shape', 'unsupported-dtype']
    """
    return FUSE_CONV_BN

"""An outside author's rule, written with the public kit only: an eval batch norm becomes a 1x1
depthwise conv of its scale and shift, ``conv2d(x, scale[:, None, None, None], shift, groups=C)``,
for a backend that runs convs and no batch norm (Arm's ``FuseBatchNorm2dPass`` and XNNPACK's
``DecomposeBatchNorm`` do so for one no conv before it takes). ``FUSE_OR_DEPTHWISE`` is
``fuse-conv-bn`` with this rule as its fallback: a batch norm after a conv is folded into it, any
other (after a relu, an add, an input) becomes the depthwise conv. Tested torch-free in
``tests/core/test_bn_to_depthwise_core.py`` and on real programs in ``tests/test_bn_to_depthwise.py``."""

from __future__ import annotations

from dataclasses import replace

from fxpure.pattern import Bound, Planner, Var, eval_batch_norm, need, rule
from fxpure.plan import RewritePlan
from fxpure.rules import fuse_conv_bn
from fxpure.snapshot import NodeRef
from fxpure.weights import FLOAT_DTYPES, Reshape, WeightExpr, batch_norm_affine

# bn(x, gamma?, beta?, mean, var, training=False)[0], whatever x is
PATTERN = eval_batch_norm(Var("x"))


def _depthwise(
    p: Planner,
    bn: Bound,
    x: NodeRef,
    mean: WeightExpr,
    var: WeightExpr,
    gamma: WeightExpr | None = None,
    beta: WeightExpr | None = None,
) -> RewritePlan:
    channels, dtype = p.match.shape("mean")[0], p.match.dtype("x")  # (the stats: static)
    scale, shift = batch_norm_affine(mean=mean, var=var, gamma=gamma, beta=beta, eps=bn.float("eps"), dtype=dtype)
    weight = p.const(Reshape(x=scale, shape=(channels, 1, 1, 1)), f"{bn.name}_dw_weight")
    bias = p.const(shift, f"{bn.name}_dw_bias")
    conv = p.call(
        "aten.conv2d.default", name=f"{bn.name}_dw", spec=bn.spec, input=x, weight=weight, bias=bias, groups=channels
    )
    return p.replace(bn, conv)


bn_to_depthwise = rule(
    "bn-to-depthwise",
    PATTERN,
    need.rank("x", (4,)),  # (N, C, H, W): a BatchNorm2d
    need.dtype("x", FLOAT_DTYPES),
    plan=_depthwise,
)

FUSE_OR_DEPTHWISE = replace(fuse_conv_bn(), name="fuse-or-depthwise", fallback=bn_to_depthwise)

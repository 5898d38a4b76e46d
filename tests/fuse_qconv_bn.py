"""An outside author's rule, written with the public kit only: ``fuse-qconv-bn``. In a PT2E-quantized
program, ``bn(conv(x, dequantize_per_channel(Wq, s, zp=0, axis=0), b))`` becomes one conv whose weight
is a NEW int8 tensor, requantized per output channel with rescaled scales ``s * |k|`` (``k = gamma /
sqrt(var + eps)``; the sign of ``k`` goes into the int8 values), the bias folded, the batch norm gone.
Better than Cadence's ``FuseQuantizedBatchNormWithConv``, which keeps the original scales and so clips
every channel where ``|k| > 1``: here ``q' = round(q * s * k / (s * |k|)) = sign(k) * q``, exact.

A zero ``k`` (gamma 0) would give a zero scale: the new scale is ``max(s * |k|, TINY)`` (TINY = 2**-23,
the floor PT2E's observers use), so such a channel's ``q'`` is 0, exactly what ``q * s * k`` is.

Declined, typed: a batch norm in training mode, a weight not quantized per output channel
(``not-per-channel``), zero points not known to be 0 (``asymmetric-weight``), a range that is not
symmetric, ``[-128, 127]`` (``asymmetric-range``: ``-(-128)`` is out of range), a transposed conv
(``transposed-conv``), a conv whose output another node reads, a non-int8 weight."""

from __future__ import annotations

from returns.result import Result

from fxpure.families import BATCH_NORM, CONV, DEQUANTIZE
from fxpure.pattern import (
    ANY,
    Bound,
    Const,
    Lit,
    Match,
    OneOf,
    Op,
    Planner,
    Scalar,
    dequantized,
    eval_batch_norm,
    need,
    rule,
)
from fxpure.plan import RewritePlan
from fxpure.reasons import BadExpr, Declined, Reason
from fxpure.weights import (
    Binary,
    Cast,
    Dequantize,
    Fill,
    Quantize,
    Unary,
    WeightExpr,
    batch_norm_affine,
    fold_batch_norm,
)

NOT_PER_CHANNEL, ASYMMETRIC, RANGE = "not-per-channel", "asymmetric-weight", "asymmetric-range"
TRANSPOSED = "transposed-conv"
# the least scale, as PT2E's observers floor one (float32's eps): a zero k (gamma 0) would give a zero
# scale, and a far smaller one (1e-30 was tried) overflows the int32 bias XNNPACK quantizes with it
TINY = 2.0**-23

CONV_OP = Op(
    CONV,
    name="conv",
    code="producer-not-conv",
    shared="conv-output-shared",
    transposed=Lit(False, code=TRANSPOSED, text="{node} is a transposed conv"),
    weight=dequantized(
        Const("wq"),
        name="dqw",
        scale=OneOf(Const("scales"), Scalar("scale")),  # (a per-tensor scale: declined not-per-channel)
        zero_point=OneOf(Const("zp", optional=True), Scalar("zp")),  # (None: zeros)
    ),
    bias=Const("b", optional=True),
)
PATTERN = eval_batch_norm(CONV_OP)  # bn(conv(x, dq(Wq), b?), gamma?, beta?, mean, var, training=False)[0]
# the candidates: every batch norm of a conv of a dequantized value (a float conv + bn is fuse-conv-bn's)
CANDIDATE = Op(BATCH_NORM, input=Op(CONV, users=ANY, weight=Op(DEQUANTIZE, users=ANY)))


def _per_channel(dqw: Bound, match: Match, scales: WeightExpr | None = None) -> Reason | None:
    axis = dqw.args.get("axis")
    oc = match.shape("wq")[0]
    spec = match.spec("scales") if scales is not None else None
    if axis == 0 and spec is not None and spec.shape == (oc,):
        return None
    detail = (
        f"{dqw.name}: weight quantized with axis {axis}, scales {spec.shape if spec else None}, not per output channel"
    )
    return Declined(code=NOT_PER_CHANNEL, node=dqw.name, detail=detail)


def _symmetric(dqw: Bound, match: Match) -> Reason | None:
    # (zero_points=None: all 0)
    zps = (0,) if "zp" in match.bindings and match.bindings["zp"] is None else match.values("zp")
    if zps is None or any(zps):
        shown = "unknown" if zps is None else str(zps[:4])
        return Declined(code=ASYMMETRIC, node=dqw.name, detail=f"{dqw.name}: zero points {shown}, not all 0")
    low, high = dqw.int("quant_min"), dqw.int("quant_max")
    if low != -high:
        detail = f"{dqw.name}: range [{low}, {high}]: a negated {low} is out of it"
        return Declined(code=RANGE, node=dqw.name, detail=detail)
    return None


def _fuse(
    p: Planner,
    bn: Bound,
    conv: Bound,
    dqw: Bound,
    wq: WeightExpr,
    mean: WeightExpr,
    var: WeightExpr,
    scales: WeightExpr | None = None,
    zp: WeightExpr | None = None,
    b: WeightExpr | None = None,
    gamma: WeightExpr | None = None,
    beta: WeightExpr | None = None,
) -> Result[RewritePlan, BadExpr]:
    assert scales is not None  # (_per_channel declined a per-tensor scale)
    eps = bn.float("eps")
    fdtype = p.match.dtype("dqw")  # the dequantized weight's float dtype
    low, high = dqw.int("quant_min"), dqw.int("quant_max")
    oc = p.match.shape("wq")[0]
    zeros = zp if zp is not None else Fill(shape=(oc,), value=0, dtype="int64")  # (zero_points=None)
    w = Dequantize(x=wq, scale=scales, zero_point=zeros, axis=0, dtype=fdtype)
    folded = fold_batch_norm(weight=w, bias=b, mean=mean, var=var, gamma=gamma, beta=beta, eps=eps)
    sdtype = p.match.dtype("scales")
    k, _ = batch_norm_affine(mean=mean, var=var, gamma=gamma, beta=beta, eps=eps, dtype=sdtype)  # (k: its scale)
    new_scales = Binary(
        op="maximum", a=Binary(op="mul", a=scales, b=Unary(op="abs", x=k)), b=Fill(shape=(), value=TINY, dtype=sdtype)
    )

    def emit(wb: tuple[WeightExpr, WeightExpr]) -> RewritePlan:
        folded_w, folded_b = wb
        scaled = folded_w if sdtype == fdtype else Cast(x=folded_w, dtype=sdtype)
        new_wq = Quantize(
            x=scaled, scale=new_scales, zero_point=zeros, axis=0, quant_min=low, quant_max=high, dtype="int8"
        )
        weight = p.respell(
            dqw,
            name=f"{dqw.name}_bn",
            input=p.const(new_wq, f"{conv.name}_bn_wq"),  # (an int8 one: a buffer)
            scale=p.const(new_scales, f"{conv.name}_bn_scales", kind="buffer"),  # (else a parameter: it reads gamma)
        )
        new = p.respell(conv, name=f"{conv.name}_bn", weight=weight, bias=p.const(folded_b, f"{conv.name}_bn_bias"))
        return p.replace(bn, new)

    return folded.map(emit)


fuse_qconv_bn = rule(
    "fuse-qconv-bn",
    PATTERN,
    need.static("wq"),
    need.dtype("wq", ("int8",)),
    need.rank("wq", (3, 4, 5)),
    need.check(_per_channel, codes=(NOT_PER_CHANNEL,)),
    need.check(_symmetric, codes=(ASYMMETRIC, RANGE)),
    need.channels("mean", of="wq", conv="conv"),
    plan=_fuse,
    candidate=CANDIDATE,
)

"""The outside author's ``fuse-qconv-bn`` (``tests/fuse_qconv_bn.py``) planned on hand-built
snapshots, torch-free: the new int8 weight, its rescaled scales and the folded bias as expressions,
and every decline, typed and located."""

from __future__ import annotations

import pytest

from fxpure import NodeRef, plan
from fxpure.testing import GraphBuilder, spec
from fxpure.weights import Binary, Fill, Quantize, Reshape, Source, Unary, infer_spec
from tests.fuse_qconv_bn import fuse_qconv_bn


def _graph(
    *,
    zps: tuple[int, ...] | None = (0, 0, 0, 0),
    qrange: tuple[int, int] = (-127, 127),
    per_channel: bool = True,
    axis: int = 0,
    transposed: bool = False,
    training: bool = False,
    shared: bool = False,
    wdtype: str = "int8",
    edge: bool = False,
) -> GraphBuilder:
    g = GraphBuilder(dialect="edge" if edge else "aten", decomposed=edge)
    x = g.input("x", (1, 3, 8, 8))
    wshape = (3, 4, 3, 3) if transposed else (4, 3, 3, 3)
    wq = g.buffer("wq", wshape, wdtype)
    low, high = qrange
    if per_channel:
        scales = g.buffer("scales", (4,))
        zp = None if zps == () else g.buffer("zp", (4,), "int64", values=zps)  # (): zero_points=None
        w = g.call(
            "quantized_decomposed.dequantize_per_channel.default",
            name="dq",
            input=wq,
            scale=scales,
            zero_point=zp,
            axis=axis,
            quant_min=low,
            quant_max=high,
            dtype=wdtype,
            out=wshape,
        )
    else:
        w = g.call(
            "quantized_decomposed.dequantize_per_tensor.default",
            name="dq",
            input=wq,
            scale=0.02,
            zero_point=0,
            quant_min=low,
            quant_max=high,
            dtype=wdtype,
            out=wshape,
        )
    b = g.parameter("b", (4,))
    out = (1, 4, 10, 10) if transposed else (1, 4, 6, 6)
    if edge or transposed:
        conv = g.call(
            "aten.convolution.default",
            name="conv",
            input=x,
            weight=w,
            bias=b,
            stride=[1, 1],
            padding=[0, 0],
            dilation=[1, 1],
            transposed=transposed,
            output_padding=[0, 0],
            groups=1,
            out=out,
        )
    else:
        conv = g.call("aten.conv2d.default", name="conv", input=x, weight=w, bias=b, out=out)
    stats = {k: g.buffer(k, (4,)) for k in ("running_mean", "running_var")}
    affine = {k: g.parameter(k, (4,)) for k in ("weight", "bias")}
    if edge:
        bn = g.call(
            "aten._native_batch_norm_legit_no_training.default",
            name="bn",
            input=conv,
            **affine,
            **stats,
            momentum=0.1,
            eps=1e-3,
            out=(spec(*out), spec(0), spec(0)),
        )
        y = g.getitem(bn, 0, out=out)
    else:
        y = g.call(
            "aten.batch_norm.default",
            name="bn",
            input=conv,
            **affine,
            **stats,
            training=training,
            momentum=0.1,
            eps=1e-3,
            cudnn_enabled=False,
            out=out,
        )
    g.output(g.call("aten.add.Tensor", self=y, other=conv, out=out) if shared else y)
    return g


def _src(g: GraphBuilder, key: str) -> Source:
    return Source(key=key, spec=g.build().constants[key].spec)


@pytest.mark.parametrize("edge", [False, True])
def test_the_conv_reads_a_new_int8_weight_with_rescaled_scales_and_the_batch_norm_goes(edge: bool) -> None:
    g = _graph(edge=edge)
    report = plan(g.build(), [fuse_qconv_bn])
    (p,) = report.plans
    assert not report.rejections and set(p.erase) >= {"bn", "conv"} and p.prune == ("dq",)
    dq, conv = p.nodes
    assert dq.target == "quantized_decomposed.dequantize_per_channel.default"
    assert dq.args[:6] == (NodeRef("conv_bn_wq"), NodeRef("conv_bn_scales"), NodeRef("zp"), 0, -127, 127)
    assert conv.args[:3] == (NodeRef("x"), NodeRef(dq.name), NodeRef("conv_bn_bias"))
    exprs = {c.name: c.expr for c in p.constants}
    k = Binary(
        op="mul",
        a=_src(g, "weight"),
        b=Unary(
            op="rsqrt", x=Binary(op="add", a=_src(g, "running_var"), b=Fill(shape=(), value=1e-3, dtype="float32"))
        ),
    )
    scales = Binary(
        op="maximum",
        a=Binary(op="mul", a=_src(g, "scales"), b=Unary(op="abs", x=k)),
        b=Fill(shape=(), value=2.0**-23, dtype="float32"),
    )
    assert exprs["conv_bn_scales"] == scales
    wq = exprs["conv_bn_wq"]
    assert (
        isinstance(wq, Quantize) and wq.scale == scales and wq.axis == 0 and (wq.quant_min, wq.quant_max) == (-127, 127)
    )
    assert isinstance(wq.x, Binary) and wq.x.b == Reshape(x=k, shape=(4, 1, 1, 1))  # W * k per output channel
    assert infer_spec(wq).unwrap() == spec(4, 3, 3, 3, dtype="int8")
    bias = Binary(
        op="add",
        a=Binary(op="mul", a=Binary(op="sub", a=_src(g, "b"), b=_src(g, "running_mean")), b=k),
        b=_src(g, "bias"),
    )
    assert exprs["conv_bn_bias"] == bias


@pytest.mark.parametrize(
    ("knobs", "code", "path"),
    [
        ({"zps": (0, 0, 1, 0)}, "asymmetric-weight", "bn.input/conv.weight/dqw"),
        ({"zps": None}, "asymmetric-weight", "bn.input/conv.weight/dqw"),  # (values unknown)
        ({"qrange": (-128, 127)}, "asymmetric-range", "bn.input/conv.weight/dqw"),
        ({"per_channel": False}, "not-per-channel", "bn.input/conv.weight/dqw"),
        ({"axis": 1}, "not-per-channel", "bn.input/conv.weight/dqw"),
        ({"transposed": True}, "transposed-conv", "bn.input/conv.transposed"),
        ({"training": True}, "bn-training-mode", "bn.training"),
        ({"shared": True}, "conv-output-shared", "bn.input/conv"),
        ({"wdtype": "int32"}, "unsupported-dtype", "bn.input/conv.weight/dqw.input"),
    ],
)
def test_what_it_cannot_fold_exactly_is_declined_saying_where(knobs: dict[str, object], code: str, path: str) -> None:
    report = plan(_graph(**knobs).build(), [fuse_qconv_bn])  # type: ignore[arg-type]
    (no,) = report.rejections
    assert not report.plans and (no.node, no.reason.code, no.reason.path) == ("bn", code, path), no.reason


def test_a_float_conv_and_batch_norm_is_no_candidate() -> None:
    g = GraphBuilder()
    x = g.input("x", (1, 3, 8, 8))
    conv = g.call("aten.conv2d.default", name="conv", input=x, weight=g.parameter("w", (4, 3, 3, 3)), out=(1, 4, 6, 6))
    stats = {k: g.buffer(k, (4,)) for k in ("running_mean", "running_var")}
    g.output(
        g.call(
            "aten.batch_norm.default",
            name="bn",
            input=conv,
            weight=None,
            bias=None,
            **stats,
            training=False,
            momentum=0.1,
            eps=1e-3,
            cudnn_enabled=False,
            out=(1, 4, 6, 6),
        )
    )
    report = plan(g.build(), [fuse_qconv_bn])
    assert not report.plans and not report.rejections


def test_zero_points_none_are_zeros_and_the_new_weight_is_a_buffer() -> None:
    report = plan(_graph(zps=()).build(), [fuse_qconv_bn])
    (p,) = report.plans
    assert not report.rejections and p.nodes[0].args[2] is None  # (the new dequantize: zero_points None still)
    kinds = {c.name: c.kind for c in p.constants}
    assert kinds == {"conv_bn_wq": "buffer", "conv_bn_scales": "buffer", "conv_bn_bias": "parameter"}

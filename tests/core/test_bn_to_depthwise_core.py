"""The outside author's ``bn-to-depthwise`` rule (``tests/bn_to_depthwise.py``) planned on hand-built
snapshots, torch-free: the depthwise conv and its weights as expressions, its declines, and
``fuse-or-depthwise``, fuse-conv-bn with it as the fallback."""

from __future__ import annotations

import pytest

from fxpure import NodeRef, plan
from fxpure.testing import GraphBuilder, spec
from fxpure.weights import Binary, Cast, Fill, Reshape, Source, Unary
from tests.bn_to_depthwise import FUSE_OR_DEPTHWISE, bn_to_depthwise


def _bn(producer: str = "relu", *, rank: int = 4, training: bool = False, dtype: str = "float32") -> GraphBuilder:
    g = GraphBuilder()
    shape = (2, 4, 5, 5)[:rank]
    x = g.input("x", shape, dtype)
    if producer == "conv":
        y = g.call(
            "aten.conv2d.default",
            name="p",
            input=x,
            weight=g.parameter("w", (4, 4, 1, 1), dtype),
            out=spec(*shape, dtype=dtype),
        )
    else:
        y = g.call("aten.relu.default", name="p", self=x, out=spec(*shape, dtype=dtype))
    stats = {k: g.buffer(k, (4,), dtype) for k in ("running_mean", "running_var")}
    affine = {k: g.parameter(k, (4,), dtype) for k in ("weight", "bias")}
    bn = g.call(
        "aten.batch_norm.default",
        name="bn",
        input=y,
        **affine,
        **stats,
        training=training,
        momentum=0.1,
        eps=1e-3,
        cudnn_enabled=False,
        out=spec(*shape, dtype=dtype),
    )
    g.output(bn)
    return g


def _source(g: GraphBuilder, key: str) -> Source:
    return Source(key=key, spec=g.build().constants[key].spec)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_batch_norm_becomes_a_depthwise_conv_of_its_scale_and_shift(dtype: str) -> None:
    g = _bn(dtype=dtype)
    report = plan(g.build(), [bn_to_depthwise])
    (p,) = report.plans
    assert not report.rejections and p.erase == ("bn",)
    (conv,) = p.nodes
    assert conv.target == "aten.conv2d.default" and conv.spec == spec(2, 4, 5, 5, dtype=dtype)
    # conv2d(input, weight, bias, stride, padding, dilation, groups): 1x1, one group per channel
    assert conv.args == (NodeRef("p"), NodeRef("bn_dw_weight"), NodeRef("bn_dw_bias"), (1, 1), (0, 0), (1, 1), 4)
    # scale = gamma / sqrt(var + eps), shift = beta - mean * scale, computed in float32
    wide = {
        k: _source(g, k) if dtype == "float32" else Cast(x=_source(g, k), dtype="float32") for k in g.build().constants
    }
    scale = Binary(
        op="mul",
        a=wide["weight"],
        b=Unary(op="rsqrt", x=Binary(op="add", a=wide["running_var"], b=Fill(shape=(), value=1e-3, dtype="float32"))),
    )
    shift = Binary(op="sub", a=wide["bias"], b=Binary(op="mul", a=wide["running_mean"], b=scale))

    def back(e: Binary) -> Binary | Cast:
        return e if dtype == "float32" else Cast(x=e, dtype=dtype)

    exprs = {c.name: c.expr for c in p.constants}
    assert exprs == {"bn_dw_weight": Reshape(x=back(scale), shape=(4, 1, 1, 1)), "bn_dw_bias": back(shift)}


@pytest.mark.parametrize(
    ("knobs", "code", "path"),
    [
        ({"rank": 3}, "unsupported-rank", "bn.input"),  # a BatchNorm1d
        ({"training": True}, "bn-training-mode", "bn.training"),
        ({"dtype": "int32"}, "unsupported-dtype", "bn.input"),
    ],
)
def test_what_it_cannot_write_as_a_depthwise_conv_is_declined_saying_where(
    knobs: dict[str, object], code: str, path: str
) -> None:
    rank, training, dtype = knobs.get("rank", 4), knobs.get("training", False), knobs.get("dtype", "float32")
    assert isinstance(rank, int) and isinstance(training, bool) and isinstance(dtype, str)
    report = plan(_bn(rank=rank, training=training, dtype=dtype).build(), [bn_to_depthwise])
    (no,) = report.rejections
    assert not report.plans and (no.node, no.reason.code, no.reason.path) == ("bn", code, path)


@pytest.mark.parametrize("producer", ["conv", "relu"])
def test_fuse_or_depthwise_folds_a_batch_norm_into_its_conv_and_makes_any_other_a_depthwise_conv(
    producer: str,
) -> None:
    report = plan(_bn(producer).build(), [FUSE_OR_DEPTHWISE])
    (p,) = report.plans
    assert not report.rejections and p.rule == "fuse-or-depthwise" and set(p.erase) >= {"bn"}
    if producer == "conv":  # folded: the conv respelled with the batch norm's weights, no new conv
        assert p.instead_of is None and {c.name for c in p.constants} == {"p_bn_weight", "p_bn_bias"}
    else:  # the fallback's plan, with the reason it stands in for
        assert p.instead_of is not None and p.instead_of.code == "producer-not-conv"
        assert {c.name for c in p.constants} == {"bn_dw_weight", "bn_dw_bias"}

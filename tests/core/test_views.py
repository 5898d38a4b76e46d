"""conv_view and batch_norm_view on hand-built snapshots: the full record for each spelling,
and the exact reason when a node cannot be read as a convolution or a batch norm."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fxpure import BatchNormView, ConvView, GraphSnapshot, NodeRef, batch_norm_view, conv_view
from fxpure.reasons import Malformed
from fxpure.snapshot import Arg
from fxpure.testing import GraphBuilder

X, W, B = NodeRef("x"), NodeRef("w"), NodeRef("b")
MEAN, VAR, GAMMA, BETA = NodeRef("mean"), NodeRef("var"), NodeRef("gamma"), NodeRef("beta")
CONV = ConvView(
    node="conv",
    x=X,
    w=W,
    b=B,
    stride=(1, 1),
    padding=(0, 0),
    dilation=(1, 1),
    transposed=False,
    output_padding=(0, 0),
    groups=1,
)


def _conv_graph(target: str, w_shape: tuple[int, ...], **args: Arg) -> GraphSnapshot:
    g = GraphBuilder()
    g.parameter("w", w_shape)
    g.parameter("b", (w_shape[0],))
    g.input("x", (1, 4, *(8,) * (len(w_shape) - 2)))
    g.output(g.call(target, name="conv", out=None, input=X, weight=W, **args))
    return g.build()


@pytest.mark.parametrize(
    ("target", "w_shape", "args", "want"),
    [
        ("aten.conv2d.default", (8, 4, 3, 3), {}, replace(CONV, b=None)),
        (
            "aten.conv2d.default",
            (8, 2, 3, 3),
            {"bias": B, "stride": 2, "padding": (1, 0), "dilation": (1, 2), "groups": 2},
            replace(CONV, stride=(2, 2), padding=(1, 0), dilation=(1, 2), groups=2),
        ),
        (
            "aten.conv1d.padding",
            (8, 4, 3),
            {"bias": B, "padding": "same", "dilation": 3},
            replace(CONV, stride=(1,), padding="same", dilation=(3,), output_padding=(0,)),
        ),
        (
            "aten.conv_transpose2d.input",
            (4, 8, 3, 3),
            {"bias": B, "stride": (2, 1), "padding": 1, "output_padding": (1, 0), "dilation": 2},
            replace(CONV, stride=(2, 1), padding=(1, 1), dilation=(2, 2), transposed=True, output_padding=(1, 0)),
        ),
        (
            "aten.convolution.default",
            (8, 4, 3, 3, 3),
            {
                "bias": B,
                "stride": (1, 2, 3),
                "padding": (0, 1, 2),
                "dilation": (3, 2, 1),
                "transposed": False,
                "output_padding": (0, 0, 0),
                "groups": 4,
            },
            replace(
                CONV,
                stride=(1, 2, 3),
                padding=(0, 1, 2),
                dilation=(3, 2, 1),
                output_padding=(0, 0, 0),
                groups=4,
            ),
        ),
    ],
)
def test_conv_view_reads_every_spelling(
    target: str, w_shape: tuple[int, ...], args: dict[str, Arg], want: ConvView
) -> None:
    snap = _conv_graph(target, w_shape, **args)
    view = conv_view(snap, snap.node("conv")).unwrap()
    assert view == want
    assert view.rank == len(w_shape) - 2


def test_conv_view_rejects_a_number_as_bias() -> None:
    snap = _conv_graph("aten.conv2d.default", (8, 4, 3, 3), bias=2.0)
    got = conv_view(snap, snap.node("conv")).failure()
    assert got == Malformed(node="conv", detail="bias is 2.0, expected a tensor")
    assert got.message == "conv: bias is 2.0, expected a tensor"


def _bn_graph(target: str, **args: Arg) -> GraphSnapshot:
    g = GraphBuilder()
    for name in ("mean", "var", "gamma", "beta"):
        g.buffer(name, (4,))
    g.input("x", (1, 4, 8, 8))
    g.input("s", ())
    g.output(g.call(target, name="bn", out=None, **{"input": X, "momentum": 0.1, "eps": 1e-3, **args}))
    return g.build()


BN_FULL: dict[str, Arg] = {"weight": GAMMA, "bias": BETA, "running_mean": MEAN, "running_var": VAR}
BN = BatchNormView(
    node="bn", x=X, weight=GAMMA, bias=BETA, mean=MEAN, var=VAR, training=False, eps=1e-3, tuple_output=True
)


@pytest.mark.parametrize(
    ("target", "args", "want"),
    [
        (
            "aten.batch_norm.default",
            {**BN_FULL, "training": False, "cudnn_enabled": False},
            replace(BN, tuple_output=False),
        ),
        ("aten.native_batch_norm.default", {**BN_FULL, "training": True}, replace(BN, training=True)),
        (
            "aten._native_batch_norm_legit.default",
            {"weight": None, "bias": BETA, "running_mean": MEAN, "running_var": VAR, "training": False},
            replace(BN, weight=None),
        ),
        (
            "aten._native_batch_norm_legit.no_stats",
            {"weight": GAMMA, "bias": None, "training": True},
            replace(BN, bias=None, mean=None, var=None, training=True),
        ),
        ("aten._native_batch_norm_legit_no_training.default", BN_FULL, BN),
        ("aten._native_batch_norm_legit_no_training.default", {**BN_FULL, "eps": 1}, replace(BN, eps=1.0)),
    ],
)
def test_batch_norm_view_reads_every_spelling(target: str, args: dict[str, Arg], want: BatchNormView) -> None:
    snap = _bn_graph(target, **args)
    view = batch_norm_view(snap, snap.node("bn")).unwrap()
    assert view == want
    assert type(view.eps) is float


@pytest.mark.parametrize(
    ("args", "detail"),
    [
        ({**BN_FULL, "input": 1.0}, "an operand is not a tensor"),
        ({**BN_FULL, "weight": 2.0}, "an operand is not a tensor"),
        ({**BN_FULL, "running_var": 1}, "an operand is not a tensor"),
        ({**BN_FULL, "eps": NodeRef("s")}, "eps=NodeRef(name='s'), training=False"),
    ],
)
def test_batch_norm_view_rejects_malformed_arguments(args: dict[str, Arg], detail: str) -> None:
    snap = _bn_graph("aten._native_batch_norm_legit_no_training.default", **args)
    assert batch_norm_view(snap, snap.node("bn")).failure() == Malformed(node="bn", detail=detail)


def test_views_reject_the_other_op() -> None:
    bn = _bn_graph("aten._native_batch_norm_legit_no_training.default", **BN_FULL)
    conv = _conv_graph("aten.conv2d.default", (8, 4, 3, 3))
    assert batch_norm_view(conv, conv.node("conv")).failure() == Malformed(
        node="conv", detail="aten.conv2d.default is not a batch norm"
    )
    assert conv_view(bn, bn.node("bn")).failure() == Malformed(
        node="bn", detail="aten._native_batch_norm_legit_no_training.default is not a convolution"
    )

"""The core tests' snapshots, each with knobs for every plan shape and rejection; built with
the public, torch-free ``fxpure.testing.GraphBuilder``."""

from __future__ import annotations

from typing import Literal

from fxpure.snapshot import Arg, DTypeArg, GraphSnapshot, NodeRef
from fxpure.testing import GraphBuilder, spec

__all__ = ["BN_TARGETS", "CONV_TARGETS", "conv_bn", "grouped_conv", "qconv", "spec"]

BN_TARGETS = (
    "aten.batch_norm.default",
    "aten.native_batch_norm.default",
    "aten._native_batch_norm_legit_no_training.default",
)
CONV_TARGETS = (
    "aten.conv2d.default",
    "aten.convolution.default",
    "aten.conv_transpose2d.input",
)


def _conv(
    target: str, x: Arg, w: Arg, b: Arg, groups: int, *, transposed: bool = False, rank: int = 2
) -> dict[str, Arg]:
    """Arguments of a conv in the spelling ``target``, stride 1, no padding."""
    one, zero = (1,) * rank, (0,) * rank
    args: dict[str, Arg] = {"input": x, "weight": w, "bias": b, "stride": one, "padding": zero, "dilation": one}
    if target == "aten.convolution.default":
        args.update(transposed=transposed, output_padding=zero)
    elif target.startswith("aten.conv_transpose"):
        args.update(output_padding=zero)
    return {**args, "groups": groups}


def conv_bn(
    *,
    conv_target: str = "aten.conv2d.default",
    bn_target: str = "aten.batch_norm.default",
    bias: bool = True,
    affine: bool = True,
    groups: int = 1,
    lifted: bool = True,
    training: bool = False,
    weight_is_input: bool = False,
    conv_extra_user: bool = False,
    conv_reader: str = "",  # a node "width" = conv_reader(conv, 3), also an output (aten.sym_size.int, say)
    stats_used: bool = False,
    weight_dtype: str = "float32",
    bn_channels: int = 8,
    channels: int | str = 8,
) -> GraphSnapshot:
    """x -> conv(W, b) -> batch_norm -> output, with knobs for every rejection reason."""
    g = GraphBuilder(lifted=lifted)
    transposed = conv_target == "aten.conv_transpose2d.input"
    oc = 8
    w_shape: tuple[int | str, ...] = (4, oc // groups, 3, 3) if transposed else (oc, 4 // groups, 3, 3)
    if isinstance(channels, str):
        w_shape = (channels, *w_shape[1:])
    w = None if weight_is_input else g.parameter("w", w_shape, weight_dtype, key="m.w")
    b = g.parameter("b", (oc,), key="m.b") if bias else None
    mean, var = g.parameter("mean", (bn_channels,), key="m.mean"), g.parameter("var", (bn_channels,), key="m.var")
    gamma, beta = (
        (g.parameter("gamma", (bn_channels,), key="m.gamma"), g.parameter("beta", (bn_channels,), key="m.beta"))
        if affine
        else (None, None)
    )
    x = g.input("x", (1, 4, 8, 8))
    if w is None:
        w = g.input("w", w_shape)
    out = spec(1, oc, 6, 6)
    conv = g.call(conv_target, name="conv", out=out, **_conv(conv_target, x, w, b, groups))
    bn_args: dict[str, Arg] = {"input": conv, "weight": gamma, "bias": beta, "running_mean": mean, "running_var": var}
    if bn_target != "aten._native_batch_norm_legit_no_training.default":
        bn_args["training"] = training
    bn_args.update(momentum=0.1, eps=1e-5)
    if bn_target == "aten.batch_norm.default":
        bn_args["cudnn_enabled"] = False
        bn = g.call(bn_target, name="bn", out=out, **bn_args)
        result: list[Arg] = [bn]
    else:
        bn = g.call(bn_target, name="bn", out=(out, spec(0), spec(0)), **bn_args)
        result = [g.getitem(bn, 0, name="bn_0", out=out)]
        if stats_used:
            result.append(g.getitem(bn, 1, name="bn_1"))
    if conv_extra_user:
        result.append(conv)
    if conv_reader:
        result.append(g.node(conv_reader, (conv, 3), name="width"))
    g.output(*result)
    return g.build()


def grouped_conv(
    *,
    groups: int = 4,
    cin: int = 8,
    cout: int = 12,
    rank: int = 2,
    bias: bool = True,
    target: str = "aten.conv2d.default",
    transposed: bool = False,
    weight_is_input: bool = False,
    bias_is_input: bool = False,
    batch: int | str = 1,
    channels: int | str | None = None,
    lifted: bool = True,
) -> GraphSnapshot:
    """x -> conv(W, b, groups) -> output, in the spelling ``target``."""
    g = GraphBuilder(lifted=lifted)
    w_shape = (cin, cout // groups, *(3,) * rank) if transposed else (cout, cin // groups, *(3,) * rank)
    w = g.input("w", w_shape) if weight_is_input else g.parameter("w", w_shape, key="m.w")
    b = None
    if bias:
        b = g.input("b", (cout,)) if bias_is_input else g.parameter("b", (cout,), key="m.b")
    x = g.input("x", (batch, cin if channels is None else channels, *(6,) * rank))
    args = _conv(target, x, w, b, groups, transposed=transposed, rank=rank)
    g.output(g.call(target, name="conv", out=(batch, cout, *(4,) * rank), **args))
    return g.build()


def qconv(
    *,
    cin: int = 8,
    cout: int = 8,
    k: int = 3,
    rank: int = 2,
    groups: int = 1,
    transposed: bool = False,
    stride: int = 1,
    padding: int = 1,
    dilation: int = 1,
    bias: bool = True,
    relu: bool | Literal["in_place"] = True,
    per_channel: bool = True,
    axis: int | None = None,
    zeros: tuple[int, ...] | None = None,
    weight_is_input: bool = False,
    bias_is_input: bool = False,
    float_weight: bool = False,
    float_input: bool = False,
    float_output: bool = False,
    extra_user: bool = False,
    act_dtype: str = "int8",
    channels: int | str | None = None,
    convs: int = 1,
    out_range: tuple[int, int] = (-128, 127),
) -> GraphSnapshot:
    """int8 x -> dq -> conv(dq(int8 W), b) -> [relu] -> q -> output, repeated ``convs`` times on one
    weight (``cin == cout``); knobs for every kernel and every rejection."""
    g = GraphBuilder(dialect="edge")
    sp = (k,) * rank
    w_shape = (cin, cout // groups, *sp) if transposed else (cout, cin // groups, *sp)
    n_scales = w_shape[1 if transposed else 0]
    i8 = DTypeArg(act_dtype)
    scales = g.buffer("scales", (n_scales,), key="s")
    zp = g.buffer("zp", (n_scales,), "int64", key="z", values=zeros or (0,) * n_scales)
    w = g.input("w", w_shape, "int8") if weight_is_input else g.buffer("w", w_shape, "int8")
    b = None
    if bias:
        b = g.input("b", (cout,)) if bias_is_input else g.parameter("b", (cout,))
    x_c = cin if channels is None else channels
    hw = (8,) * rank
    prev = g.input("x", (1, x_c, *hw), act_dtype)
    for i in range(convs):
        name = f"conv{i}" if convs > 1 else "conv"
        act = spec(1, x_c, *hw)
        dqx = g.call(
            "quantized_decomposed.dequantize_per_tensor.default",
            name=f"dqx{i}",
            out=act,
            **_qparams(prev, 0.02, 3, i8),
        )
        if per_channel:
            dqw = g.call(
                "quantized_decomposed.dequantize_per_channel.default",
                name=f"dqw{i}",
                out=w_shape,
                input=w,
                scale=scales,
                zero_point=zp,
                axis=1 if transposed else 0 if axis is None else axis,
                quant_min=-127,
                quant_max=127,
                dtype=DTypeArg("int8"),
            )
        else:
            dqw = g.call(
                "quantized_decomposed.dequantize_per_tensor.default",
                name=f"dqw{i}",
                out=w_shape,
                **_qparams(w, 0.01, zeros[0] if zeros else 0, DTypeArg("int8"), low=-127),
            )
        x_in, w_in = prev if float_input else dqx, w if float_weight else dqw
        args = _conv("aten.convolution.default", x_in, w_in, b, groups, rank=rank)
        args.update(
            stride=(stride,) * rank, padding=(padding,) * rank, dilation=(dilation,) * rank, transposed=transposed
        )
        out = spec(1, cout, *hw)
        last = g.call("aten.convolution.default", name=name, out=out, **args)
        if relu:
            relu_target = "aten.relu_.default" if relu == "in_place" else "aten.relu.default"
            last = g.call(relu_target, name=f"relu{i}", out=out, self=last)
        if not float_output:
            q = {**_qparams(last, 0.05, -1, i8), "quant_min": out_range[0], "quant_max": out_range[1]}
            last = g.call(
                "quantized_decomposed.quantize_per_tensor.default",
                name=f"q{i}",
                out=spec(1, cout, *hw, dtype=act_dtype),
                **q,
            )
        prev = last
    g.output(prev, *([NodeRef("conv")] if extra_user else []))
    return g.build()


def _qparams(x: NodeRef, scale: float, zero: int, dtype: DTypeArg, *, low: int = -128) -> dict[str, Arg]:
    return {"input": x, "scale": scale, "zero_point": zero, "quant_min": low, "quant_max": 127, "dtype": dtype}

"""Hand-built snapshots for core tests: no torch, microseconds each."""

from __future__ import annotations

from pyrsistent import pmap

from fxpure.snapshot import Arg, ConstantInfo, DTypeArg, GraphSnapshot, NodeRef, NodeSnapshot, TensorSpec, snapshot

BN_ARGS = {
    "aten.batch_norm.default": lambda bn, t: (*bn, t, 0.1, 1e-5, False),
    "aten.native_batch_norm.default": lambda bn, t: (*bn, t, 0.1, 1e-5),
    "aten._native_batch_norm_legit_no_training.default": lambda bn, t: (*bn, 0.1, 1e-5),
}
CONV_TARGETS = (
    "aten.conv2d.default",
    "aten.convolution.default",
    "aten.conv_transpose2d.input",
)


def spec(*shape: int | str, dtype: str = "float32") -> TensorSpec:
    return TensorSpec(shape=shape, dtype=dtype)


def _conv_args(target: str, x: Arg, w: Arg, b: Arg, groups: int) -> tuple[Arg, ...]:
    if target == "aten.convolution.default":
        transposed = False
        return (x, w, b, (1, 1), (0, 0), (1, 1), transposed, (0, 0), groups)
    if target == "aten.conv_transpose2d.input":
        return (x, w, b, (1, 1), (0, 0), (0, 0), groups)
    return (x, w, b, (1, 1), (0, 0), (1, 1), groups)


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
    stats_used: bool = False,
    weight_dtype: str = "float32",
    bn_channels: int = 8,
    channels: int | str = 8,
) -> GraphSnapshot:
    """x -> conv(W, b) -> batch_norm -> output, with knobs for every rejection reason."""
    transposed = conv_target == "aten.conv_transpose2d.input"
    oc = 8
    w_shape = (4, oc // groups, 3, 3) if transposed else (oc, 4 // groups, 3, 3)
    if isinstance(channels, str):
        w_shape = (channels, *w_shape[1:])  # type: ignore[assignment]
    out = spec(1, oc, 6, 6)
    const_op = "placeholder" if lifted else "get_attr"
    consts: dict[str, TensorSpec] = {"w": spec(*w_shape, dtype=weight_dtype)}
    if bias:
        consts["b"] = spec(oc)
    consts.update({"mean": spec(bn_channels), "var": spec(bn_channels)})
    if affine:
        consts.update({"gamma": spec(bn_channels), "beta": spec(bn_channels)})
    if weight_is_input:
        del consts["w"]
    nodes = [NodeSnapshot(name=k, op=const_op, target=k, spec=s) for k, s in consts.items()]
    nodes.append(NodeSnapshot(name="x", op="placeholder", target="x", spec=spec(1, 4, 8, 8)))
    if weight_is_input:
        nodes.append(NodeSnapshot(name="w", op="placeholder", target="w", spec=spec(*w_shape)))
    conv_args = _conv_args(conv_target, NodeRef("x"), NodeRef("w"), NodeRef("b") if bias else None, groups)
    if conv_target == "aten.convolution.default" and transposed:
        conv_args = conv_args[:6] + (True,) + conv_args[7:]
    nodes.append(NodeSnapshot(name="conv", op="call_function", target=conv_target, args=conv_args, spec=out))
    g, bt = (NodeRef("gamma"), NodeRef("beta")) if affine else (None, None)
    bn_in = (NodeRef("conv"), g, bt, NodeRef("mean"), NodeRef("var"))
    tuple_out = bn_target != "aten.batch_norm.default"
    bn_spec = (out, spec(0), spec(0)) if tuple_out else out
    nodes.append(
        NodeSnapshot(
            name="bn", op="call_function", target=bn_target, args=BN_ARGS[bn_target](bn_in, training), spec=bn_spec
        )
    )
    result: list[Arg] = [NodeRef("bn")]
    if tuple_out:
        nodes.append(NodeSnapshot(name="bn_0", op="call_function", target="getitem", args=(NodeRef("bn"), 0), spec=out))
        result = [NodeRef("bn_0")]
        if stats_used:
            nodes.append(NodeSnapshot(name="bn_1", op="call_function", target="getitem", args=(NodeRef("bn"), 1)))
            result.append(NodeRef("bn_1"))
    if conv_extra_user:
        result.append(NodeRef("conv"))
    nodes.append(NodeSnapshot(name="output", op="output", target="output", args=(tuple(result),), kwargs=pmap()))
    constants = {k: ConstantInfo(kind="parameter", key=f"m.{k}", spec=s) for k, s in consts.items()}
    return snapshot(nodes, constants, lifted=lifted)


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
    sp = (6,) * rank
    w_shape = (cin, cout // groups, *(3,) * rank) if transposed else (cout, cin // groups, *(3,) * rank)
    x_spec = spec(batch, cin if channels is None else channels, *sp)
    out = spec(batch, cout, *(4,) * rank)
    const_op = "placeholder" if lifted else "get_attr"
    nodes = [NodeSnapshot(name="w", op="placeholder" if weight_is_input else const_op, target="w", spec=spec(*w_shape))]
    consts = {} if weight_is_input else {"w": ConstantInfo(kind="parameter", key="m.w", spec=spec(*w_shape))}
    if bias:
        nodes.append(
            NodeSnapshot(name="b", op="placeholder" if bias_is_input else const_op, target="b", spec=spec(cout))
        )
        if not bias_is_input:
            consts["b"] = ConstantInfo(kind="parameter", key="m.b", spec=spec(cout))
    nodes.append(NodeSnapshot(name="x", op="placeholder", target="x", spec=x_spec))
    one, zero = (1,) * rank, (0,) * rank
    b: Arg = NodeRef("b") if bias else None
    if target == "aten.convolution.default":
        args: tuple[Arg, ...] = (NodeRef("x"), NodeRef("w"), b, one, zero, one, transposed, zero, groups)
    else:
        args = (NodeRef("x"), NodeRef("w"), b, one, zero, one, groups)
    nodes.append(NodeSnapshot(name="conv", op="call_function", target=target, args=args, spec=out))
    nodes.append(NodeSnapshot(name="output", op="output", target="output", args=((NodeRef("conv"),),)))
    return snapshot(nodes, consts, lifted=lifted)


DQ_T = "quantized_decomposed.dequantize_per_tensor.default"
DQ_C = "quantized_decomposed.dequantize_per_channel.default"
Q_T = "quantized_decomposed.quantize_per_tensor.default"


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
    relu: bool = True,
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
) -> GraphSnapshot:
    """int8 x -> dq -> conv(dq(int8 W), b) -> [relu] -> q -> output, repeated ``convs`` times on one
    weight (``cin == cout``); knobs for every kernel and every rejection."""
    sp = (k,) * rank
    w_shape = (cin, cout // groups, *sp) if transposed else (cout, cin // groups, *sp)
    n_scales = w_shape[1 if transposed else 0]
    i8 = DTypeArg(act_dtype)
    consts: dict[str, ConstantInfo] = {
        "scales": ConstantInfo(kind="buffer", key="s", spec=spec(n_scales)),
        "zp": ConstantInfo(kind="buffer", key="z", spec=spec(n_scales, dtype="int64"), values=zeros or (0,) * n_scales),
    }
    if not weight_is_input:
        consts["w"] = ConstantInfo(kind="buffer", key="w", spec=spec(*w_shape, dtype="int8"))
    if bias and not bias_is_input:
        consts["b"] = ConstantInfo(kind="parameter", key="b", spec=spec(cout))
    nodes = [NodeSnapshot(name=k_, op="placeholder", target=k_, spec=c.spec) for k_, c in consts.items()]
    if weight_is_input:
        nodes.append(NodeSnapshot(name="w", op="placeholder", target="w", spec=spec(*w_shape, dtype="int8")))
    if bias_is_input:
        nodes.append(NodeSnapshot(name="b", op="placeholder", target="b", spec=spec(cout)))
    x_c = cin if channels is None else channels
    nodes.append(NodeSnapshot(name="x", op="placeholder", target="x", spec=spec(1, x_c, 8, 8, dtype=act_dtype)))
    w_dq: tuple[Arg, ...] = (
        (NodeRef("w"), NodeRef("scales"), NodeRef("zp"), 1 if transposed else 0 if axis is None else axis)
        if per_channel
        else (NodeRef("w"), 0.01, zeros[0] if zeros else 0)
    )
    prev = "x"
    for i in range(convs):
        c, out = f"conv{i}" if convs > 1 else "conv", spec(1, cout, 8, 8)
        nodes.append(
            NodeSnapshot(
                name=f"dqx{i}",
                op="call_function",
                target=DQ_T,
                args=(NodeRef(prev), 0.02, 3, -128, 127, i8),
                spec=spec(1, x_c, 8, 8),
            )
        )
        target = DQ_C if per_channel else DQ_T
        nodes.append(
            NodeSnapshot(
                name=f"dqw{i}",
                op="call_function",
                target=target,
                args=(*w_dq, -127, 127, DTypeArg("int8")),
                spec=spec(*w_shape),
            )
        )
        x_in = NodeRef(prev) if float_input else NodeRef(f"dqx{i}")
        w_in = NodeRef("w") if float_weight else NodeRef(f"dqw{i}")
        b: Arg = NodeRef("b") if bias else None
        args: tuple[Arg, ...] = (x_in, w_in, b, (stride,) * rank, (padding,) * rank, (dilation,) * rank)
        args += (transposed, (0,) * rank, groups)
        nodes.append(NodeSnapshot(name=c, op="call_function", target="aten.convolution.default", args=args, spec=out))
        last = c
        if relu:
            nodes.append(
                NodeSnapshot(
                    name=f"relu{i}", op="call_function", target="aten.relu.default", args=(NodeRef(c),), spec=out
                )
            )
            last = f"relu{i}"
        if not float_output:
            q_args = (NodeRef(last), 0.05, -1, -128, 127, i8)
            nodes.append(
                NodeSnapshot(
                    name=f"q{i}", op="call_function", target=Q_T, args=q_args, spec=spec(1, cout, 8, 8, dtype=act_dtype)
                )
            )
            last = f"q{i}"
        prev = last
    result: list[Arg] = [NodeRef(prev)]
    if extra_user:
        result.append(NodeRef("conv"))
    nodes.append(NodeSnapshot(name="output", op="output", target="output", args=(tuple(result),)))
    return snapshot(nodes, consts, dialect="edge")

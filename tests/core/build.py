"""Hand-built snapshots for core tests: no torch, microseconds each."""

from __future__ import annotations

from pyrsistent import pmap

from fxpure.snapshot import Arg, ConstantInfo, GraphSnapshot, NodeRef, NodeSnapshot, TensorSpec, snapshot

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

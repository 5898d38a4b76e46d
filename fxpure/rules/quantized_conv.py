"""quantized_conv: dq(x) -> conv(dq(w_int8)) -> [relu] -> q  =>  et_vk.q8ta_conv2d{,_pw,_dw,_transposed}.

The int8 weight is re-laid-out for the chosen Vulkan kernel, padded to the texel
width ``align``, and summed per output channel; all of it as ``WeightExpr`` plans,
so a weight shared by several convs is packed once per distinct packing and the
unpacked original is dropped once nothing reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import final

from returns.result import Failure, Result, Success

from fxpure.plan import NewConstant, NewNode, RewritePlan, constant_operand
from fxpure.reasons import (
    AsymmetricWeight,
    ChannelAlignment,
    Malformed,
    NoKernel,
    NotQuantized,
    OutputShared,
    Reason,
    SymbolicShape,
    UnsupportedDtype,
    UnsupportedRank,
    first_failure,
)
from fxpure.snapshot import Arg, ConstantKind, DTypeArg, GraphSnapshot, NodeRef, NodeSnapshot, TensorSpec
from fxpure.views import CONV_SCHEMAS, ConvView, conv_view
from fxpure.weights import Fill, PadTo, Permute, Reshape, SumOver, WeightExpr, infer_spec

NAME = "quantized-conv"
DQ_TENSOR = "quantized_decomposed.dequantize_per_tensor.default"
DQ_CHANNEL = "quantized_decomposed.dequantize_per_channel.default"
Q_TENSOR = "quantized_decomposed.quantize_per_tensor.default"
RELU = "aten.relu.default"

# kernel -> op; the choice is made in _kernel, the weight layout in LAYOUTS
KERNELS: Mapping[str, str] = {
    "transposed": "et_vk.q8ta_conv2d_transposed.default",
    "dw": "et_vk.q8ta_conv2d_dw.default",
    "pw": "et_vk.q8ta_conv2d_pw.default",
    "im2col": "et_vk.q8ta_conv2d.default",
}


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class Geometry:
    """Channel and kernel sizes of a 2D conv weight, whatever its layout."""

    oc: int
    icg: int  # input channels per group
    ocg: int  # output channels per group
    kh: int
    kw: int
    groups: int


def _rows(w: WeightExpr, g: Geometry) -> WeightExpr:
    """(OC, IC/g, H, W) -> (OC, H*W*IC/g): one im2col row per output channel."""
    return Reshape(x=Permute(x=w, dims=(0, 2, 3, 1)), shape=(g.oc, g.kh * g.kw * g.icg))


# kernel -> (int8 weight, geometry) -> unpadded packed layout
LAYOUTS: Mapping[str, Callable[[WeightExpr, Geometry], WeightExpr]] = {
    # (IC, OC/g, H, W) -> (g, IC/g, OC/g, H, W) -> (g, OC/g, H, W, IC/g) -> (OC, H*W*IC/g)
    "transposed": lambda w, g: Reshape(
        x=Permute(x=Reshape(x=w, shape=(g.groups, g.icg, g.ocg, g.kh, g.kw)), dims=(0, 2, 3, 4, 1)),
        shape=(g.oc, g.kh * g.kw * g.icg),
    ),
    # (OC, 1, H, W) -> (H, W, OC)
    "dw": lambda w, g: Reshape(x=Permute(x=w, dims=(2, 3, 1, 0)), shape=(g.kh, g.kw, g.oc)),
    "pw": _rows,
    "im2col": _rows,
}


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class _Weight:
    """An int8 constant behind a dequantize node."""

    key: str
    expr: WeightExpr
    spec: TensorSpec
    kind: ConstantKind
    dequant: NodeSnapshot


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class _Vector:
    """A per-channel constant (scales, bias): its expression, the node holding it if any, its length."""

    expr: WeightExpr
    node: str | None
    length: int
    kind: ConstantKind = "constant"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class _Output:
    """The optional relu after the conv and the quantize that ends the chain."""

    relu: str | None
    quant: NodeSnapshot


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class _Match:
    conv: ConvView
    kernel: str
    geo: Geometry
    dequant_in: NodeSnapshot
    weight: _Weight
    scales: _Vector
    bias: _Vector | None
    out: _Output


def _dtype(node: NodeSnapshot, index: int) -> str:
    d = node.arg(index, "dtype")
    return d.name if isinstance(d, DTypeArg) else str(d)


def _scalar_qparams(node: NodeSnapshot) -> bool:
    scale, zero = node.arg(1, "scale"), node.arg(2, "zero_point")
    return isinstance(scale, float) and isinstance(zero, int)


def _conv(snap: GraphSnapshot, node: NodeSnapshot) -> Result[ConvView, Reason]:
    view = conv_view(snap, node)
    if isinstance(view, Failure):
        return Failure(view.failure())
    c = view.unwrap()
    if c.rank != 2:
        return Failure(UnsupportedRank(node=c.node, rank=c.rank, allowed=(2,)))
    if isinstance(c.padding, str):
        return Failure(NoKernel(node=c.node, detail=f"padding={c.padding!r} (the kernels take explicit padding)"))
    if c.transposed and c.dilation != (1, 1):
        return Failure(NoKernel(node=c.node, detail=f"transposed conv with dilation {c.dilation} (kernel: 1)"))
    return Success(c)


def _dequant_input(snap: GraphSnapshot, c: ConvView) -> Result[NodeSnapshot, Reason]:
    dq = snap.node(c.x.name)
    if dq.target != DQ_TENSOR or not _scalar_qparams(dq) or not isinstance(dq.arg(0, "input"), NodeRef):
        return Failure(NotQuantized(node=c.node, role="input", detail=f"comes from {dq.name} ({dq.target})"))
    if _dtype(dq, 5) != "int8":
        return Failure(UnsupportedDtype(node=c.node, role="quantized input", dtype=_dtype(dq, 5)))
    return Success(dq)


def _dequant_weight(snap: GraphSnapshot, c: ConvView) -> Result[_Weight, Reason]:
    dq = snap.node(c.w.name)
    if not (dq.target == DQ_CHANNEL or (dq.target == DQ_TENSOR and _scalar_qparams(dq))):
        return Failure(NotQuantized(node=c.node, role="weight", detail=f"comes from {dq.name} ({dq.target})"))
    w = dq.arg(0, "input")
    operand = constant_operand(snap, c.node, "weight", w)
    if not isinstance(w, NodeRef) or isinstance(operand, Failure):  # not a node: not a constant either
        return Failure(operand.failure())
    expr, spec = operand.unwrap(), snap.constants[w.name].spec
    declared = _dtype(dq, 6 if dq.target == DQ_CHANNEL else 5)
    if spec.dtype != "int8" or declared != "int8":
        return Failure(UnsupportedDtype(node=c.node, role="weight", dtype=f"{spec.dtype} (dequantized as {declared})"))
    kind = snap.constants[w.name].kind
    return _zero_points(snap, c.node, dq).map(
        lambda _: _Weight(key=w.name, expr=expr, spec=spec, kind=kind, dequant=dq)
    )


def _zero_points(snap: GraphSnapshot, node: str, dq: NodeSnapshot) -> Result[None, Reason]:
    zero = dq.arg(2, "zero_points" if dq.target == DQ_CHANNEL else "zero_point")
    info = snap.constants.get(zero.name) if isinstance(zero, NodeRef) else None
    values = info.values if info is not None else (zero,) if isinstance(zero, int) else None
    if values is None:
        return Failure(AsymmetricWeight(node=node, detail="zero points are not a known constant"))
    if any(values):
        return Failure(AsymmetricWeight(node=node, detail=f"zero points {values[:4]} are not all 0"))
    return Success(None)


def _vector(snap: GraphSnapshot, c: ConvView, role: str, ref: Arg, length: int) -> Result[_Vector, Reason]:
    operand = constant_operand(snap, c.node, role, ref)
    if not isinstance(ref, NodeRef) or isinstance(operand, Failure):  # not a node: not a constant either
        return Failure(operand.failure())
    info = snap.constants[ref.name]
    if info.spec.shape != (length,):
        return Failure(Malformed(node=c.node, detail=f"{role} has shape {info.spec.shape}, expected ({length},)"))
    return Success(_Vector(expr=operand.unwrap(), node=ref.name, length=length, kind=info.kind))


def _scales(snap: GraphSnapshot, c: ConvView, w: _Weight, geo: Geometry) -> Result[_Vector, Reason]:
    scale = w.dequant.arg(1, "scale")
    if isinstance(scale, float):  # per-tensor: the kernel takes one scale per output channel
        return Success(_Vector(expr=Fill(shape=(geo.oc,), value=scale, dtype="float32"), node=None, length=geo.oc))
    axis, want = w.dequant.arg(3, "axis"), 1 if c.transposed else 0
    if axis != want:
        return Failure(NoKernel(node=c.node, detail=f"weight quantized per channel on axis {axis}, not {want}"))
    return _vector(snap, c, "weight scales", scale, geo.ocg if c.transposed else geo.oc)


def _bias(snap: GraphSnapshot, c: ConvView, geo: Geometry) -> Result[_Vector | None, Reason]:
    return Success(None) if c.b is None else _vector(snap, c, "bias", c.b, geo.oc)


def _output(snap: GraphSnapshot, conv: str) -> Result[_Output, Reason]:
    node, relu = conv, None
    users = snap.users.get(node, ())
    if len(users) == 1 and snap.node(users[0]).target == RELU:
        node = relu = users[0]
        users = snap.users.get(node, ())
    if len(users) != 1:
        return Failure(OutputShared(node=node, users=users))
    q = snap.node(users[0])
    if q.target != Q_TENSOR or not _scalar_qparams(q):
        return Failure(NotQuantized(node=conv, role="output", detail=f"goes to {q.name} ({q.target})"))
    if _dtype(q, 5) != "int8":
        return Failure(UnsupportedDtype(node=conv, role="quantized output", dtype=_dtype(q, 5)))
    return Success(_Output(relu=relu, quant=q))


def _geometry(c: ConvView, w: TensorSpec) -> Result[Geometry, Reason]:
    if len(w.shape) != 4 or not w.is_static:
        return Failure(Malformed(node=c.node, detail=f"weight shape {w.shape} is not a static 2D conv weight"))
    a, b, kh, kw = (d if isinstance(d, int) else 0 for d in w.shape)
    g = c.groups
    oc, icg = (b * g, a // g) if c.transposed else (a, b)
    if (c.transposed and a % g) or oc % g:
        return Failure(Malformed(node=c.node, detail=f"weight {w.shape} does not split into {g} groups"))
    return Success(Geometry(oc=oc, icg=icg, ocg=oc // g, kh=kh, kw=kw, groups=g))


def _shapes(snap: GraphSnapshot, c: ConvView, out: NodeSnapshot) -> Result[None, Reason]:
    for role, spec in (("input", snap.node(c.x.name).tensor_spec), ("output", out.tensor_spec)):
        if spec is None or len(spec.shape) != 4:
            return Failure(Malformed(node=c.node, detail=f"{role} has no known (N, C, H, W) shape"))
        if not isinstance(spec.shape[1], int):
            return Failure(SymbolicShape(node=c.node, role=role, shape=spec.shape))
    return Success(None)


def _kernel(c: ConvView, geo: Geometry, align: int) -> Result[str, Reason]:
    g, oc = geo.groups, geo.oc
    if 1 < g < oc and geo.ocg % align:  # a group must not cross a texel
        return Failure(ChannelAlignment(node=c.node, what="output channels per group", channels=geo.ocg, align=align))
    if c.transposed:
        return Success("transposed")
    if geo.icg == 1 and g == oc:
        if oc % align:
            return Failure(ChannelAlignment(node=c.node, what="depthwise output channels", channels=oc, align=align))
        return Success("dw")
    pointwise = (geo.kh, geo.kw) == c.stride == c.dilation == (1, 1) and c.padding == (0, 0)
    # the pw kernel ignores groups: a grouped 1x1 conv takes the general kernel
    return Success("pw" if pointwise and g == 1 else "im2col")


def _match(snap: GraphSnapshot, node: NodeSnapshot, align: int) -> Result[_Match, Reason]:
    conv = _conv(snap, node)
    if isinstance(conv, Failure):
        return Failure(conv.failure())
    c = conv.unwrap()
    dq, weight, out = _dequant_input(snap, c), _dequant_weight(snap, c), _output(snap, c.node)
    if (err := first_failure((dq, weight, out))) is not None:
        return Failure(err)
    w = weight.unwrap()
    geo, shapes = _geometry(c, w.spec), _shapes(snap, c, out.unwrap().quant)
    if (err := first_failure((geo, shapes))) is not None:
        return Failure(err)
    g = geo.unwrap()
    scales, bias, kernel = _scales(snap, c, w, g), _bias(snap, c, g), _kernel(c, g, align)
    if (err := first_failure((scales, bias, kernel))) is not None:
        return Failure(err)
    return Success(
        _Match(
            conv=c,
            kernel=kernel.unwrap(),
            geo=g,
            dequant_in=dq.unwrap(),
            weight=w,
            scales=scales.unwrap(),
            bias=bias.unwrap(),
            out=out.unwrap(),
        )
    )


def _padded(x: WeightExpr, size: int, dim: int, align: int) -> WeightExpr:
    return PadTo(x=x, dim=dim, multiple=align) if size % align else x


def _operand(name: str, v: _Vector, align: int) -> tuple[NodeRef, tuple[NewConstant, ...]]:
    """A per-channel vector padded to ``align``; an existing, already aligned constant is used as is."""
    if v.node is not None and v.length % align == 0:
        return NodeRef(v.node), ()
    return NodeRef(name), (NewConstant(name=name, expr=_padded(v.expr, v.length, 0, align), kind=v.kind),)


def _plan(m: _Match, align: int) -> Result[RewritePlan, Reason]:
    # weight -> layout padded on its last dim; sums of the layout per output channel; scales, bias padded
    c, g, w, q = m.conv, m.geo, m.weight, m.out.quant
    layout = LAYOUTS[m.kernel](w.expr, g)
    spec = infer_spec(layout)
    if isinstance(spec, Failure):
        return Failure(spec.failure())
    dims = spec.unwrap().shape
    width = dims[-1] if isinstance(dims[-1], int) else 0
    packed = _padded(layout, width, len(dims) - 1, align)
    sums = _padded(
        SumOver(x=layout, dims=tuple(range(len(dims) - 1)) if m.kernel == "dw" else (1,), dtype="int32"), g.oc, 0, align
    )
    scales, extra = _operand(f"{m.scales.node or w.key + '_scales'}_padded", m.scales, align)
    bias: NodeRef | None = None
    if m.bias is not None:
        bias, more = _operand(f"{m.bias.node}_padded", m.bias, align)
        extra += more
    transposed = (c.output_padding,) if m.kernel == "transposed" else ()
    x = m.dequant_in
    qconv = NewNode(
        name=f"{c.node}_q8ta",
        target=KERNELS[m.kernel],
        args=(
            x.arg(0, "input"),
            x.arg(1, "scale"),
            x.arg(2, "zero_point"),
            NodeRef(f"{w.key}_packed"),
            NodeRef(f"{w.key}_sums"),
            scales,
            q.arg(1, "scale"),
            q.arg(2, "zero_point"),
            bias,
            (g.kh, g.kw),
            c.stride,
            c.padding,
            *transposed,
            c.dilation,
            c.groups,
            "relu" if m.out.relu is not None else "none",
        ),
        spec=q.tensor_spec,
        provenance=c.node,
    )
    return Success(
        RewritePlan(
            rule=NAME,
            anchor=c.node,
            constants=(
                NewConstant(name=f"{w.key}_packed", expr=packed, kind=w.kind),
                NewConstant(name=f"{w.key}_sums", expr=sums, kind="constant"),
                *extra,
            ),
            nodes=(qconv,),
            replace=((q.name, qconv.name),),
            erase=(c.node, *((m.out.relu,) if m.out.relu is not None else ()), q.name),
            prune=(w.dequant.name, x.name),
        )
    )


@final
@dataclass(frozen=True, slots=True)
class QuantizedConv:
    """Replace quantized conv chains with the Vulkan q8ta kernels; ``align`` is the texel width."""

    align: int = 4
    name: str = NAME

    def anchors(self, snap: GraphSnapshot) -> Iterable[NodeSnapshot]:
        """Every 2D-or-other convolution; each ends as a plan or a rejection."""
        return (n for n in snap.nodes if n.op == "call_function" and n.target in CONV_SCHEMAS)

    def plan_at(self, snap: GraphSnapshot, node: NodeSnapshot) -> Result[RewritePlan, Reason]:
        """The q8ta plan at a conv, or the reason it stays as it is."""
        return _match(snap, node, self.align).bind(lambda m: _plan(m, self.align))


def quantized_conv(align: int = 4) -> QuantizedConv:
    """The int8 conv packing rule for ExecuTorch's Vulkan q8ta kernels.

    >>> quantized_conv()
    QuantizedConv(align=4, name='quantized-conv')
    """
    return QuantizedConv(align=align)

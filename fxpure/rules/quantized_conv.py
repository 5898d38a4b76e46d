"""quantized_conv: dq(x) -> conv(dq(w_int8)) -> [relu] -> q  =>  et_vk.q8ta_conv2d{,_pw,_dw,_transposed}.

The int8 weight is re-laid-out for the chosen Vulkan kernel, padded to the texel width
``align``, and summed per output channel; all of it as ``WeightExpr`` plans, so a weight
shared by several convs is packed once per distinct packing and the unpacked original is
dropped once nothing reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import final

from returns.result import Failure, Result, Success

from fxpure.families import CONV, DEQUANTIZE, DEQUANTIZE_PER_TENSOR, QUANTIZE_PER_TENSOR, RELU, RELU_
from fxpure.pattern import (
    ANY,
    Bound,
    Const,
    Lit,
    Match,
    OneOf,
    Op,
    PatternRule,
    Planner,
    Scalar,
    Var,
    dequantized,
    need,
    rule,
)
from fxpure.plan import RewritePlan
from fxpure.reasons import Declined, Malformed, NotScalar, Reason, SymbolicShape, UnsupportedDtype
from fxpure.snapshot import Arg, DTypeArg, GraphSnapshot, NodeRef, ref_list
from fxpure.weights import Dequantize, Fill, PadTo, Permute, Reshape, SumOver, WeightExpr, infer_spec

NAME = "quantized-conv"
NOT_Q = "not-quantized"

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
    padding: tuple[int, ...]  # explicit, as the kernels take it ('valid' and 'same' written out)


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

# int8 x -> dq -> conv(., dq(int8 w), b?) -> [relu] -> q
QUANTIZE = Op(QUANTIZE_PER_TENSOR, name="q", code=NOT_Q, scale=Scalar("out_scale"), zero_point=Scalar("out_zp"))
PATTERN = Op(
    CONV,
    name="conv",
    shared="conv-output-shared",
    input=dequantized(
        Var("xq"),
        name="dqx",
        family=DEQUANTIZE_PER_TENSOR,
        code=NOT_Q,
        scale=Scalar("x_scale"),
        zero_point=Scalar("x_zp"),
    ),
    weight=dequantized(Const("wq"), name="dqw", code=NOT_Q, scale=OneOf(Const("scales"), Scalar("scale"))),
    bias=Const("bias", optional=True),
    # a relu in place (an aten program's ReLU(inplace=True)) writes the conv's output, which nothing else reads
    user=OneOf(
        QUANTIZE,
        Op(replace(RELU | RELU_, noun=RELU.noun), name="relu", code=NOT_Q, shared="conv-output-shared", user=QUANTIZE),
    ),
)


def _candidate(conv: Bound, snap: GraphSnapshot) -> bool:
    """A conv that reads a dequantize a few nodes up its input or weight, or an int8 value the program
    holds or computes up its weight (``convert_pt2e``'s reference representation dequantizes by
    arithmetic): a float conv is no candidate, also beside quantized ops (declining each
    ``not-quantized`` was noise, 54 in one model); an integer input of the program (an image) or
    index buffer says nothing of it. A conv of a control-flow branch reading values the program
    dequantizes outside it is no candidate either (the branch holds no dequantize)."""
    return _reads(snap, conv.args.get("input"), weights=False) or _reads(snap, conv.args.get("weight"), weights=True)


def _reads(snap: GraphSnapshot, arg: Arg, *, weights: bool) -> bool:
    """A dequantize a few steps up ``arg`` (a clone, a view between them), or for ``weights`` also an
    int8 or uint8 value the program holds or computes (not one it is given), more steps up (a
    reference weight per channel: transpose, mul, to float, sub, to int32, transpose, clamp, int8)."""
    level, seen = [arg.name] if isinstance(arg, NodeRef) else [], set[str]()
    for _ in range(8 if weights else 4):  # the nodes one, two, ... steps up
        up: list[str] = []
        for name in level:
            if name in seen or name not in snap.index:
                continue
            seen.add(name)
            node = snap.node(name)
            if node.target in DEQUANTIZE.targets:
                return True
            spec = node.tensor_spec
            given = node.op == "placeholder" and name not in snap.constant_names
            if weights and spec is not None and spec.dtype in ("int8", "uint8") and not given:
                return True
            if node.op == "call_function":
                up.extend(ref_list(node))
        level = up
    return False


def _dtype(op: Bound) -> str:
    d = op.args.get("dtype")
    return d.name if isinstance(d, DTypeArg) else str(d)


def _same(conv: Bound, kernel: tuple[int, ...]) -> tuple[int, ...] | None:
    """``padding='same'`` written out, half of each dim's dilated kernel, ``d * (k - 1)``; None where
    one is odd (torch pads that dim one more at the end)."""
    total = [d * (k - 1) for d, k in zip(conv.ints("dilation"), kernel, strict=True)]
    return None if any(t % 2 for t in total) else tuple(t // 2 for t in total)


def _explicit(conv: Bound, match: Match) -> Reason | None:
    """The kernels pad both sides of a dim alike ('same' of an even dilated kernel pads one more),
    and take no dilation when transposed."""
    padding, dilation, w = conv.args["padding"], conv.ints("dilation"), match.spec("wq")
    sizes = tuple(d for d in w.shape[2:] if isinstance(d, int)) if w is not None and len(w.shape) == 4 else ()
    if padding == "same" and len(sizes) == 2 and _same(conv, sizes) is None:
        kernel = "x".join(map(str, sizes))
        detail = f"{conv.name}: padding='same' of a {kernel} kernel, dilation {dilation}, pads one side more"
        return Declined(code="no-kernel", node=conv.name, detail=f"{detail} (the kernels pad both sides alike)")
    if conv.bool("transposed") and dilation != (1, 1):
        detail = f"{conv.name}: transposed conv with dilation {dilation} (kernel: 1)"
        return Declined(code="no-kernel", node=conv.name, detail=detail)
    return None


def _int8(conv: Bound, dqx: Bound, dqw: Bound, q: Bound, match: Match) -> Reason | None:
    """Activations in and out, and the weight (stored and declared), are int8."""
    w = match.spec("wq")
    stored = w.dtype if w is not None else "?"
    for role, dtype in (
        ("quantized input", _dtype(dqx)),
        ("weight", stored if stored == _dtype(dqw) == "int8" else f"{stored} (dequantized as {_dtype(dqw)})"),
        ("quantized output", _dtype(q)),
    ):
        if dtype != "int8":
            return UnsupportedDtype(node=conv.name, role=role, dtype=dtype)
    return None


def _full_range(conv: Bound, q: Bound) -> Reason | None:
    """The output is quantized to int8's whole range, to which the kernels clamp (a narrower one,
    [-127, 127] or [0, 127], would come out with values outside it)."""
    low, high = q.args.get("quant_min"), q.args.get("quant_max")
    if (low, high) == (-128, 127):
        return None
    detail = f"{conv.name}: its output is quantized to [{low}, {high}], the kernels' to [-128, 127]"
    return Declined(code="no-kernel", node=conv.name, detail=detail)


def _symmetric(conv: Bound, dqw: Bound, match: Match) -> Reason | None:
    """The weight's zero points are all 0 (the int8 kernels assume symmetric weights)."""
    zero = dqw.args.get("zero_point")
    info = match.snap.constants.get(zero.name) if isinstance(zero, NodeRef) else None
    values = info.values if info is not None else (zero,) if isinstance(zero, int) else None
    if values is None:
        detail = f"weight of {conv.name}: zero points are not a known constant"
        return Declined(code="asymmetric-weight", node=conv.name, detail=detail)
    if any(values):
        detail = f"weight of {conv.name}: zero points {values[:4]} are not all 0"
        return Declined(code="asymmetric-weight", node=conv.name, detail=detail)
    return None


def _geometry(conv: Bound, match: Match) -> Result[Geometry, Reason]:
    """A static 2D weight that splits into the conv's groups, as channel and kernel sizes."""
    w = match.spec("wq")
    if w is None or len(w.shape) != 4 or not w.is_static:
        shape = w.shape if w is not None else None
        return Failure(Malformed(node=conv.name, detail=f"weight shape {shape} is not a static 2D conv weight"))
    a, b, kh, kw = (d if isinstance(d, int) else 0 for d in w.shape)
    g, transposed = conv.int("groups"), conv.bool("transposed")
    oc, icg = (b * g, a // g) if transposed else (a, b)
    if (transposed and a % g) or oc % g:
        return Failure(Malformed(node=conv.name, detail=f"weight {w.shape} does not split into {g} groups"))
    padding = conv.args["padding"]
    pads = (0, 0) if padding == "valid" else _same(conv, (kh, kw)) if padding == "same" else conv.ints("padding")
    assert pads is not None  # (an odd 'same' was declined: _explicit)
    return Success(Geometry(oc=oc, icg=icg, ocg=oc // g, kh=kh, kw=kw, groups=g, padding=pads))


def _shapes(conv: Bound, dqx: Bound, q: Bound) -> Reason | None:
    """(N, C, H, W) activations with static channels."""
    for role, spec in (("input", dqx.spec), ("output", q.spec)):
        if spec is None or len(spec.shape) != 4:
            return Malformed(node=conv.name, detail=f"{role} has no known (N, C, H, W) shape")
        if not isinstance(spec.shape[1], int):
            return SymbolicShape(node=conv.name, role=role, shape=spec.shape)
    return None


def _vectors(conv: Bound, geo: Geometry, dqw: Bound, match: Match) -> Reason | None:
    """Per-channel scales along the output channels, and scales and bias one per output channel; a
    per-tensor scale is a number (the kernels take one, and a 0-d tensor's value is not planned on)."""
    if dqw.args.get("axis") is None and "scales" in match.bindings:
        site = match.sites["scales"]
        return NotScalar(node=site.node, role=site.role, value="a 0-d tensor", path=site.path)
    if dqw.args.get("axis") is not None:
        axis, want = dqw.args["axis"], 1 if conv.bool("transposed") else 0
        if axis != want:
            detail = f"{conv.name}: weight quantized per channel on axis {axis}, not {want}"
            return Declined(code="no-kernel", node=conv.name, detail=detail)
    for role, name, length in (
        ("weight scales", "scales", geo.ocg if conv.bool("transposed") else geo.oc),
        ("bias", "bias", geo.oc),
    ):
        spec = match.spec(name)
        if spec is not None and spec.shape != (length,):
            return Malformed(node=conv.name, detail=f"{role} has shape {spec.shape}, expected ({length},)")
    return None


def _kernel(conv: Bound, geo: Geometry, align: int) -> Result[str, Reason]:
    g, oc = geo.groups, geo.oc
    # (one channel in and out, groups=1, is no depthwise conv: the general kernels take it)
    depthwise = geo.icg == 1 and g == oc > 1 and not conv.bool("transposed")
    # the grouped kernels read and write channels by texel: a group must not cross one
    if g > 1 and not depthwise and geo.ocg % align:
        return Failure(_misaligned(conv, "output channels per group", geo.ocg, align))
    if g > 1 and not depthwise and geo.icg % align:
        return Failure(_misaligned(conv, "input channels per group", geo.icg, align))
    if conv.bool("transposed"):
        return Success("transposed")
    if depthwise:
        return Failure(_misaligned(conv, "depthwise output channels", oc, align)) if oc % align else Success("dw")
    one = (1, 1)
    pointwise = (geo.kh, geo.kw) == conv.ints("stride") == conv.ints("dilation") == one and geo.padding == (0, 0)
    # the pw kernel ignores groups: a grouped 1x1 conv takes the general kernel
    return Success("pw" if pointwise and g == 1 else "im2col")


def _misaligned(conv: Bound, what: str, channels: int, align: int) -> Reason:
    detail = f"{conv.name}: {what} is {channels}, not a multiple of {align}"
    return Declined(code="channel-alignment", node=conv.name, detail=detail)


def _padded(x: WeightExpr, size: int, dim: int, align: int) -> WeightExpr:
    return PadTo(x=x, dim=dim, multiple=align) if size % align else x


def _vector(p: Planner, name: str, expr: WeightExpr, ref: Arg, length: int, align: int) -> NodeRef:
    """A per-channel vector padded to ``align``; an existing, already aligned constant is used as is."""
    snap: GraphSnapshot = p.match.snap
    existing = ref if isinstance(ref, NodeRef) and ref.name in snap.constants else None
    if existing is not None and length % align == 0:
        return existing
    kind = snap.constants[existing.name].kind if existing is not None else "constant"
    return p.const(_padded(expr, length, 0, align), name, kind=kind)


def _plan(
    align: int,
    p: Planner,
    geo: Geometry,
    kernel: str,
    conv: Bound,
    dqx: Bound,
    dqw: Bound,
    q: Bound,
    xq: Arg,
    x_scale: float,
    x_zp: int,
    out_scale: float,
    out_zp: int,
    wq: WeightExpr,
    relu: Bound | None = None,
    scales: WeightExpr | None = None,
    scale: float | None = None,
    bias: WeightExpr | None = None,
) -> Result[RewritePlan, Reason]:
    # weight -> layout padded on its last dim; sums of the layout per output channel; scales, bias padded
    w_ref = dqw.ref("input")
    layout = LAYOUTS[kernel](wq, geo)
    spec = infer_spec(layout)
    if isinstance(spec, Failure):
        return Failure(spec.failure())
    dims = spec.unwrap().shape
    width = dims[-1] if isinstance(dims[-1], int) else 0
    kind = p.match.snap.constants[w_ref.name].kind
    packed = p.const(_padded(layout, width, len(dims) - 1, align), f"{w_ref.name}_packed", kind=kind)
    summed = SumOver(x=layout, dims=tuple(range(len(dims) - 1)) if kernel == "dw" else (1,), dtype="int32")
    sums = p.const(_padded(summed, geo.oc, 0, align), f"{w_ref.name}_sums", kind="constant")
    transposed = conv.bool("transposed")
    if scales is not None:
        n_scales, scale_ref = geo.ocg if transposed else geo.oc, dqw.args["scale"]
        scale_name = f"{scale_ref.name if isinstance(scale_ref, NodeRef) else w_ref.name + '_scales'}_padded"
        scale_vec = _vector(p, scale_name, scales, scale_ref, n_scales, align)
    else:  # per-tensor: the kernel takes one scale per output channel
        fill = Fill(shape=(geo.oc,), value=float(scale or 0.0), dtype="float32")
        scale_vec = _vector(p, f"{w_ref.name}_scales_padded", fill, None, geo.oc, align)
    bias_ref = conv.args["bias"]
    bias_vec = None
    if bias is not None and isinstance(bias_ref, NodeRef):
        bias_vec = _vector(p, f"{bias_ref.name}_padded", bias, bias_ref, geo.oc, align)
    qconv = p.node(
        KERNELS[kernel],
        (
            xq,
            x_scale,
            x_zp,
            packed,
            sums,
            scale_vec,
            out_scale,
            out_zp,
            bias_vec,
            (geo.kh, geo.kw),
            conv.ints("stride"),
            geo.padding,
            *((conv.ints("output_padding"),) if kernel == "transposed" else ()),
            conv.ints("dilation"),
            geo.groups,
            "relu" if relu is not None else "none",
        ),
        name=f"{conv.name}_q8ta",
        spec=q.node.spec,
        provenance=conv.name,
    )
    del dqx  # matched, then pruned with the plan when nothing else reads it
    return Success(p.replace(q, qconv))


# the fallback: dq(x) -> conv(dq(int8 w)) that no q8ta kernel takes  =>  conv(float w), the weight
# dequantized once into a constant: the chain runs in float between the activations' dequantize and
# quantize (bit for bit what the dequantize computed), and no backend pattern mistakes it for a q8ta conv
FALLBACK = Op(
    CONV,
    name="conv",
    # (quantized statically: parameters computed at run time, ``choose_qparams``, are a dynamically
    # quantized conv, which XNNPACK runs with the int8 weight kept)
    input=Op(
        DEQUANTIZE_PER_TENSOR,
        users=ANY,
        scale=OneOf(Scalar("x_scale"), Const("x_scale")),
        zero_point=OneOf(Scalar("x_zp"), Const("x_zp")),
    ),
    weight=dequantized(
        Const("wq"),
        name="dqw",
        scale=OneOf(Const("scales"), Scalar("scale")),
        zero_point=OneOf(Const("zero_points"), Scalar("zero_point"), Lit(None)),
    ),
)


def _dequantize_weight(
    p: Planner,
    conv: Bound,
    dqw: Bound,
    wq: WeightExpr,
    scales: WeightExpr | None = None,
    scale: float | None = None,
    zero_points: WeightExpr | None = None,
    zero_point: float | None = None,
) -> RewritePlan:
    axis = dqw.args.get("axis")
    s = scales if scales is not None else Fill(shape=(), value=float(scale or 0.0), dtype="float32")
    z = zero_points if zero_points is not None else Fill(shape=(), value=float(zero_point or 0), dtype="float32")
    w_ref = dqw.ref("input")
    weight = Dequantize(x=wq, scale=s, zero_point=z, axis=axis if isinstance(axis, int) else None)
    kind = p.match.snap.constants[w_ref.name].kind
    new = p.respell(conv, name=f"{conv.name}_float", weight=p.const(weight, f"{w_ref.name}_dequantized", kind=kind))
    return p.finish([(conv, new)], erase=[conv])


DEQUANTIZE_WEIGHT = rule("quantized-conv-fallback", FALLBACK, plan=_dequantize_weight)
"""The fallback alone: dequantize the weight of every int8 conv into a float constant."""

FALLBACKS: Mapping[str, PatternRule | None] = {"dequantize": DEQUANTIZE_WEIGHT, "none": None}
"""Policies for a quantized conv the q8ta kernels cannot take."""


def aligned(align: int, conv: Bound, geo: Geometry) -> Result[str, Reason]:
    """The kernel for ``conv`` whose channels are ``align``-aligned (a compute of the rule)."""
    return _kernel(conv, geo, align)


def quantized_conv(align: int = 4, fallback: str = "dequantize") -> PatternRule:
    """The int8 conv packing rule for ExecuTorch's Vulkan q8ta kernels; ``align`` is their texel
    width, 4 (the kernels read each packed row, per-channel vector and group four channels at a
    time; rows padded to another multiple would not be read as laid out).

    ``fallback`` is what happens to a quantized conv it declines: ``"dequantize"`` (the default)
    dequantizes its int8 weight into a float constant, so the conv runs in float between the
    activations' dequantize and quantize and the program still lowers through the Vulkan
    partitioner (its own quantized-conv pattern would assert on such a conv); the plan records the
    reason it stands in for (``instead_of``). ``"none"`` leaves the conv as it is.

    >>> from fxpure.reasons import GENERIC_CODES
    >>> r = quantized_conv()
    >>> sorted(r.codes - GENERIC_CODES)
    ['asymmetric-weight', 'channel-alignment', 'conv-output-shared', 'no-kernel', 'not-constant', \
'not-quantized', 'not-scalar', 'symbolic-shape', 'unsupported-dtype', 'unsupported-rank']
    >>> r.fallback.name if r.fallback else None, quantized_conv(fallback="none").fallback
    ('quantized-conv-fallback', None)
    >>> quantized_conv(align=8)
    Traceback (most recent call last):
    ValueError: align must be 4 (the q8ta kernels' texel width), got 8
    """
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {', '.join(FALLBACKS)}, got {fallback!r}")
    if type(align) is not int or align != 4:  # the kernels read channels four at a time
        raise ValueError(f"align must be 4 (the q8ta kernels' texel width), got {align!r}")

    return rule(
        NAME,
        PATTERN,
        need.spatial_rank("conv", (2,)),
        need.check(_explicit, codes=("no-kernel",)),
        need.check(_int8, codes=("unsupported-dtype",)),
        need.check(_full_range, codes=("no-kernel",)),
        need.check(_symmetric, codes=("asymmetric-weight",)),
        need.compute("geo", _geometry, codes=("malformed-node",)),
        need.check(_shapes, codes=("malformed-node", "symbolic-shape")),
        need.check(_vectors, codes=("no-kernel", "malformed-node", "not-scalar")),
        need.compute("kernel", partial(aligned, align), codes=("channel-alignment",)),
        plan=partial(_plan, align),
        fallback=FALLBACKS[fallback],
        candidate=_candidate,
    )

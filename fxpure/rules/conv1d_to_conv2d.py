"""conv1d_to_conv2d: conv1d(x, W) => squeeze(conv2d(unsqueeze(x, 2), W.unsqueeze(2)), 2) (for backends
with 2D kernels only: XNNPACK, NPUs).

Every spelling of a 1D convolution, transposed or not: ``conv1d`` (explicit or string padding),
``conv_transpose1d``, and ``convolution`` with a rank-3 weight (aten and edge). The weight becomes
a derived constant ``(O, I/g, 1, K)`` (``(I, O/g, 1, K)`` transposed), from a parameter, an earlier
rule's derived constant, or the integer weight behind a dequantize (re-spelled for the 4D weight);
stride, padding, dilation and output padding gain a unit leading dim. Sizes of the activations
are never read: batch and length stay whatever they are at run time.
"""

from __future__ import annotations

from collections.abc import Mapping

from fxpure import layout
from fxpure.families import CONV
from fxpure.layout import layout_reader
from fxpure.pattern import (
    Bound,
    Const,
    Match,
    OneOf,
    Op,
    PatternRule,
    Planner,
    Var,
    dequantized,
    need,
    quantized_as,
    rule,
)
from fxpure.plan import RewritePlan
from fxpure.reasons import Declined, Reason
from fxpure.snapshot import Arg, GraphSnapshot, NodeRef, Spec, TensorSpec
from fxpure.weights import Unsqueeze, WeightExpr

NAME = "conv1d-to-conv2d"

# conv1d spelling -> its conv2d spelling in the aten dialect (edge spells every conv `convolution`)
CONV2D: Mapping[str, str] = {
    "aten.conv1d.default": "aten.conv2d.default",
    "aten.conv1d.padding": "aten.conv2d.padding",
    "aten.conv_transpose1d.default": "aten.conv_transpose2d.input",
    "aten.convolution.default": "aten.convolution.default",
}
EDGE_CONV = "aten.convolution.default"
# the user-level function of a new conv, by target, for quantizer metadata (source_fn_stack)
SOURCE_FN: Mapping[str, str] = {
    "aten.conv2d.default": "conv2d",
    "aten.conv2d.padding": "conv2d",
    "aten.convolution.default": "convolution",
    "aten.conv_transpose2d.input": "conv_transpose2d",
}

# conv(x, W or dequantize(W_int), b?) with one spatial dim
PATTERN = Op(
    CONV,
    name="conv",
    input=Var("x"),
    weight=OneOf(Const("w"), dequantized(Const("wq"), name="dqw")),
)


def _explicit(conv: Bound, match: Match) -> Reason | None:
    """String padding ("same", "valid") only where the conv2d spelling can carry it on."""
    padding = conv.args["padding"]
    if not isinstance(padding, str) or _target(conv, match.snap) == "aten.conv2d.padding":
        return None
    detail = f"{conv.name}: padding={padding!r} has no {EDGE_CONV} spelling (edge takes explicit padding)"
    return Declined(code="string-padding", node=conv.name, detail=detail)


def _layout(conv: Bound, match: Match) -> Reason | None:
    """The conv2d's output squeezed back may have other strides than the conv1d's (channels last,
    say, on a transposed input): no reader may depend on them."""
    return layout_reader(match.snap, conv.name)


def _target(conv: Bound, snap: GraphSnapshot) -> str:
    return EDGE_CONV if snap.dialect == "edge" else CONV2D[conv.node.target]


def _at2(spec: Spec) -> TensorSpec | None:
    """The spec with a unit dim inserted at 2 (an (N, C, L) activation or a (C0, C1, K) weight)."""
    if not isinstance(spec, TensorSpec):
        return None
    return TensorSpec(shape=(*spec.shape[:2], 1, *spec.shape[2:]), dtype=spec.dtype)


def _lead(values: Arg, first: int) -> Arg:
    """A 1D int list as 2D, with ``first`` for the new unit dim; a string padding stays as it is."""
    return (first, *values) if isinstance(values, tuple) else values


def _weight(p: Planner, conv: Bound, w: WeightExpr | None, wq: WeightExpr | None, dqw: Bound | None) -> NodeRef:
    """The 4D weight: a derived constant, or a new dequantize of the 4D integer weight."""
    if w is not None:
        return p.const(Unsqueeze(x=w, dim=2), f"{conv.name}_weight_2d")
    assert wq is not None and dqw is not None  # the pattern binds one or the other
    int_w = p.const(Unsqueeze(x=wq, dim=2), f"{dqw.ref('input').name}_2d", kind="buffer")
    name, spec = f"{dqw.name}_2d", _at2(dqw.spec)
    axis = dqw.args.get("axis")
    if not isinstance(axis, int):  # per tensor
        return p.respell(dqw, name=name, spec=spec, input=int_w)
    axis %= 3  # (C0, C1, K) -> (C0, C1, 1, K): the kernel axis moves past the new dim
    return p.respell(dqw, name=name, spec=spec, input=int_w, axis=3 if axis == 2 else axis)


def _plan(
    p: Planner,
    conv: Bound,
    x: NodeRef,
    w: WeightExpr | None = None,
    wq: WeightExpr | None = None,
    dqw: Bound | None = None,
) -> RewritePlan:
    # unsqueeze(x, 2) -> conv2d(W.unsqueeze(2), [1, s], [0, p], [1, d], [0, op]) -> squeeze(., [2])
    # (a Planner writes the edge program's ``_copy`` spelling of the views)
    unsqueeze, squeeze = "aten.unsqueeze.default", "aten.squeeze.dims"
    target, a = _target(conv, p.match.snap), conv.args
    base = conv.name
    # the views name their own function in source_fn_stack (``torch.unsqueeze``...), not the conv's
    snap, x_spec = p.match.snap, _at2(p.match.spec("x"))
    x2 = p.call(unsqueeze, name=f"{base}_in_2d", spec=x_spec, source_fn="unsqueeze", self=x, dim=2)
    # a quantized program keeps dequantize -> conv -> quantize around the views (a backend lowers that)
    dq, q, y_spec = quantized_as(snap, x.name), quantized_as(snap, base), _at2(conv.spec)
    if dq is not None and x_spec is not None:
        x2 = p.requantize(x2, dq, name=f"{base}_in_2d", spec=x_spec)
    args: dict[str, Arg] = {
        "input": x2,
        "weight": _weight(p, conv, w, wq, dqw),
        "bias": a["bias"],
        "stride": _lead(a["stride"], 1),
        "padding": _lead(a["padding"], 0),
        "dilation": _lead(a["dilation"], 1),
        "groups": a["groups"],
    }
    if conv.bool("transposed") or target == EDGE_CONV:
        args["output_padding"] = _lead(a["output_padding"], 0)
    if target == EDGE_CONV:
        args["transposed"] = a["transposed"]
    y2 = p.call(target, name=f"{base}_2d", spec=y_spec, provenance=base, source_fn=SOURCE_FN.get(target), **args)
    if q is not None and y_spec is not None:
        y2 = p.requantize(y2, q, name=f"{base}_2d", spec=y_spec)
    out = p.call(squeeze, name=f"{base}_out_1d", spec=conv.spec, source_fn="squeeze", self=y2, dim=(2,))
    return p.replace(conv, out)


def _one_d(conv: Bound, _: GraphSnapshot) -> bool:
    return conv.args.get("rank") == 1


CONV1D_TO_CONV2D = rule(
    NAME,
    PATTERN,
    need.static("x", dims=(1,)),
    need.static("conv", dims=(1,)),
    need.check(_explicit, codes=("string-padding",)),
    need.check(_layout, codes=(layout.CODE,)),
    plan=_plan,
    candidate=_one_d,
)


def conv1d_to_conv2d() -> PatternRule:
    """Every 1D convolution (transposed too) as a 2D one on a unit-height view of its input.

    >>> from fxpure.reasons import GENERIC_CODES
    >>> sorted(conv1d_to_conv2d().codes - GENERIC_CODES)
    ['layout-sensitive-reader', 'not-constant', 'string-padding', 'symbolic-shape', 'wrong-op']
    """
    return CONV1D_TO_CONV2D

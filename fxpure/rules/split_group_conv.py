"""split_group_conv: conv(groups=G)  =>  G x (slice -> conv(groups=1)) -> cat  (for NPUs like NXP Neutron).

The input is cut with one slice per group rather than ``split_with_sizes``: ExecuTorch's edge
verifier takes ``len()`` of a list-returning op's first output, which pins a dynamic batch to the
example's size, so a ``.pte`` with a split would refuse any other batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

from fxpure import layout
from fxpure.families import CONV
from fxpure.layout import layout_reader
from fxpure.pattern import Bound, Const, Lit, Match, OneOf, Op, PatternRule, Planner, Var, dequantized, need, rule
from fxpure.plan import RewritePlan
from fxpure.reasons import Declined, Malformed, Reason
from fxpure.snapshot import GraphSnapshot, NodeRef, TensorSpec
from fxpure.weights import Slice, WeightExpr

NAME = "split-group-conv"

# the user-level function a new node stands for, by target, for quantizer metadata (source_fn_stack)
SOURCE_FN: Mapping[str, str] = {
    "aten.conv1d.default": "conv1d",
    "aten.conv2d.default": "conv2d",
    "aten.convolution.default": "convolution",
}


def _strided(conv: Bound, match: Match) -> Reason | None:
    """The cat of the groups' outputs is laid out as a conv's output on a contiguous input; on a
    channels-last input the grouped conv's is not: a reader of its storage by strides (as_strided)
    would read other values (a view works on both)."""
    return layout_reader(match.snap, conv.name, views=False)


# conv(x, w, b?, groups=G), not transposed
PATTERN = Op(
    CONV,
    name="conv",
    transposed=Lit(False, code="transposed-conv", text="{node} is a transposed convolution"),
    input=Var("x"),
    weight=OneOf(Const("w"), dequantized(Const("qw"), name="dq", code="not-constant")),
    bias=Const("b", optional=True),
)


def _float_weight(conv: Bound, dq: Bound | None = None) -> Reason | None:
    """A weight dequantized at run time (PT2E): its slices would need their own quantization
    parameters; the rule splits a float model, before it is quantized (as NXP's flow does)."""
    if dq is None:
        return None
    detail = f"weight of {conv.name} is quantized ({dq.name}): split the grouped conv before quantizing"
    return Declined(code="quantized-weight", node=conv.name, detail=detail)


def _channels(spec: TensorSpec | None, index: int) -> int:
    d = spec.shape[index] if spec is not None and len(spec.shape) > index else 0
    return d if isinstance(d, int) else 0


def _fit(node: str, g: int, cin: int, cout: int, low: int, high: int) -> Reason | None:
    """Not depthwise, channels divisible by the groups, groups within the policy range."""
    if cin == cout == g:
        return Declined(code="depthwise-conv", node=node, detail=f"{node} is depthwise (in = out = groups = {g})")
    if cin % g or cout % g:
        return Malformed(node=node, detail=f"channels {cin}->{cout} do not split into {g} groups")
    if not low <= g <= high:
        return Declined(code="groups-out-of-range", node=node, detail=f"groups={g}, allowed {low}..{high}")
    return None


def _with_channels(spec: TensorSpec, channels: int) -> TensorSpec:
    return TensorSpec(shape=(spec.shape[0], channels, *spec.shape[2:]), dtype=spec.dtype)


def _plan(p: Planner, conv: Bound, x: NodeRef, b: WeightExpr | None, w: WeightExpr | None = None) -> RewritePlan:
    assert w is not None  # _float_weight declined the dequantized one
    # x[:, i*cg:(i+1)*cg] -> conv_i(w[i], b[i], groups=1) -> cat(dim=1)
    g, base, x_spec, out_spec = conv.int("groups"), conv.name, p.match.spec("x"), conv.spec
    assert x_spec is not None and out_spec is not None  # need.static checked both
    cg, og = _channels(x_spec, 1) // g, _channels(out_spec, 1) // g
    piece, out = _with_channels(x_spec, cg), _with_channels(out_spec, og)
    convs: list[NodeRef] = []
    for i in range(g):
        part = p.call(
            "aten.slice.Tensor",  # (a Planner writes slice_copy on edge)
            name=f"{base}_x{i}",
            spec=piece,
            source_fn="getitem",
            self=x,
            dim=1,
            start=i * cg,
            end=(i + 1) * cg,
        )
        weight = p.const(Slice(x=w, dim=0, start=i * og, stop=(i + 1) * og), f"{base}_w{i}")
        bias = None if b is None else p.const(Slice(x=b, dim=0, start=i * og, stop=(i + 1) * og), f"{base}_b{i}")
        new = p.respell(
            conv,
            name=f"{base}_g{i}",
            spec=out,
            source_fn=SOURCE_FN.get(conv.node.target),
            input=part,
            weight=weight,
            bias=bias,
            groups=1,
        )
        convs.append(new)
    cat = p.node("aten.cat.default", (tuple(convs), 1), name=f"{base}_cat", spec=out_spec, source_fn="cat")
    return p.replace(conv, cat)


def groups_fit(min_groups: int, max_groups: int, conv: Bound, match: Match) -> Reason | None:
    """The conv's groups are in ``min_groups..max_groups`` and divide its channels (a check of the rule)."""
    cin, cout = _channels(match.spec("x"), 1), _channels(conv.spec, 1)
    return _fit(conv.name, conv.int("groups"), cin, cout, min_groups, max_groups)


def _grouped(conv: Bound, _: GraphSnapshot) -> bool:
    return conv.args.get("groups") != 1


def split_group_conv(min_groups: int = 2, max_groups: int = 10) -> PatternRule:
    """The grouped-convolution splitting rule; 2..10 is upstream's empirical Neutron limit.

    >>> from fxpure.reasons import GENERIC_CODES
    >>> sorted(split_group_conv(max_groups=4).codes - GENERIC_CODES)
    ['depthwise-conv', 'groups-out-of-range', 'layout-sensitive-reader', 'not-constant', 'quantized-weight', \
'symbolic-shape', 'transposed-conv', 'unsupported-rank']
    >>> split_group_conv(max_groups=1)
    Traceback (most recent call last):
    ValueError: groups range must be whole numbers 2 <= min_groups <= max_groups, got 2..1
    """
    if any(type(g) is not int for g in (min_groups, max_groups)) or not 2 <= min_groups <= max_groups:
        raise ValueError(
            f"groups range must be whole numbers 2 <= min_groups <= max_groups, got {min_groups!r}..{max_groups!r}"
        )

    return rule(
        NAME,
        PATTERN,
        need.spatial_rank("conv", (1, 2)),
        need.static("x", dims=(1,)),
        need.static("conv", dims=(1,)),
        need.check(
            partial(groups_fit, min_groups, max_groups),
            codes=("depthwise-conv", "groups-out-of-range", "malformed-node"),
        ),
        need.check(_float_weight, codes=("quantized-weight",)),
        need.static("w"),
        need.check(_strided, codes=(layout.CODE,)),
        plan=_plan,
        candidate=_grouped,
    )

"""split_group_conv: conv(groups=G)  =>  split -> G x conv(groups=1) -> cat  (for NPUs like NXP Neutron)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import final

from returns.result import Failure, Result, Success

from fxpure.plan import NewConstant, NewNode, RewritePlan, constant_operand
from fxpure.reasons import (
    Depthwise,
    GroupsOutOfRange,
    Malformed,
    Reason,
    SymbolicShape,
    TransposedConv,
    UnsupportedRank,
    first_failure,
)
from fxpure.snapshot import GraphSnapshot, NodeRef, NodeSnapshot, TensorSpec
from fxpure.views import CONV_SCHEMAS, ConvView, conv_view, respell
from fxpure.weights import Slice, WeightExpr

NAME = "split-group-conv"

# the split op each dialect spells (edge has no view ops)
SPLIT_OP: Mapping[str, str] = {"aten": "aten.split_with_sizes.default", "edge": "aten.split_with_sizes_copy.default"}
# the user-level function a new node stands for, by target, for quantizer metadata (source_fn_stack)
SOURCE_FN: Mapping[str, str] = {
    "aten.conv1d.default": "conv1d",
    "aten.conv2d.default": "conv2d",
    "aten.convolution.default": "convolution",
}


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class _Match:
    conv: ConvView
    node: NodeSnapshot
    x: TensorSpec
    out: TensorSpec
    w: WeightExpr
    b: WeightExpr | None
    w_spec: TensorSpec
    cg: int = 0  # input channels per group, set by _check_groups
    og: int = 0  # output channels per group


def _channels(spec: TensorSpec | None, node: str, role: str) -> Result[TensorSpec, Reason]:
    if spec is None or len(spec.shape) < 3:
        return Failure(Malformed(node=node, detail=f"{role} has no known (N, C, ...) shape"))
    if not isinstance(spec.shape[1], int):
        return Failure(SymbolicShape(node=node, role=role, shape=spec.shape))
    return Success(spec)


def _match(snap: GraphSnapshot, node: NodeSnapshot, low: int, high: int) -> Result[_Match, Reason]:
    view = conv_view(snap, node)
    if isinstance(view, Failure):
        return Failure(view.failure())
    c = view.unwrap()
    if c.transposed:
        return Failure(TransposedConv(node=c.node))
    if c.rank not in (1, 2):
        return Failure(UnsupportedRank(node=c.node, rank=c.rank, allowed=(1, 2)))
    weight = constant_operand(snap, c.node, "weight", c.w)
    bias = constant_operand(snap, c.node, "bias", c.b) if c.b is not None else Success(None)
    if (err := first_failure((weight, bias))) is not None:
        return Failure(err)
    w, b = weight.unwrap(), bias.unwrap()
    x, out = _channels(snap.node(c.x.name).tensor_spec, c.node, "input"), _channels(node.tensor_spec, c.node, "output")
    w_spec = snap.constants[c.w.name].spec
    if (err := first_failure((x, out))) is not None:
        return Failure(err)
    if not w_spec.is_static:
        return Failure(SymbolicShape(node=c.node, role="weight", shape=w_spec.shape))
    return Success(_Match(conv=c, node=node, x=x.unwrap(), out=out.unwrap(), w=w, b=b, w_spec=w_spec)).bind(
        lambda m: _check_groups(m, low, high)
    )


def _check_groups(m: _Match, low: int, high: int) -> Result[_Match, Reason]:
    g, cin, cout = m.conv.groups, m.x.shape[1], m.w_spec.shape[0]
    if cin == cout == g:
        return Failure(Depthwise(node=m.conv.node, groups=g))
    if not isinstance(cin, int) or not isinstance(cout, int) or cin % g or cout % g:
        return Failure(Malformed(node=m.conv.node, detail=f"channels {cin}->{cout} do not split into {g} groups"))
    if not low <= g <= high:
        return Failure(GroupsOutOfRange(node=m.conv.node, groups=g, low=low, high=high))
    return Success(replace(m, cg=cin // g, og=cout // g))


def _with_channels(spec: TensorSpec, channels: int) -> TensorSpec:
    return TensorSpec(shape=(spec.shape[0], channels, *spec.shape[2:]), dtype=spec.dtype)


def _plan(snap: GraphSnapshot, m: _Match) -> RewritePlan:
    # split(x) -> getitem_i -> conv_i(w[i], b[i], groups=1) -> cat(dim=1)
    g, base, conv, cg, og = m.conv.groups, m.conv.node, m.node, m.cg, m.og
    piece, out = _with_channels(m.x, cg), _with_channels(m.out, og)
    split = NewNode(
        name=f"{base}_split",
        target=SPLIT_OP[snap.dialect],
        args=(m.conv.x, (cg,) * g, 1),
        spec=(piece,) * g,
        provenance=base,
        source_fn="split",
    )
    consts: list[NewConstant] = []
    nodes: list[NewNode] = [split]
    convs: list[NodeRef] = []
    for i in range(g):
        consts.append(NewConstant(name=f"{base}_w{i}", expr=Slice(x=m.w, dim=0, start=i * og, stop=(i + 1) * og)))
        bias: NodeRef | None = None
        if m.b is not None:
            consts.append(NewConstant(name=f"{base}_b{i}", expr=Slice(x=m.b, dim=0, start=i * og, stop=(i + 1) * og)))
            bias = NodeRef(f"{base}_b{i}")
        item = NewNode(
            name=f"{base}_x{i}",
            target="getitem",
            args=(NodeRef(split.name), i),
            spec=piece,
            provenance=base,
            source_fn="getitem",
        )
        args, kwargs = respell(
            conv, {"input": NodeRef(item.name), "weight": NodeRef(f"{base}_w{i}"), "bias": bias, "groups": 1}
        )
        nodes += [
            item,
            NewNode(
                name=f"{base}_g{i}",
                target=conv.target,
                args=args,
                kwargs=kwargs,
                spec=out,
                provenance=base,
                source_fn=SOURCE_FN.get(conv.target),
            ),
        ]
        convs.append(NodeRef(f"{base}_g{i}"))
    cat = NewNode(
        name=f"{base}_cat",
        target="aten.cat.default",
        args=(tuple(convs), 1),
        spec=m.out,
        provenance=base,
        source_fn="cat",
    )
    return RewritePlan(
        rule=NAME, anchor=base, constants=tuple(consts), nodes=(*nodes, cat), replace=((base, cat.name),), erase=(base,)
    )


def _is_candidate(snap: GraphSnapshot, node: NodeSnapshot) -> bool:
    if node.op != "call_function" or node.target not in CONV_SCHEMAS:
        return False
    view = conv_view(snap, node)
    return isinstance(view, Failure) or view.unwrap().groups != 1


@final
@dataclass(frozen=True, slots=True)
class SplitGroupConv:
    """Split grouped convolutions with ``min_groups <= groups <= max_groups`` into parallel ones."""

    min_groups: int = 2
    max_groups: int = 10
    name: str = NAME

    def anchors(self, snap: GraphSnapshot) -> Iterable[NodeSnapshot]:
        """Every convolution with groups != 1 (and any whose arguments do not parse)."""
        return (n for n in snap.nodes if _is_candidate(snap, n))

    def plan_at(self, snap: GraphSnapshot, node: NodeSnapshot) -> Result[RewritePlan, Reason]:
        """The split plan at a grouped conv, or the reason it stays as it is."""
        return _match(snap, node, self.min_groups, self.max_groups).map(lambda m: _plan(snap, m))


def split_group_conv(min_groups: int = 2, max_groups: int = 10) -> SplitGroupConv:
    """The grouped-convolution splitting rule; 2..10 is upstream's empirical Neutron limit.

    >>> split_group_conv(max_groups=4)
    SplitGroupConv(min_groups=2, max_groups=4, name='split-group-conv')
    """
    return SplitGroupConv(min_groups=min_groups, max_groups=max_groups)

"""linear_to_conv2d: linear(x, W, b) => a 1x1 conv2d on x moved to NCHW and back (for NPUs whose
fast path is the convolution: Qualcomm HTP).

Every exported spelling of a linear (``linear``; ``permute_copy`` + ``addmm``/``mm``, wrapped in
``view_copy`` reshapes for a rank > 2 input; ``x @ W.T``; a weight stored (in, out) and read as it
is, GPT-2's ``Conv1D`` ``addmm(b, x, W)`` and ``x @ W``) on a rank 2, 3 or 4 input. The weight becomes a
derived constant ``(O, I, 1, 1)``: from a parameter, an earlier rule's derived constant, or the
integer weight behind a dequantize, re-spelled for the 4D weight with the same per-channel
parameters (axis 0 is still the output channels). The activations move with permute, unsqueeze
and squeeze only, so no size is ever written into the graph: batch and sequence stay dynamic.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeAlias, final

from returns.result import Failure, Result, Success

from fxpure import layout
from fxpure.layout import layout_reader
from fxpure.linear import Linear, is_linear, linear_input, linear_of, linear_root
from fxpure.pattern import Bound, Const, Match, OneOf, PatternRule, Planner, Var, dequantized, need, quantized_as, rule
from fxpure.plan import RewritePlan, constant_expr
from fxpure.reasons import Declined, Malformed, Reason, SymbolicShape, UnsupportedRank
from fxpure.snapshot import Arg, Dim, GraphSnapshot, NodeRef, NodeSnapshot, TensorSpec
from fxpure.weights import Permute, Reshape, WeightExpr

NAME = "linear-to-conv2d"
RANKS = (2, 3, 4)

Step: TypeAlias = tuple[str, int | tuple[int, ...]]
# input rank -> the activation's way to NCHW, and back to the linear's layout
TO_NCHW: Mapping[int, tuple[Step, ...]] = {
    2: (("unsqueeze", 2), ("unsqueeze", 3)),  # [N, I] -> [N, I, 1, 1]
    3: (("permute", (0, 2, 1)), ("unsqueeze", 2)),  # [B, T, I] -> [B, I, T] -> [B, I, 1, T]
    4: (("permute", (0, 3, 1, 2)),),  # [B, H, W, I] -> [B, I, H, W]
}
FROM_NCHW: Mapping[int, tuple[Step, ...]] = {
    2: (("squeeze", (2, 3)),),
    3: (("squeeze", (2,)), ("permute", (0, 2, 1))),
    4: (("permute", (0, 2, 3, 1)),),
}
# step -> its op (a Planner writes the edge program's ``_copy`` spelling of a view op)
VIEW_OPS: Mapping[str, str] = {
    "unsqueeze": "aten.unsqueeze.default",
    "squeeze": "aten.squeeze.dims",
    "permute": "aten.permute.default",
}

# x @ W.T + b in any spelling; W a constant or dequantize(W_int), or a constant W_io stored (in, out)
# (GPT-2's Conv1D: addmm(b, x, W_io); x @ W_io); b any (O,) tensor or none
PATTERN = linear_root(
    weight=OneOf(Const("w"), dequantized(Const("wq"), name="dqw")), bias=Var("b"), weight_in_out=Const("w_io")
)


def _moved(shape: tuple[Dim, ...], step: Step) -> tuple[Dim, ...]:
    """The shape after one step."""
    kind, arg = step
    if kind == "unsqueeze" and isinstance(arg, int):
        return (*shape[:arg], 1, *shape[arg:])
    if kind == "squeeze" and isinstance(arg, tuple):
        return tuple(d for i, d in enumerate(shape) if i not in arg)
    assert kind == "permute" and isinstance(arg, tuple)
    return tuple(shape[i] for i in arg)


@final
@dataclass(frozen=True, slots=True)
class _Site:
    """The linear, the input the conv reads (``linear_input``), that input's spec and the output's,
    and the per-tensor dequantize of the input and quantize of the output (``quantized_as``), if any
    (found once: the check and the planner read them)."""

    lin: Linear
    x: NodeRef
    own: bool
    spec: TensorSpec
    out: TensorSpec
    dq: NodeSnapshot | None
    q: NodeSnapshot | None


def _site(match: Match, b: Arg = None) -> Result[_Site, Reason]:
    """Input of rank 2..4 with static features, a (O, I) weight, and a bias of one value per output."""
    lin = linear_of(match)
    x, own = linear_input(match, lin)
    node, sites, out = lin.op.name, match.sites, lin.op.spec
    spec = match.snap.node(x.name).tensor_spec if x is not None else None
    # the flattened input, when the reshapes are the model's (a bmm's input is its own, a batch of matrices)
    at_x = sites["lin_in" if not own and "lin_in" in sites else "x"].path
    w = match.spec("w") or match.spec("wq") or _swapped(match.spec("w_io"))
    at_w = sites[next(k for k in ("w", "wq", "w_io") if k in sites)].path
    dq = match.bindings.get("dqw")  # a dequantized weight is re-spelled with its own spec
    if x is None or spec is None or w is None or out is None or (isinstance(dq, Bound) and dq.spec is None):
        return Failure(Malformed(node=node, detail="input, weight or output has no known shape", path=at_x))
    if len(spec.shape) not in RANKS:
        return Failure(UnsupportedRank(node=node, rank=len(spec.shape), allowed=RANKS, of="input dims", path=at_x))
    if len(w.shape) != 2:
        return Failure(UnsupportedRank(node=node, rank=len(w.shape), allowed=(2,), of="weight dims", path=at_w))
    if not isinstance(spec.shape[-1], int):
        return Failure(SymbolicShape(node=node, role="input", shape=spec.shape, path=at_x))
    # conv2d takes no empty channels (it would drop the bias) nor an empty spatial dim (it fails),
    # nor one the program lets be empty (a symbolic size the program does not declare 1 or more)
    moved = [d for d in spec.shape[1:-1] if match.snap.least(d) < 1]  # the dims moved to H, W
    if 0 in w.shape or moved:
        role, shape, at = ("weight", w.shape, at_w) if 0 in w.shape else ("input", spec.shape, at_x)
        symbolic = [d for d in moved if isinstance(d, str)] if role == "input" and 0 not in moved else []
        # (a GraphModule, ExportedProgram.module() say, holds no ranges and runs at 0 whatever was declared)
        whose = "the program declares" if match.snap.lifted else "a GraphModule, which checks no range, holds"
        can = f" when {symbolic[0]} is 0 ({whose} no minimum of 1 for it)" if symbolic else ""
        detail = f"{node}: the {role} {shape} is empty{can}, which a 1x1 conv2d does not compute as a linear does"
        return Failure(Declined(code="zero-size", node=node, detail=detail, path=at))
    bias = match.spec("b") if b is not None else None
    if b is not None and (bias is None or bias.shape != w.shape[:1]):
        detail = f"{node}: bias {bias.shape if bias else b!r} is not one value per output feature {w.shape[:1]}"
        return Failure(Declined(code="bias-not-per-channel", node=node, detail=detail, path=sites["b"].path))
    # permuted back from the conv's layout, a rank 3 or 4 result may have other strides than the
    # linear's output: no reader may depend on them (one of rank 2, squeezed from (N, O, 1, 1), is
    # contiguous whatever the conv's layout; a model's own flatten makes the product rank 2)
    at = sites["lin_out" if lin.view_out else "lin"].path
    reason = layout_reader(match.snap, lin.outer.name, path=at) if len(spec.shape) > 2 else None
    if reason is not None:
        return Failure(reason)
    return Success(
        _Site(lin, x, own, spec, out, quantized_as(match.snap, x.name), quantized_as(match.snap, lin.outer.name))
    )


def _swapped(spec: TensorSpec | None) -> TensorSpec | None:
    """A 2-D weight's spec (in, out) as (out, in) (any other rank as it is: declined as it is)."""
    return TensorSpec(shape=spec.shape[::-1], dtype=spec.dtype) if spec is not None and len(spec.shape) == 2 else spec


def _1x1(spec: TensorSpec | None) -> tuple[int, ...]:
    """A static (O, I) weight's shape as (O, I, 1, 1)."""
    assert spec is not None  # checked by _site
    return (*(d for d in spec.shape if isinstance(d, int)), 1, 1)


def _weight(
    p: Planner, lin: Linear, w: WeightExpr | None, wq: WeightExpr | None, dqw: Bound | None, w_io: WeightExpr | None
) -> NodeRef:
    """The (O, I, 1, 1) weight: a derived constant, or a new dequantize of the reshaped integer weight."""
    if w is not None:
        return p.const(Reshape(x=w, shape=_1x1(p.match.spec("w"))), f"{lin.op.name}_weight_1x1")
    if w_io is not None:  # stored (in, out): its transpose
        shape = _1x1(_swapped(p.match.spec("w_io")))
        return p.const(Reshape(x=Permute(x=w_io, dims=(1, 0)), shape=shape), f"{lin.op.name}_weight_1x1")
    assert wq is not None and dqw is not None and dqw.spec is not None  # bound together; _site checked the spec
    shape = _1x1(p.match.spec("wq"))
    int_w = p.const(Reshape(x=wq, shape=shape), f"{dqw.ref('input').name}_1x1", kind="buffer")
    name, out = f"{dqw.name}_1x1", TensorSpec(shape=shape, dtype=dqw.spec.dtype)
    axis = dqw.args.get("axis")
    if not isinstance(axis, int):  # per tensor
        return p.respell(dqw, name=name, spec=out, input=int_w)
    return p.respell(dqw, name=name, spec=out, input=int_w, axis=axis % 2)  # (O, I) -> (O, I, 1, 1): 0, 1 stay


def _steps(
    p: Planner, x: NodeRef, shape: tuple[Dim, ...], dtype: str, steps: tuple[Step, ...], name: str
) -> tuple[NodeRef, tuple[Dim, ...]]:
    """The activation moved by each step in turn (no size is written into a node), and its shape."""
    # each names its own function in source_fn_stack (``torch.permute``, ...), not the linear's
    # (nn.Linear): a partitioner grouping a model's linears by it finds the conv's views in none
    for i, step in enumerate(steps):
        target = VIEW_OPS[step[0]]
        shape = _moved(shape, step)
        spec = TensorSpec(shape=shape, dtype=dtype)
        x = p.node(target, (x, step[1]), name=f"{name}{i}", spec=spec, source_fn=step[0])
    return x, shape


def _conv(p: Planner, x: NodeRef, weight: NodeRef, b: Arg, name: str, spec: TensorSpec) -> NodeRef:
    """The 1x1 conv: ``conv2d`` (a PT2E quantizer annotates that), which a program of Core ATen ops
    (edge; aten after ``run_decompositions()``) gets as ``convolution`` (``Planner.call``)."""
    fn = "convolution" if p.decomposed else "conv2d"
    return p.call("aten.conv2d.default", name=name, spec=spec, source_fn=fn, input=x, weight=weight, bias=b)


def _plan(
    p: Planner,
    site: _Site,
    b: Arg = None,
    w: WeightExpr | None = None,
    wq: WeightExpr | None = None,
    dqw: Bound | None = None,
    w_io: WeightExpr | None = None,
) -> RewritePlan:
    # x -> to NCHW -> conv2d(W.reshape(O, I, 1, 1), b) -> back to x's layout (the model's own reshape after)
    lin, spec, out, own = site.lin, site.spec, site.out, site.own
    rank, base = len(spec.shape), lin.op.name
    nchw, conv_in = _steps(p, site.x, spec.shape, spec.dtype, TO_NCHW[rank], f"{base}_nchw")
    # a quantized program keeps dequantize -> conv -> quantize around the views (a backend lowers that)
    dq, q = site.dq, site.q
    if dq is not None:
        nchw = p.requantize(nchw, dq, name=f"{base}_nchw", spec=TensorSpec(shape=conv_in, dtype=spec.dtype))
    conv_spec = TensorSpec(shape=(conv_in[0], out.shape[-1], *conv_in[2:]), dtype=out.dtype)
    conv = _conv(p, nchw, _weight(p, lin, w, wq, dqw, w_io), b, f"{base}_conv", conv_spec)
    if q is not None:
        conv = p.requantize(conv, q, name=f"{base}_conv", spec=conv_spec)
    result, _ = _steps(p, conv, conv_spec.shape, out.dtype, FROM_NCHW[rank], f"{base}_back")
    if lin.view_out is not None and not own:  # the model's reshape, on the new result
        result = p.respell(lin.view_out, name=f"{lin.view_out.name}_new", self=result)
    return p.replace(lin.outer, result)  # the erased reshapes' sizes (sym_size, mul) go with them


DYNAMIC = "dynamic-quantization"


def _static_input(site: _Site, match: Match) -> Reason | None:
    """The input is not quantized at run time (``choose_qparams``: dynamic quantization): the q/dq
    pair on its 4-d view would read parameters computed from the linear's input, a chain XNNPACK
    cannot partition (a dependency cycle), and the NPUs this rule is for quantize statically."""
    dq = site.dq
    # (parameters given as 0-d tensors, ``dequantize_per_tensor.tensor``, are static where constant)
    if dq is None or all(type(a) is not NodeRef or constant_expr(match.snap, a.name) is not None for a in dq.args[1:3]):
        return None
    detail = f"{site.lin.op.name}: its input {dq.name} is quantized at run time (scale and zero point are computed)"
    return Declined(code=DYNAMIC, node=site.lin.op.name, detail=detail)


def _linear(root: Bound, snap: GraphSnapshot) -> bool:
    return is_linear(snap, root.node, in_out=True)


LINEAR_TO_CONV2D = rule(
    NAME,
    PATTERN,
    need.compute(
        "site",
        _site,
        codes=(
            "malformed-node",
            "unsupported-rank",
            "symbolic-shape",
            "zero-size",
            "bias-not-per-channel",
            layout.CODE,
        ),
    ),
    need.check(_static_input, codes=(DYNAMIC,), at="x"),  # (located at the input it judges)
    plan=_plan,
    candidate=_linear,  # not attention's q @ k.T
    # a linear whose output a later linear's flattening view reads (aten, through a GELU: GPT-2's
    # MLP) is layout-sensitive until that linear is a conv, whose permute reads any layout
    repeat=True,
)


def linear_to_conv2d() -> PatternRule:
    """Every linear on a rank 2..4 input as a 1x1 conv2d, float or behind a dequantized weight.

    >>> from fxpure.reasons import GENERIC_CODES
    >>> sorted(linear_to_conv2d().codes - GENERIC_CODES)
    ['arg-mismatch', 'bias-not-per-channel', 'dynamic-quantization', 'layout-sensitive-reader', 'not-constant', \
'output-shared', 'runs-exhausted', 'symbolic-shape', 'unsupported-rank', 'wrong-op', 'zero-size']
    """
    return LINEAR_TO_CONV2D

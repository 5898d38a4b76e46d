"""Plans as data, the pure ``rewrite`` that applies them to a snapshot, and ``plan``."""

from __future__ import annotations

import gc
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol, final, get_args

from pyrsistent import PMap as PMapType
from pyrsistent import pmap, pvector
from pyrsistent.typing import PMap
from returns.result import Failure, Result, Success

from fxpure.families import ADDMM, CAST, CONV, LINEAR, MATMUL, MM, PERMUTE, SELECT, SLICE, TRANSPOSE, TRANSPOSE_DIMS
from fxpure.frozen import FrozenDict
from fxpure.reasons import Declined, NotConstant, PlanConflict, Reason
from fxpure.snapshot import (
    Arg,
    ConstantInfo,
    ConstantKind,
    DTypeArg,
    GraphSnapshot,
    KnownConstants,
    NodeRef,
    NodeSnapshot,
    Opaque,
    Spec,
    TensorSpec,
    derive,
    ref_list,
    refs,
)
from fxpure.weights import (
    FLOAT_DTYPES,
    INT_DTYPES,
    Binary,
    Cast,
    Fill,
    MatMul,
    Permute,
    Reshape,
    Slice,
    Source,
    SumOver,
    Unary,
    WeightExpr,
    infer_spec,
    known_values,
    sources,
    work_dtype,
)


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class NewConstant:
    """A derived constant the plan adds, as an unmaterialised expression.

    ``name`` is its node's (made unique when taken). In an exported program its state-dict key is
    that name under the module the constants it reads share (``layer1.conv2d_bn_weight``), of
    those the snapshot still holds (an earlier stage's derived weight reads constants it removed:
    then at the root); in a GraphModule it is an attribute of the root module."""

    name: str
    expr: WeightExpr
    kind: ConstantKind = "parameter"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class NewNode:
    """A ``call_function`` node the plan adds; meta is inherited from ``provenance``."""

    name: str
    target: str
    args: tuple[Arg, ...]
    kwargs: PMap[str, Arg] = field(default_factory=lambda: pmap())
    spec: Spec = None
    provenance: str | None = None
    source_fn: str | None = None  # e.g. "split": the user-level function, for quantizer metadata


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class RewritePlan:
    """What one rule does at one anchor: add constants and nodes, redirect, erase.

    Names in ``constants`` and ``nodes`` are local: ``rewrite`` makes them unique.
    New nodes go, in order, just before the earliest node whose uses they take. A new node may
    read a node whose uses its plan takes (a node inserted after another, such as a clamp after
    a relu): it keeps reading it, and the plan's nodes go just after the last such node.
    ``erase`` nodes must end unused; ``prune`` nodes (which other plans may
    still read, such as a shared dequantize) go only if they do. Constants
    left without users by the rewrite are dropped. ``instead_of``: the plan is
    a rule's fallback for a candidate it declined, for this reason.
    """

    rule: str
    anchor: str
    constants: tuple[NewConstant, ...] = ()
    nodes: tuple[NewNode, ...] = ()
    replace: tuple[tuple[str, str], ...] = ()
    erase: tuple[str, ...] = ()
    prune: tuple[str, ...] = ()
    instead_of: Reason | None = None

    @property
    def claims(self) -> frozenset[str]:
        """Existing nodes this plan consumes (erases, or takes the uses of); two plans must not
        share one. The anchor is not claimed unless consumed: a group's shared input is not."""
        return frozenset({*self.erase, *(old for old, _ in self.replace)})


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class Rejection:
    """A candidate anchor a rule declined, with the typed reason."""

    rule: str
    node: str
    reason: Reason


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class RewriteReport:
    """Every candidate as a plan or a rejection, plus the rewritten snapshot."""

    plans: tuple[RewritePlan, ...]
    rejections: tuple[Rejection, ...]
    before: GraphSnapshot
    after: GraphSnapshot
    stages: tuple[tuple[RewritePlan, ...], ...] = ()


class Rule(Protocol):
    """A rewrite rule: candidate anchors, and a pure planner per anchor. A rule whose ``repeat``
    attribute is True runs again on its own result while it plans (:func:`runs`)."""

    @property
    def name(self) -> str:
        """Stable kebab-case rule name."""
        ...

    def anchors(self, snap: GraphSnapshot) -> Iterable[NodeSnapshot]:
        """Every node this rule considers; each ends as a plan or a rejection."""
        ...

    def plan_at(self, snap: GraphSnapshot, node: NodeSnapshot) -> Result[RewritePlan, Reason]:
        """The plan at ``node``, or why there is none."""
        ...


def check_rules(rules: object) -> tuple[Rule, ...]:
    """``rules`` (a list, or any iterable of them) as a tuple of rules, or a TypeError that says
    what was expected.

    >>> check_rules("fuse-conv-bn")
    Traceback (most recent call last):
    TypeError: rules must be a list of rules such as [fuse_conv_bn()], got str
    """
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Iterable):
        raise TypeError(f"rules must be a list of rules such as [fuse_conv_bn()], got {type(rules).__name__}")
    rules = tuple(rules)
    for r in rules:
        if callable(r) and not hasattr(r, "plan_at"):
            name = getattr(r, "__name__", repr(r))
            raise TypeError(f"{name} makes a rule: call it ({name}()) and pass what it returns")
        if not (isinstance(getattr(r, "name", None), str) and callable(getattr(r, "plan_at", None))):
            raise TypeError(f"expected a rule (name, anchors, plan_at) such as fuse_conv_bn(), got {r!r}")
    return rules


def _check_snapshot(snap: object) -> None:
    if not isinstance(snap, GraphSnapshot):
        detail = "capture a program first: adapters.capture(program)"
        raise TypeError(f"expected a GraphSnapshot ({detail}), got {type(snap).__name__}")


# ops that lay a tensor's elements out in another shape, in the same order (a layer scale's
# ``gamma[:, None, None]`` or ``gamma.view(1, -1, 1, 1)``), or copy them as they are (a
# ``torch.tensor(...)`` made in forward is read through ``lift_fresh_copy`` and ``detach_``, on edge
# through ``_clone_dim_order``): of a constant, a constant
RESHAPES = frozenset(
    {
        f"aten.{op}{copy}.{overload}"
        for op, overload in (
            ("view", "default"),
            ("unsqueeze", "default"),
            ("squeeze", "default"),
            ("squeeze", "dim"),
            ("squeeze", "dims"),
            ("alias", "default"),
            ("detach", "default"),
        )
        for copy in ("", "_copy")
    }
    | {"aten._unsafe_view.default", "aten.reshape.default", "aten.lift_fresh_copy.default", "aten.detach_.default"}
    | {"aten.clone.default", "dim_order_ops._clone_dim_order.default", "aten.contiguous.default"}
)


# elementwise ops on floating tensors that ``WeightExpr`` computes as torch does: one dtype (a 16-bit
# float widened to float32 and rounded back after each op, as torch's CPU kernels compute them)
BINARY_OPS: Mapping[str, Literal["add", "sub", "mul", "div"]] = {
    f"aten.{op}.{overload}": op for op in ("add", "sub", "mul", "div") for overload in ("Tensor", "Scalar")
} | {f"aten.true_divide.{overload}": "div" for overload in ("Tensor", "Scalar")}
UNARY_OPS: Mapping[str, Literal["sqrt", "rsqrt", "neg", "reciprocal", "abs", "sign"]] = {
    f"aten.{op}.default": op for op in ("sqrt", "rsqrt", "neg", "reciprocal", "abs", "sign")
}
# the powers torch's CPU kernel computes as these ops (``x ** 2`` as ``x * x``)
POWERS: Mapping[float, Literal["square", "sqrt", "rsqrt", "reciprocal"]] = {
    2: "square",
    0.5: "sqrt",
    -0.5: "rsqrt",
    -1: "reciprocal",
}
# a sum over dims, and weight normalisation (``v * (g / ||v||)``, the norm over every dim but ``dim``)
POW, SUM, WEIGHT_NORM = "aten.pow.Tensor_Scalar", "aten.sum.dim_IntList", "aten._weight_norm.default"
# ``x.square()`` is ``x * x``; ``rsub(x, c)`` is ``c - x``
SQUARE, RSUB = "aten.square.default", frozenset({"aten.rsub.Scalar", "aten.rsub.Tensor"})
# permutes (edge computes a weight norm over dim 1 through one), and copies to a floating dtype with
# nothing else changed (``to_edge`` lifts a number as a float32 or int64 tensor and copies it to the
# model's dtype)
PERMUTES = PERMUTE.targets | TRANSPOSE.targets | TRANSPOSE_DIMS.targets  # permute, t, transpose(dim0, dim1)
CASTS = CAST.targets  # _to_copy, to.dtype, edge's _to_dim_order_copy
# a matrix product (by a matrix, or by a vector: ``matmul`` of (m, k) and (k,)), as torch computes it in
# the operands' dtype, which :class:`~fxpure.weights.MatMul` computes with the same kernel
PRODUCTS = MM.targets | MATMUL.targets
# a run of a constant's elements along one dim (``t[1:5]``, step 1; ``t.narrow(0, 1, 4)``), or one of
# them (``t[1]``, the dim dropped)
NARROW = "aten.narrow.default"
SLICES, SELECTS = SLICE.targets | {NARROW}, SELECT.targets


def constant_expr(snap: GraphSnapshot, name: str) -> WeightExpr | None:
    """The expression for the constant behind node ``name``, or None if it is not one: a parameter,
    buffer or lifted constant, an earlier rule's derived one, or a node of static shape that computes
    one from constants (and numbers): a reshape (:data:`RESHAPES`), a permute, a copy to a floating
    dtype (:data:`CASTS`), floating elementwise arithmetic (:data:`BINARY_OPS`
    and ``rsub`` with ``alpha=1``, :data:`UNARY_OPS`, ``square``, the :data:`POWERS`), such
    as the scale ``weight * (running_var + eps).rsqrt()`` of a frozen batch norm, a matrix product
    of two (:data:`PRODUCTS`: ``mm``, and ``matmul`` of a matrix by a matrix or a vector, or of a
    vector by a matrix, a merged LoRA's ``W + B @ A``), a sum over dims
    or a weight normalisation (float32 or float64), a slice with step 1, a ``narrow`` or an index along
    a dim (:data:`SLICES`, :data:`SELECTS`: ``gamma[1:5]``, ``t[0]``), and that the program does not write in place
    (``snap.written``). :func:`computed_by` names the nodes that compute it.

    >>> from fxpure.testing import GraphBuilder
    >>> g = GraphBuilder()
    >>> v = g.buffer("var", (4,))
    >>> s = g.call("aten.rsqrt.default", self=g.call("aten.add.Tensor", self=v, other=1e-5, out=(4,)), out=(4,))
    >>> g.output(s)
    >>> constant_expr(g.build(), "rsqrt").op, computed_by(g.build(), "rsqrt")
    ('rsqrt', ('rsqrt', 'add'))
    """
    return _constant(snap, name, {}, 0)


# how many computing nodes deep a constant may be: a long chain of elementwise ops on an activation
# is given up on this far from where it was asked about, not followed to the input
MAX_DEPTH = 32


def _constant(snap: GraphSnapshot, name: str, seen: dict[str, WeightExpr | None], depth: int) -> WeightExpr | None:
    if name in seen:  # a node the expression reads twice is found once
        return seen[name]
    info = snap.constants.get(name)
    if info is not None:
        return info.source if info.source is not None else Source(key=name, spec=info.spec)
    node = snap.nodes[snap.index[name]] if name in snap.index and name not in snap.written else None
    spec = node.tensor_spec if node is not None and node.op == "call_function" else None
    if node is None or spec is None or not spec.is_static or depth == MAX_DEPTH:
        return None
    out: WeightExpr | None = None
    if node.target in RESHAPES:
        source = node.args[0] if node.args else None
        inner = _constant(snap, source.name, seen, depth + 1) if type(source) is NodeRef else None
        out = None if inner is None else Reshape(x=inner, shape=tuple(d for d in spec.shape if isinstance(d, int)))
    elif node.target in PERMUTES or node.target in CASTS:
        out = _layout(snap, node, spec, seen, depth + 1)
    elif node.target in BINARY_OPS or node.target in UNARY_OPS or node.target in RSUB or node.target in (POW, SQUARE):
        out = _arithmetic(snap, node, spec, seen, depth + 1)
    elif node.target in (SUM, WEIGHT_NORM) and spec.dtype in ("float32", "float64"):
        out = _reduced(snap, node, spec, seen, depth + 1)
    elif node.target in SLICES or node.target in SELECTS:
        out = _narrowed(snap, node, spec, seen, depth + 1)
    elif node.target in PRODUCTS:
        out = _product(snap, node, spec, seen, depth + 1)
    seen[name] = out
    return out


def _operand(
    snap: GraphSnapshot, arg: Arg, spec: TensorSpec, seen: dict[str, WeightExpr | None], depth: int
) -> WeightExpr | None:
    """A tensor operand of ``spec``'s dtype as an expression, or None (not a constant, or another
    dtype: torch would promote)."""
    expr = _constant(snap, arg.name, seen, depth) if type(arg) is NodeRef else None
    found = infer_spec(expr) if expr is not None else None
    return expr if isinstance(found, Success) and found.unwrap().dtype == spec.dtype else None


def _product(
    snap: GraphSnapshot, node: NodeSnapshot, spec: TensorSpec, seen: dict[str, WeightExpr | None], depth: int
) -> WeightExpr | None:
    """``a @ b`` of two constants of the product's dtype, a matrix by a matrix or a vector.

    >>> from fxpure.testing import GraphBuilder
    >>> g = GraphBuilder()
    >>> a, b = g.parameter("lora_a", (2, 8)), g.parameter("lora_b", (6, 2))
    >>> g.output(g.call("aten.mm.default", self=b, mat2=a, out=(6, 8)))
    >>> e = constant_expr(g.build(), "mm")
    >>> type(e).__name__, e.a.key, e.b.key
    ('MatMul', 'lora_b', 'lora_a')
    """
    second = node.arg(1, "mat2" if node.target in MM.targets else "other")
    a, b = _operand(snap, node.arg(0, "self"), spec, seen, depth), _operand(snap, second, spec, seen, depth)
    if a is None or b is None:
        return None
    out: WeightExpr = MatMul(a=a, b=b)
    a_spec = infer_spec(a) if node.target in MATMUL.targets else None
    if isinstance(a_spec, Success) and len(a_spec.unwrap().shape) == 1:
        # a vector by a matrix, ``v @ W``: torch's matmul computes it as the row ``v[None] @ W`` (a
        # vector by a vector it computes as a dot product, which no expression here is)
        product = MatMul(a=Reshape(x=a, shape=(1, *a_spec.unwrap().shape)), b=b)
        found = infer_spec(product)  # (1, n), held as (n,)
        if not isinstance(found, Success) or len(found.unwrap().shape) != 2:
            return None
        out = Reshape(x=product, shape=tuple(d for d in found.unwrap().shape[1:] if isinstance(d, int)))
    found = infer_spec(out)
    return out if isinstance(found, Success) and found.unwrap() == spec else None


def _layout(
    snap: GraphSnapshot, node: NodeSnapshot, spec: TensorSpec, seen: dict[str, WeightExpr | None], depth: int
) -> WeightExpr | None:
    """A permute of a constant, or a constant copied to a floating dtype (the copy's
    other arguments, a memory format, dim order or device, place the elements, not their values)."""
    source = node.arg(0, "self")
    x = _constant(snap, source.name, seen, depth) if type(source) is NodeRef else None
    if x is None:
        return None
    if node.target in PERMUTES:
        dims = _order(node, len(spec.shape))
        out: WeightExpr | None = Permute(x=x, dims=dims) if dims is not None else None
    else:
        known = infer_spec(x)
        numeric = isinstance(known, Success) and known.unwrap().dtype in _CAST_FROM and spec.dtype in FLOAT_DTYPES
        out = Cast(x=x, dtype=spec.dtype) if numeric else None
    found = infer_spec(out) if out is not None else None
    return out if isinstance(found, Success) and found.unwrap() == spec else None


def _narrowed(
    snap: GraphSnapshot, node: NodeSnapshot, spec: TensorSpec, seen: dict[str, WeightExpr | None], depth: int
) -> WeightExpr | None:
    """A slice of a constant with step 1 (its bounds as Python takes them: negative from the end,
    clamped to the dim), or one index of it (``select``: the slice of one, its dim dropped).

    >>> from fxpure.testing import GraphBuilder
    >>> g = GraphBuilder()
    >>> t = g.parameter("t", (6, 3))
    >>> part = g.call("aten.slice.Tensor", self=t, dim=0, start=-4, end=100, out=(4, 3))
    >>> g.output(g.call("aten.select.int", self=part, dim=1, index=-1, out=(4,)))
    >>> e = constant_expr(g.build(), "select")
    >>> e.x.x.start, e.x.x.stop, e.x.dim, e.x.start, e.shape
    (2, 6, 1, 2, (4,))
    """
    source = node.arg(0, "self")
    x = _constant(snap, source.name, seen, depth) if type(source) is NodeRef else None
    known = infer_spec(x) if x is not None else None
    if x is None or not isinstance(known, Success):
        return None
    shape, dim = known.unwrap().shape, node.arg(1, "dim")
    dim = 0 if dim is None else dim  # (a slice's default)
    if type(dim) is not int or not -len(shape) <= dim < len(shape) or type(shape[dim]) is not int:
        return None
    size = shape[dim]
    if node.target in SELECTS:
        index = node.arg(2, "index")
        if type(index) is not int or not -size <= index < size:
            return None
        one = Slice(x=x, dim=dim % len(shape), start=index % size, stop=index % size + 1)
        out: WeightExpr = Reshape(x=one, shape=tuple(d for d in spec.shape if isinstance(d, int)))
    elif node.target == NARROW:  # (start, length): a start of -size .. size, the run within the dim
        start, length = node.arg(2, "start"), node.arg(3, "length")
        if type(start) is not int or type(length) is not int or not -size <= start <= size:
            return None
        start = start + size if start < 0 else start
        if length < 0 or start + length > size:
            return None
        out = Slice(x=x, dim=dim % len(shape), start=start, stop=start + length)
    else:
        start, end, step = node.arg(2, "start"), node.arg(3, "end"), node.arg(4, "step")
        start, end = 0 if start is None else start, size if end is None else end
        if type(start) is not int or type(end) is not int or step not in (None, 1):
            return None
        start, end = (min(max(b + size if b < 0 else b, 0), size) for b in (start, end))
        out = Slice(x=x, dim=dim % len(shape), start=start, stop=max(start, end))
    found = infer_spec(out)
    return out if isinstance(found, Success) and found.unwrap() == spec else None


# a copy to a floating dtype computes the same values wherever it runs: from a floating dtype, and
# from an integer or bool one (``to_edge`` lifts a model's ``w * 2`` as an int64 tensor copied to float)
_CAST_FROM = FLOAT_DTYPES | INT_DTYPES | {"bool"}


def _order(node: NodeSnapshot, rank: int) -> tuple[int, ...] | None:
    """The dims a permute, ``t`` or ``transpose(dim0, dim1)`` node takes its input's from, in order.

    >>> t = NodeSnapshot(name="t", op="call_function", target="aten.transpose.int", args=(NodeRef("w"), 0, -1))
    >>> _order(t, 3), _order(replace(t, target="aten.t.default", args=(NodeRef("w"),)), 2)
    ((2, 1, 0), (1, 0))
    """
    if node.target in PERMUTE.targets:
        dims = node.arg(1, "dims")
        ints = tuple(d for d in dims if type(d) is int) if type(dims) is tuple else ()
        return ints if type(dims) is tuple and len(ints) == len(dims) else None
    order = list(range(rank))
    a, b = (node.arg(1, "dim0"), node.arg(2, "dim1")) if node.target in TRANSPOSE_DIMS.targets else (0, 1)
    if type(a) is not int or type(b) is not int or not -rank <= min(a, b) <= max(a, b) < rank:
        return None if rank >= 2 else tuple(order)  # (t of a vector or a number is itself)
    order[a], order[b] = order[b], order[a]
    return tuple(order)


def _reduced(
    snap: GraphSnapshot, node: NodeSnapshot, spec: TensorSpec, seen: dict[str, WeightExpr | None], depth: int
) -> WeightExpr | None:
    """A float32 or float64 sum over dims (``dtype`` not given), or a weight normalisation, of constants."""
    x = _operand(snap, node.arg(0, "self" if node.target == SUM else "v"), spec, seen, depth)
    rank = len(infer_spec(x).unwrap().shape) if x is not None else 0
    if node.target == SUM:
        dims, keep = node.arg(1, "dim"), node.arg(2, "keepdim")
        if x is None or node.arg(3, "dtype") is not None or type(dims) is not tuple or not dims:
            return None
        # a 0-d tensor's sum over its dim 0 (or -1), which torch allows, is itself
        whole: WeightExpr = (
            SumOver(x=x, dims=tuple(d % rank for d in dims if type(d) is int), dtype=spec.dtype) if rank else x
        )
    else:
        g, dim = _operand(snap, node.arg(1, "g"), spec, seen, depth), node.arg(2, "dim")
        dim = 0 if dim is None else dim  # the schema's default
        if x is None or g is None or type(dim) is not int or not 0 <= dim < rank:  # -1: the whole tensor's norm
            return None
        # v * (g / sqrt(sum(v * v) over every dim but ``dim``)), the norm kept as a dim of 1
        kept = tuple(1 if i != dim else d for i, d in enumerate(infer_spec(x).unwrap().shape))
        others = tuple(i for i in range(rank) if i != dim)
        squares = (
            SumOver(x=Binary(op="mul", a=x, b=x), dims=others, dtype=spec.dtype)
            if others
            else Binary(op="mul", a=x, b=x)
        )
        norm = Reshape(x=Unary(op="sqrt", x=squares), shape=tuple(d for d in kept if isinstance(d, int)))
        whole = Binary(op="mul", a=x, b=Binary(op="div", a=g, b=norm))
    out = (
        Reshape(x=whole, shape=tuple(d for d in spec.shape if isinstance(d, int)))
        if node.target == SUM and keep
        else whole
    )
    found = infer_spec(out)
    return out if isinstance(found, Success) and found.unwrap() == spec else None


def _arithmetic(
    snap: GraphSnapshot, node: NodeSnapshot, spec: TensorSpec, seen: dict[str, WeightExpr | None], depth: int
) -> WeightExpr | None:
    """A floating elementwise op of constants and numbers as an expression, or None."""
    if spec.dtype not in FLOAT_DTYPES:
        return None
    work = work_dtype(spec.dtype)
    operands: list[WeightExpr] = []
    unary = node.target in UNARY_OPS or node.target in (POW, SQUARE)
    rounded = node.target in RSUB or BINARY_OPS.get(node.target) in ("add", "sub")
    for arg in (node.arg(0, "self"),) if unary else (node.arg(0, "self"), node.arg(1, "other")):
        if type(arg) is NodeRef:
            expr = _operand(snap, arg, spec, seen, depth)
            if expr is None:
                return None
            operands.append(expr if work == spec.dtype else Cast(x=expr, dtype=work))
        elif isinstance(arg, int | float) and not isinstance(arg, bool):
            # torch's CPU add and sub of a float16 or bfloat16 tensor round a number to its dtype
            # first (``1.0001 - g`` is ``1.0 - g``); mul and div take it as a float32
            number = Fill(shape=(), value=float(arg), dtype=spec.dtype if rounded else work)
            operands.append(number if number.dtype == work else Cast(x=number, dtype=work))
        else:
            return None
    if node.target in UNARY_OPS:
        out: WeightExpr = Unary(op=UNARY_OPS[node.target], x=operands[0])
    elif node.target == SQUARE:
        out = Binary(op="mul", a=operands[0], b=operands[0])
    elif node.target == POW:
        exponent = node.arg(1, "exponent")
        power = POWERS.get(exponent) if isinstance(exponent, int | float) else None
        if power is None:
            return None
        x = operands[0]
        out = Binary(op="mul", a=x, b=x) if power == "square" else Unary(op=power, x=x)
    elif node.arg(2, "alpha") not in (None, 1):  # torch computes a + alpha * b in one rounding
        return None
    elif node.target in RSUB:  # other - self
        out = Binary(op="sub", a=operands[1], b=operands[0])
    else:
        out = Binary(op=BINARY_OPS[node.target], a=operands[0], b=operands[1])
    out = out if work == spec.dtype else Cast(x=out, dtype=spec.dtype)
    found = infer_spec(out)
    return out if isinstance(found, Success) and found.unwrap() == spec else None


def computed_by(snap: GraphSnapshot, name: str) -> tuple[str, ...]:
    """The nodes that compute the constant :func:`constant_expr` finds behind node ``name`` (none
    for a constant itself), from ``name`` back: a rule that folds the constant drops them once
    unused."""
    if constant_expr(snap, name) is None:
        return ()
    out: dict[str, None] = {}
    todo, constants = [name], snap.constant_names
    while todo:
        n = todo.pop()
        if n in out or n in constants:
            continue
        out[n] = None
        todo.extend(r for r in ref_list(snap.nodes[snap.index[n]]) if r not in constants)
    return tuple(out)


def constant_operand(snap: GraphSnapshot, node: str, role: str, arg: Arg) -> Result[WeightExpr, NotConstant]:
    """The constant expression behind operand ``arg`` of ``node``, or why it is not a constant.

    >>> from fxpure.snapshot import snapshot
    >>> constant_operand(snapshot([], {}), "conv", "bias", NodeRef("b")).failure().message
    "bias of conv is not a constant (it is computed by 'b')"
    """
    expr = constant_expr(snap, arg.name) if isinstance(arg, NodeRef) else None
    if expr is None:
        return Failure(not_constant(node, role, arg, how=held(snap, arg)))
    return Success(expr)


def held(snap: GraphSnapshot, value: Arg) -> str:
    """How the program holds ``value`` where it is no constant and no node computes it, as
    :func:`not_constant` takes it ("" where a node does): held as no plain data (:attr:`GraphSnapshot.opaque`),
    a state tensor the program writes in place, or an input the caller passes."""
    if not isinstance(value, NodeRef) or value.name not in snap.index:
        return ""
    if value.name in snap.opaque:
        return "held as a sparse, nested or subclass tensor: no data to fold"
    op = snap.node(value.name).op
    if op in ("placeholder", "get_attr") and value.name in snap.written:
        return "which the program writes"
    return "an input of the program" if op == "placeholder" and value.name not in snap.constant_names else ""


def not_constant(node: str, role: str, value: Arg, path: str = "", *, how: str = "") -> NotConstant:
    """Why operand ``role`` of ``node``, given as ``value``, is not a constant: a node computes it,
    it is a number or absent, or (``how``, from :func:`held`) how the program holds it otherwise.

    >>> not_constant("bn", "running_mean", None).message
    'running_mean of bn is not a constant tensor (it is absent)'
    >>> not_constant("lin", "weight", NodeRef("w"), "lin.weight", how="an input of the program")
    NotConstant(code='not-constant', node='lin', path='lin.weight', role='weight', \
source='w, an input of the program', computed=False)
    >>> not_constant("lin", "weight", NodeRef("w")).message
    "weight of lin is not a constant (it is computed by 'w')"
    """
    if isinstance(value, NodeRef) and how:
        return NotConstant(node=node, role=role, source=f"{value.name}, {how}", computed=False, path=path)
    if isinstance(value, NodeRef):
        return NotConstant(node=node, role=role, source=value.name, path=path)
    shown = "absent" if value is None else f"the literal {value!r}"
    return NotConstant(node=node, role=role, source=shown, computed=False, path=path)


@final
@dataclass(slots=True)
class _Taken:
    """The names a new node or constant, or a new constant's key, must not take: the snapshot's
    nodes, reserved names and constant keys, and those the rewrite gave so far (no set of them all
    is built: a rewrite of a few nodes costs in proportion)."""

    snap: GraphSnapshot
    given: set[str] = field(default_factory=set)

    def __contains__(self, name: str) -> bool:
        snap = self.snap
        return name in self.given or name in snap.index or name in snap.reserved or name in snap.constant_keys

    def add(self, name: str) -> None:
        self.given.add(name)


def _fresh(name: str, used: _Taken) -> str:
    candidate, i = name, 0
    while candidate in used:
        i += 1
        candidate = f"{name}_{i}"
    used.add(candidate)
    return candidate


def _rename(arg: Arg, names: Mapping[str, str]) -> Arg:
    # exact types (cheaper than isinstance): an argument tree holds NodeRef (final) and plain tuples
    if type(arg) is NodeRef:
        return NodeRef(names.get(arg.name, arg.name))
    if type(arg) is tuple or isinstance(arg, list):  # a hand-written plan's list (no Arg) becomes a tuple
        return tuple(_rename(a, names) for a in arg)
    return arg


def _renamed(node: NodeSnapshot, names: Mapping[str, str]) -> NodeSnapshot:
    for r in ref_list(node):
        if r in names:
            break
    else:
        return node
    kwargs = node.kwargs
    return NodeSnapshot(
        name=node.name,
        op=node.op,
        target=node.target,
        args=tuple([_rename(a, names) for a in node.args]),
        kwargs=pmap({k: _rename(v, names) for k, v in kwargs.items()}) if kwargs else kwargs,
        spec=node.spec,
        provenance=node.provenance,
        source_fn=node.source_fn,
    )


_EXPRS = get_args(WeightExpr)


def _is_spec(spec: object) -> bool:
    """``spec`` is a ``Spec``: None, a TensorSpec, or a tuple of TensorSpecs and Nones."""
    return (
        spec is None
        or isinstance(spec, TensorSpec)
        or (isinstance(spec, tuple) and all(s is None or isinstance(s, TensorSpec) for s in spec))
    )


def malformed(p: RewritePlan) -> str | None:
    """What in ``p`` is not of the type its record declares (a hand-written plan's slip that the
    type checker would catch: a list of names, a target of None, a float for an expression), or
    None. Expressions are checked when their spec is inferred.

    >>> malformed(RewritePlan(rule="r", anchor="a", replace=(("a",),)))
    "replace holds ('a',), not a pair of node names"
    """
    if not isinstance(p.constants, tuple) or not all(
        type(c) is NewConstant
        and type(c.name) is str
        and c.name.isidentifier()
        and isinstance(c.expr, _EXPRS)
        and c.kind in ("parameter", "buffer", "constant")
        for c in p.constants
    ):
        return f"constants {p.constants!r} are no tuple of NewConstant(identifier, expression, kind)"
    if not isinstance(p.nodes, tuple) or not all(
        type(n) is NewNode
        and type(n.name) is str
        and n.name.isidentifier()
        and type(n.target) is str
        and type(n.args) in (tuple, list)
        and (type(n.kwargs) is PMapType or isinstance(n.kwargs, Mapping))
        and (type(n.spec) is TensorSpec or _is_spec(n.spec))
        for n in p.nodes
    ):
        return f"nodes {p.nodes!r} are no tuple of NewNode(identifier, target, args, kwargs, spec)"
    if not isinstance(p.replace, tuple):
        return f"replace {p.replace!r} is no tuple of pairs of node names"
    for pair in p.replace:
        if not (isinstance(pair, tuple) and len(pair) == 2 and all(type(n) is str for n in pair)):
            return f"replace holds {pair!r}, not a pair of node names"
    for what, names in (("erase", p.erase), ("prune", p.prune)):
        if not isinstance(names, tuple) or not all(type(n) is str for n in names):
            return f"{what} {names!r} is no tuple of node names"
    return None


_LEAVES = (int, float, str, NodeRef, DTypeArg, Opaque, type(None))
_LEAF_TYPES = frozenset({*_LEAVES, bool})


def _foreign(args: Iterable[object]) -> object:
    """The first value in an argument tree that is no ``Arg`` (a tensor, say), else ``_LEAVES``."""
    for a in args:
        kind = type(a)
        if kind in _LEAF_TYPES:  # (exact types first: the common case, and cheap)
            continue
        if isinstance(a, tuple | list):
            found = _foreign(a)
            if found is not _LEAVES:
                return found
        elif not isinstance(a, _LEAVES):
            return a
    return _LEAVES


def _conflict(node: str, detail: str) -> Result[GraphSnapshot, PlanConflict]:
    return Failure(PlanConflict(node=node, detail=detail))


SAME_DTYPE = CONV.targets | LINEAR.targets | ADDMM.targets | MM.targets | MATMUL.targets
"""Ops whose tensor operands torch requires to share one dtype: a float16 conv given a float32
bias fails when the program runs."""


def mixed_dtypes(snap: GraphSnapshot, p: RewritePlan, specs: Mapping[str, Spec]) -> PlanConflict | None:
    """A new node of ``p`` that reads tensors of two dtypes where torch takes one
    (:data:`SAME_DTYPE`); ``specs``: those of ``p``'s new constants, by their names in ``p``.

    >>> from fxpure.testing import GraphBuilder
    >>> g = GraphBuilder()
    >>> x, w = g.input("x", (1, 2, 4, 4), dtype="float16"), g.parameter("w", (2, 2, 1, 1), dtype="float16")
    >>> g.output(g.call("aten.conv2d.default", name="conv", input=x, weight=w, out=(1, 2, 4, 4)))
    >>> conv = NewNode(name="c", target="aten.conv2d.default", args=(x, w, NodeRef("b")))
    >>> p = RewritePlan(rule="r", anchor="conv", nodes=(conv,), replace=(("conv", "c"),), erase=("conv",))
    >>> mixed_dtypes(g.build(), p, {"b": TensorSpec(shape=(2,), dtype="float32")}).message
    'conv: new node c reads tensors of dtypes float16 (x) and float32 (b): aten.conv2d.default takes one'
    """
    local: dict[str, Spec] = {n.name: n.spec for n in p.nodes}
    for n in p.nodes:
        if n.target not in SAME_DTYPE:
            continue
        seen: dict[str, str] = {}  # dtype -> the first operand of it
        for r in refs((n.args, tuple(n.kwargs.values()))):
            if r in local or r in specs:
                spec = local[r] if r in local else specs[r]
            else:
                spec = snap.node(r).spec if r in snap.index else None
            if isinstance(spec, TensorSpec):
                seen.setdefault(spec.dtype, r)
        if len(seen) > 1:
            (a, x), (b, y) = list(seen.items())[:2]
            detail = f"new node {n.name} reads tensors of dtypes {a} ({x}) and {b} ({y}): {n.target} takes one"
            return PlanConflict(node=p.anchor, detail=detail)
    return None


def specs_differ(a: Spec, b: Spec) -> bool:
    """Two known specs of one value disagree: dtype, rank, or a size both know (a tuple's
    elements alike, its unknown ones skipped)."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) != len(b) or any(
            x is not None and y is not None and specs_differ(x, y) for x, y in zip(a, b, strict=True)
        )
    if not isinstance(a, TensorSpec) or not isinstance(b, TensorSpec):
        return isinstance(a, tuple) != isinstance(b, tuple)  # a tuple for a tensor, or a tensor for one
    if a.dtype != b.dtype or len(a.shape) != len(b.shape):
        return True
    return any(type(x) is int and type(y) is int and x != y for x, y in zip(a.shape, b.shape, strict=True))


def changed_values(snap: GraphSnapshot, p: RewritePlan, specs: Mapping[str, Spec]) -> PlanConflict | None:
    """A node whose uses ``p`` moves to a value of another dtype or shape, where both are known:
    its readers would compute on something else (a float16 conv standing for its float32 product
    with a constant, say); ``specs``: those of ``p``'s new constants, by their names in ``p``.

    >>> from fxpure.testing import GraphBuilder, spec
    >>> g = GraphBuilder()
    >>> x = g.input("x", (1, 2, 4, 4))
    >>> g.output(g.call("aten.relu.default", name="relu", self=x, out=(1, 2, 4, 4)))
    >>> half = NewNode(name="h", target="aten.relu.default", args=(x,), spec=spec(1, 2, 4, 4, dtype="float16"))
    >>> p = RewritePlan(rule="r", anchor="relu", nodes=(half,), replace=(("relu", "h"),), erase=("relu",))
    >>> changed_values(g.build(), p, {}).message
    'relu: new value h (float16[1, 2, 4, 4]) takes the uses of relu (float32[1, 2, 4, 4])'
    """
    local: dict[str, Spec] = {**specs, **{n.name: n.spec for n in p.nodes}}
    for old, new in p.replace:
        was = snap.node(old).spec if old in snap.index else None
        now = local[new] if new in local else (snap.node(new).spec if new in snap.index else None)
        if was is not None and now is None and new in local:  # nothing to check it against
            detail = f"new value {new} takes the uses of {old} ({shown(was)}) and declares no spec"
            return PlanConflict(node=p.anchor, detail=detail)
        if was is not None and now is not None and specs_differ(was, now):
            detail = f"new value {new} ({shown(now)}) takes the uses of {old} ({shown(was)})"
            return PlanConflict(node=p.anchor, detail=detail)
    return None


def shown(spec: Spec) -> str:
    """A spec as messages print it: ``float32[1, 8, 's0']``, a tuple's elements in parentheses."""
    if isinstance(spec, TensorSpec):
        return f"{spec.dtype}[{', '.join(map(str, spec.shape))}]"
    return "(" + ", ".join("?" if s is None else shown(s) for s in spec or ()) + ")"


def ill_fitting(snap: GraphSnapshot, p: RewritePlan, specs: Mapping[str, Spec]) -> PlanConflict | None:
    """What torch would refuse or change in ``p``'s new values: :func:`mixed_dtypes`, then
    :func:`changed_values`, then :func:`returns_written`."""
    return mixed_dtypes(snap, p, specs) or changed_values(snap, p, specs) or returns_written(snap, p)


def returns_written(snap: GraphSnapshot, p: RewritePlan) -> PlanConflict | None:
    """A program output whose value ``p`` moves to a tensor the program writes in place (``snap.written``:
    a buffer or input updated, in the graph or by the signature of a functional program): the
    program would return that tensor itself, which holds the written value when it returns, not the
    one the output computed before the write.

    >>> from fxpure.testing import GraphBuilder
    >>> g = GraphBuilder()
    >>> b = g.buffer("buf", (3,))
    >>> y = g.call("aten.mul.Tensor", name="y", self=b, other=1.0, out=(3,))
    >>> g.output(y, g.call("aten.add.Tensor", name="new_buf", self=b, other=1.0, out=(3,)))
    >>> snap = replace(g.build(), written=frozenset({"buf"}))
    >>> p = RewritePlan(rule="r", anchor="y", replace=(("y", "buf"),), erase=("y",))
    >>> returns_written(snap, p).message
    'y: the output y would return buf, which the program writes in place (its value after the write)'
    """
    for old, new in p.replace:
        if new in snap.written and any(snap.node(u).op == "output" for u in snap.users.get(old, ()) if u in snap.index):
            detail = (
                f"the output {old} would return {new}, which the program writes in place (its value after the write)"
            )
            return PlanConflict(node=p.anchor, detail=detail)
    return None


@final
@dataclass(slots=True)
class _Batch:
    """Working state of one ``rewrite`` call (local, never escapes)."""

    snap: GraphSnapshot
    used: _Taken
    redirect: dict[str, str] = field(default_factory=dict)
    before: dict[int, list[NodeSnapshot]] = field(default_factory=dict)
    new_constants: list[NodeSnapshot] = field(default_factory=list)
    infos: dict[str, ConstantInfo] = field(default_factory=dict)
    by_expr: dict[WeightExpr, str] = field(default_factory=dict)
    erase: set[str] = field(default_factory=set)
    prune: set[str] = field(default_factory=set)
    # new nodes that read a node whose uses their own plan takes: they keep reading it
    keep: dict[str, frozenset[str]] = field(default_factory=dict)

    @staticmethod
    def of(snap: GraphSnapshot) -> _Batch:
        """An empty batch on ``snap``: a new constant's name is also its key in the program, unique
        among nodes, keys and attributes; a derived constant already there is shared."""
        return _Batch(snap=snap, used=_Taken(snap), by_expr=dict(snap.derived))

    def add(self, p: RewritePlan) -> PlanConflict | None:
        snap, local, specs = self.snap, {}, {}
        named = [*(c.name for c in p.constants), *(n.name for n in p.nodes)]
        moved = [old for old, _ in p.replace]
        plan_names = set(named)
        if len(plan_names) < len(named) or len(set(moved)) < len(moved):  # which one a reference means is unclear
            name = next((n for n in named if named.count(n) > 1), None)
            detail = (
                f"plan gives two new values the name {name}"
                if name is not None
                else f"plan moves the uses of {next(n for n in moved if moved.count(n) > 1)} twice"
            )
            return PlanConflict(node=p.anchor, detail=detail)
        itself = next((old for old, new in p.replace if old == new and new not in plan_names), None)
        if itself is not None:  # (it changes nothing there; counted as a rewrite, it said the program changed)
            return PlanConflict(node=p.anchor, detail=f"plan moves the uses of {itself} to {itself} itself")
        for c in p.constants:
            spec = infer_spec(c.expr)  # (total: a field of another type, a list for a shape, is a BadExpr)
            if not isinstance(spec, Success):
                return PlanConflict(node=p.anchor, detail=f"constant {c.name}: {spec.failure().message}")
            specs[c.name] = spec.unwrap()
            if c.expr in self.by_expr:
                local[c.name] = self.by_expr[c.expr]
                continue
            name = local[c.name] = self.by_expr[c.expr] = _fresh(c.name, self.used)
            # in an exported program's state dict, the constant goes under the module of what it reads
            module = _module(snap, c.expr) if snap.lifted else ""
            key = _fresh(module + name, self.used) if module else name
            # a get_attr graph holds parameters and plain tensors (buffers), no lifted constants
            kind = c.kind if snap.lifted or c.kind == "parameter" else "buffer"
            info = ConstantInfo(kind=kind, key=key, spec=spec.unwrap(), source=c.expr, values=known_values(c.expr))
            self.infos[name] = info
            op = "placeholder" if snap.lifted else "get_attr"
            self.new_constants.append(NodeSnapshot(name=name, op=op, target=name, spec=spec.unwrap()))
        misfit = ill_fitting(snap, p, specs)
        if misfit is not None:
            return misfit
        for n in p.nodes:
            foreign = _foreign((*n.args, *n.kwargs.values()) if n.kwargs else n.args)
            if foreign is not _LEAVES:  # an adapter would print it into the program's code
                detail = f"new node {n.name} has an argument {type(foreign).__name__}, no node, number, string or dtype"
                return PlanConflict(node=p.anchor, detail=detail)
            local[n.name] = _fresh(n.name, self.used)
        taken = [old for old, _ in p.replace] or [p.anchor]
        missing = next((s for s in (*taken, *p.erase, *p.prune) if s not in snap.index), None)
        if missing is not None:
            detail = f"plan names {missing}, a node the graph does not have"
            # the usual cause: the plans of a rule that runs again, each made on the last run's result
            return PlanConflict(node=p.anchor, detail=f"{detail} (a later stage's plan? see RewriteReport.stages)")
        for name in (*p.erase, *p.prune):  # the program's signature is no plan's to change
            op = snap.nodes[snap.index[name]].op
            if op == "output" or (op == "placeholder" and name not in snap.constant_names):
                what = "output" if op == "output" else "input"
                return PlanConflict(node=p.anchor, detail=f"plan removes {name}, the program's {what}")
        renamed = {k: v for k, v in local.items() if k != v}  # usually none: plan-local names are unique
        made = [
            NodeSnapshot(
                name=local[n.name],
                op="call_function",
                target=n.target,
                args=(
                    n.args
                    if not renamed and type(n.args) is tuple and list not in map(type, n.args)
                    else tuple(_rename(a, renamed) for a in n.args)
                ),
                kwargs=(
                    n.kwargs
                    if not renamed
                    and isinstance(n.kwargs, PMapType)
                    and (not n.kwargs or list not in map(type, n.kwargs.values()))
                    else pmap({k: _rename(v, renamed) for k, v in n.kwargs.items()})
                ),
                spec=n.spec,
                provenance=_root(snap, n.provenance),
                source_fn=n.source_fn,
            )
            for n in p.nodes
        ]
        # a new node reading a node whose uses its plan takes keeps reading it, and the nodes go after it
        after: set[str] = set()
        for old, _ in p.replace:
            for m in made:
                if old in ref_list(m):
                    self.keep[m.name] = self.keep.get(m.name, frozenset()) | {old}
                    after.add(old)
        self.before.setdefault(placement(snap, p, read=after), []).extend(made)
        for old, new in p.replace:
            self.redirect[old] = local.get(new, new)
        self.erase.update(p.erase)
        self.prune.update(p.prune)
        # a new node that stands for a replaced one goes if another plan of the stage leaves it
        # unread (a node the plan adds for another purpose, an assert say, stays)
        self.prune.update(local[new] for _, new in p.replace if new in local)
        return None


def _void(snap: GraphSnapshot, plans: Sequence[RewritePlan]) -> dict[str, PlanConflict]:
    """The plans of a stage whose every replaced value would be read by nothing, by anchor, with why:
    each node reading it is one another plan erases, or drops once unread, reading through it and
    recomputing it (a chain of three linears merged pairwise after decompositions was reported as
    two merges, the first's new linear then dropped unread). Each would be reported as applied,
    and is not."""
    erased = {n: q.anchor for q in plans for n in (*q.erase, *(old for old, _ in q.replace))}
    pruned = {n: q.anchor for q in plans for n in q.prune}
    # the plans whose new nodes read each node (a quantized conv's next one reads its quantize, taken over)
    read: dict[str, set[str]] = {}
    for q in plans:
        for n in q.nodes:
            for r in refs((n.args, tuple(n.kwargs.values()))):
                read.setdefault(r, set()).add(q.anchor)
    dropped: dict[str, bool] = {}

    def gone(name: str) -> bool:  # erased, or pruned and read by nothing left
        if name not in dropped:
            dropped[name] = False  # (a cycle keeps it)
            dropped[name] = name in erased or (
                name in pruned and name not in read and all(gone(u) for u in snap.users.get(name, ()))
            )
        return dropped[name]

    out = {}
    for p in plans:
        mine, olds = p.claims | set(p.prune), {old for old, _ in p.replace}
        if any(read.get(old, set()) - {p.anchor} for old in olds):
            continue
        readers = sorted({u for old in olds for u in snap.users.get(old, ()) if u not in mine})
        if readers and all(gone(u) for u in readers):
            by = erased.get(readers[0]) or pruned[readers[0]]
            detail = f"what it makes is read by nothing: {readers[0]}, which reads it, goes with the plan at {by}"
            out[p.anchor] = PlanConflict(node=p.anchor, detail=detail, path="plan")
    return out


def _misfits(snap: GraphSnapshot, plans: Sequence[RewritePlan]) -> dict[str, PlanConflict]:
    """The plans of a stage ``rewrite`` refused that do not fit on their own, by anchor, with why
    (what one plan gets wrong is its own: the others are still rewritten). Only when a rewrite fails."""
    batch, out = _Batch.of(snap), {}
    for p in plans:  # (of the stage: each found well-formed)
        err = batch.add(p)
        if err is not None:
            out[p.anchor] = err
    return out


def _module(snap: GraphSnapshot, expr: WeightExpr) -> str:
    """The module path, with a trailing dot, that the keys of the constants ``expr`` reads share
    ("" for the root): a constant derived from ``layer1.conv.weight`` and ``layer1.bn.*`` goes
    under ``layer1.``, one derived from ``fc.weight`` alone under ``fc.``.

    >>> from fxpure.testing import GraphBuilder
    >>> g = GraphBuilder()
    >>> w, b = g.parameter("w", (2,), key="block.conv.weight"), g.parameter("b", (2,), key="block.bn.bias")
    >>> snap = g.build()
    >>> s = TensorSpec(shape=(2,), dtype="float32")
    >>> both = Binary(op="add", a=Source(key="w", spec=s), b=Source(key="b", spec=s))
    >>> _module(snap, both), _module(snap, Source(key="w", spec=s))
    ('block.', 'block.conv.')
    """
    common: list[str] | None = None
    constants, names = snap.constants, snap.constant_names
    for k in sources(expr):
        # (a source an earlier stage dropped is no constant: not looked for in the slow persistent map)
        info = constants.get(k) if k in names else None
        if info is not None:
            path = info.key.split(".")[:-1]
            shared = 0
            while common is not None and shared < min(len(common), len(path)) and common[shared] == path[shared]:
                shared += 1
            common = path if common is None else common[:shared]
    return "".join(f"{part}." for part in common or ())


def _reads(p: RewritePlan) -> dict[str, None]:
    """The existing nodes the plan's new nodes read, in order (a local name is the plan's own)."""
    local = {n.name for n in p.nodes} | {c.name for c in p.constants}
    return {r: None for n in p.nodes for r in refs((n.args, tuple(n.kwargs.values()))) if r not in local}


def placement(snap: GraphSnapshot, p: RewritePlan, *, read: Collection[str] | None = None) -> int:
    """The index in ``snap`` of the node ``p``'s new nodes go just before: the earliest node whose
    uses they take, or the node after the last of those that one of them reads (``read``: the
    nodes they read, where the caller knows them)."""
    read = _reads(p) if read is None else read
    after = [old for old, _ in p.replace if old in read]
    if after:
        return max(snap.index[s] for s in after) + 1
    return min(snap.index[s] for s in [old for old, _ in p.replace] or [p.anchor])


def read_spans(snap: GraphSnapshot, p: RewritePlan) -> tuple[tuple[str, int, int], ...]:
    """``(node, start, stop)`` for each node that ``p``'s new nodes read and a node ``p`` consumes
    read too: the nodes of ``snap`` from index ``start`` up to ``stop`` run between the old reads
    and the new one (at :func:`placement`). A node there writing it in place (an aten program
    may hold ``x.mul_(2)``) would change what the rewrite computes.

    >>> from fxpure.testing import GraphBuilder
    >>> g = GraphBuilder()
    >>> x = g.input("x", (2,))
    >>> y = g.call("aten.relu.default", name="y", self=x, out=(2,))
    >>> w = g.node("aten.mul_.Tensor", (x, 2.0), name="w")
    >>> z = g.call("aten.mul.Tensor", name="z", self=y, other=2.0, out=(2,))
    >>> g.output(z)
    >>> fused = NewNode(name="f", target="aten.sigmoid.default", args=(x,))
    >>> p = RewritePlan(rule="r", anchor="z", nodes=(fused,), replace=(("z", "f"),), erase=("z", "y"))
    >>> snap = g.build()
    >>> placement(snap, p), read_spans(snap, p), snap.nodes[2].name
    (3, (('x', 2, 3),), 'w')
    """
    at, consumed = placement(snap, p), {*p.erase, *(old for old, _ in p.replace), *p.prune}
    out = []
    for r in _reads(p):
        old = [snap.index[u] for u in snap.users.get(r, ()) if u in consumed]
        if old:
            out.append((r, min(min(old) + 1, at), max(max(old), at)))
    return tuple(out)


def _root(snap: GraphSnapshot, name: str | None) -> str | None:
    """The original node behind ``name``: meta comes from it even via an earlier rewrite's node."""
    if name is None or name not in snap.index:
        return name
    return snap.node(name).provenance or name


def _resolve(redirect: Mapping[str, str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for old in redirect:
        seen, cur = {old}, redirect[old]
        while cur in redirect and cur not in seen:
            seen.add(cur)
            cur = redirect[cur]
        out[old] = cur
    return out


def _without(names: Mapping[str, str], kept: frozenset[str]) -> dict[str, str]:
    return {k: v for k, v in names.items() if k not in kept}


def _constants_slot(snap: GraphSnapshot) -> int:
    """Where new constants go: after the lifted constant placeholders, else before any compute."""
    if snap.lifted:
        return 1 + max(map(snap.index.__getitem__, snap.constant_names), default=-1)
    return next((i for i, n in enumerate(snap.nodes) if n.op not in ("placeholder", "get_attr")), 0)


def rewrite(snap: GraphSnapshot, plans: Sequence[RewritePlan]) -> Result[GraphSnapshot, PlanConflict]:
    """Apply non-overlapping plans to a snapshot in one pass; pure.

    Derived constants stay expressions. A rewrite that changes anything also
    drops every constant left without users.

    >>> from fxpure.snapshot import snapshot
    >>> rewrite(snapshot([], {}), []).unwrap() == snapshot([], {})
    True
    """
    _check_snapshot(snap)
    if isinstance(plans, (str, bytes)) or not isinstance(plans, Sequence):
        raise TypeError(f"plans must be a list of RewritePlan, got {type(plans).__name__}")
    other = next((p for p in plans if not isinstance(p, RewritePlan)), None)
    if other is not None:
        raise TypeError(f"expected a RewritePlan, got {other!r}")
    if not plans:
        return Success(snap)
    for p in plans:
        wrong = malformed(p)
        if wrong is not None:
            return _conflict(p.anchor, f"malformed plan: {wrong}")
    return _rewrite(snap, plans)


def _rewrite(snap: GraphSnapshot, plans: Sequence[RewritePlan]) -> Result[GraphSnapshot, PlanConflict]:
    """``rewrite`` of plans whose fields are of their types (``malformed`` found nothing)."""
    if not plans:
        return Success(snap)
    claimed: dict[str, RewritePlan] = {}
    for p in plans:
        for c in p.claims:
            if c in claimed:
                first = claimed[c]
                return _conflict(c, f"claimed by plans of {first.rule} at {first.anchor} and of {p.rule} at {p.anchor}")
            claimed[c] = p
    batch = _Batch.of(snap)
    for p in plans:
        err = batch.add(p)
        if err is not None:
            return Failure(err)
    names = _resolve(batch.redirect)
    readers = {u for old in names for u in snap.users[old]}  # the only old nodes renamed (add checked them)
    out: list[NodeSnapshot] = []
    at, before, erase, index = _constants_slot(snap), batch.before, batch.erase, snap.index
    nodes = list(snap.nodes)
    # the nodes between those where something happens are copied as they are, a slice at a time
    stops = sorted({at, *before, *(index[n] for n in erase if n in index), *(index[n] for n in readers)})
    last = 0
    for i in stops:
        if i >= len(nodes):
            break
        out.extend(nodes[last:i])
        last, n = i + 1, nodes[i]
        if i == at:
            out.extend(batch.new_constants)
        if i in before:
            keep = batch.keep
            out.extend([_renamed(m, names if m.name not in keep else _without(names, keep[m.name])) for m in before[i]])
        if n.name not in erase:
            out.append(_renamed(n, names) if n.name in readers else n)
    out.extend(nodes[last:])
    made = {m.name for ms in before.values() for m in ms}
    changed = (made | readers | {c.name for c in batch.new_constants}) - erase  # the records not of ``snap``
    return _finish(snap, out, batch.infos, batch.erase, batch.prune, made, changed)


def planned_on(report: RewriteReport) -> Iterator[tuple[GraphSnapshot, tuple[RewritePlan, ...]]]:
    """Each stage of ``report`` with the snapshot its plans were made on: ``report.before``, then
    each stage's rewrite of the one before (a flat list of plans is one stage)."""
    snap, stages = report.before, report.stages or (report.plans,)
    for i, stage in enumerate(stages):
        yield snap, stage
        if not any(stages[i + 1 :]):  # the rest is empty: each was planned on report.after
            snap = report.after
            continue
        step = rewrite(snap, stage)
        if not isinstance(step, Success):
            return
        snap = step.unwrap()


def _dead(
    nodes: list[NodeSnapshot],
    users: dict[str, tuple[str, ...]],
    index: Mapping[str, int],
    held: set[str],
    prune: set[str],
    made: set[str],
) -> set[str]:
    """Unused constants, and pruned nodes nothing reads; dropping one can free what it read: a
    constant, a pruned node, or a node the stage added (a plan's node that only a dropped one read).

    Walks only from the pruned nodes, and takes the dropped readers out of ``users``.
    """
    dead = {k for k in held if not users[k]}
    todo = [p for p in prune if p in index and not users[p]]
    while todo:
        name = todo.pop()
        dead.add(name)
        for r in dict.fromkeys(ref_list(nodes[index[name]])):
            users[r] = tuple(u for u in users[r] if u != name)
            if not users[r] and (r in held or r in prune or r in made):
                todo.append(r)
    return dead


def _derived(
    snap: GraphSnapshot, nodes: list[NodeSnapshot], changed: set[str], erased: set[str]
) -> tuple[dict[str, tuple[str, ...]], dict[str, int], dict[str, tuple[str, ...]]] | None:
    """``derive(nodes)`` found from ``snap``'s, in proportion to what changed: ``nodes`` are those
    of ``snap`` less ``erased``, the records named ``changed`` new (or remade, their arguments
    renamed). None where ``derive`` would find something wrong (a name twice, a node read before it
    is defined or erased while read): it is left to say what."""
    index = {n.name: i for i, n in enumerate(nodes)}
    if len(index) != len(nodes):
        return None
    users, targets = dict(snap.users), dict(snap.targets)
    old_index, old_nodes = snap.index, snap.nodes
    gone = erased | changed  # records out of the graph (a changed one comes back in below)
    read: set[str] = set()  # the names whose readers change
    calls: set[str] = set()  # the targets whose calls change
    for name in gone:
        at = old_index.get(name)
        if at is not None:
            old = old_nodes[at]
            read.update(ref_list(old))
            if old.op == "call_function":
                calls.add(old.target)
    for name in erased:
        if any(u not in gone for u in users.pop(name)):
            return None
    new_readers: dict[str, list[str]] = {}
    new_calls: dict[str, list[str]] = {}
    for name in changed:
        at = index[name]
        n = nodes[at]
        users.setdefault(name, ())  # (a new node: its readers, if any, are new too)
        for r in dict.fromkeys(ref_list(n)):
            if index.get(r, at) >= at:
                return None
            new_readers.setdefault(r, []).append(name)
        if n.op == "call_function":
            new_calls.setdefault(n.target, []).append(name)
    key = index.__getitem__
    for r in read - erased | new_readers.keys():
        users[r] = tuple(sorted([*(u for u in users[r] if u not in gone), *new_readers.get(r, ())], key=key))
    for t in calls | new_calls.keys():
        kept = sorted([*(u for u in targets.get(t, ()) if u not in gone), *new_calls.get(t, ())], key=key)
        if kept:
            targets[t] = tuple(kept)
        else:
            targets.pop(t, None)
    return users, index, targets


def _finish(
    snap: GraphSnapshot,
    nodes: list[NodeSnapshot],
    added: dict[str, ConstantInfo],
    erased: set[str],
    prune: set[str],
    made: set[str],
    changed: set[str],
) -> Result[GraphSnapshot, PlanConflict]:
    # a few changes are patched into ``snap``'s users and targets; many (a node in eight, about
    # where patching each costs more than a pass over every node) are derived anew
    few = 8 * (len(changed) + len(erased)) <= len(nodes)
    gone = erased & snap.index.keys()
    found = _derived(snap, nodes, changed, gone) if few else None
    users, index, targets, bad = derive(nodes) if found is None else (*found, None)
    still = [name for name in gone if users.get(name)]
    if still:  # the first in the graph
        name = min(still, key=snap.index.__getitem__)
        return _conflict(name, f"erased but still read by {users[name][0]}")
    if bad is not None:
        return _conflict(bad.node, bad.detail)
    held = index.keys() & snap.constant_names  # (a set operation, not a walk of the persistent map)
    held.update(k for k in added if k in index)
    dead = _dead(nodes, users, index, held, prune, made)
    live = pvector([n for n in nodes if n.name not in dead] if dead else nodes)
    if dead:
        # dead nodes are constants (no call) and pruned calls: only their targets change
        calls = {nodes[index[d]].target for d in dead if nodes[index[d]].op == "call_function"}
        for t in calls:
            targets[t] = tuple(n for n in targets[t] if n not in dead)
        for d in dead:
            del users[d]
        index = {n.name: i for i, n in enumerate(live)}
    # a later stage names nothing as a node or constant this one removed: the adapter commits the
    # program's first snapshot against the last, matching by name
    kept = held - dead
    old = snap.constants
    dropped = {k: old[k] for k in snap.constant_names - kept}  # (each looked up once: the persistent map is slow)
    new = {k: v for k, v in added.items() if k in kept}
    gone = {info.key for info in dropped.values()}
    constants, derived, shared = old, snap.derived, snap.shared_derived
    if dropped or new:  # (the persistent map changed where it changes, not walked)
        edit, derived, lost = old.evolver(), dict(derived), set()
        for k, info in dropped.items():
            edit.remove(k)
            source = info.source
            if source is not None and derived.get(source) == k:
                del derived[source]
                lost.add(source)
        for k, v in new.items():
            edit.set(k, v)
            if v.source is not None:
                derived[v.source] = k
        constants = edit.persistent()
        if lost & shared:  # another constant may hold the expression (a walk, for a hand-made snapshot)
            for k, v in constants.items():
                if v.source in lost and v.source in shared:
                    derived[v.source] = min(derived.get(v.source, k), k)
        derived = FrozenDict(derived)
    keys = snap.constant_keys | {v.key for v in new.values()} if new else snap.constant_keys
    return Success(
        GraphSnapshot(
            nodes=live,
            constants=constants,
            dialect=snap.dialect,
            lifted=snap.lifted,
            decomposed=snap.decomposed,
            users=FrozenDict(users),
            index=FrozenDict(index),
            targets=FrozenDict({t: ns for t, ns in targets.items() if ns}),
            reserved=snap.reserved | erased | dead | gone,
            least_sizes=snap.least_sizes,
            written=snap.written,
            opaque=snap.opaque,
            known=KnownConstants(frozenset(kept), keys, derived, shared),
        )
    )


def plan(
    snap: GraphSnapshot, rules: Iterable[Rule], *, declined: Mapping[tuple[str, str], Reason] | None = None
) -> RewriteReport:
    """Run rules in order; each stage plans on the previous stage's rewritten snapshot.

    Every candidate ends as a plan or a rejection; overlapping plans: the first
    in topological order wins; a candidate a later stage of the same rule rewrites, or that is
    declined as its plan overlaps another's and a plan of its stage consumes, is not also listed
    as declined. ``declined`` maps ``(rule, anchor)`` to a reason
    found outside the core (an adapter that computed a weight, say): those
    candidates are rejected with it. Runs with the cyclic garbage collector paused
    (:func:`no_cyclic_gc`).

    A conv and an eval batch norm, fused: the plan replaces both nodes by one conv reading two
    new (derived, not yet computed) constants; ``report.before`` is the snapshot planned on.

    >>> from fxpure.rules import fuse_conv_bn
    >>> from fxpure.testing import GraphBuilder
    >>> g = GraphBuilder()
    >>> x, w, b = g.input("x", (1, 4, 8, 8)), g.parameter("w", (8, 4, 3, 3)), g.parameter("b", (8,))
    >>> conv = g.call("aten.conv2d.default", input=x, weight=w, bias=b, out=(1, 8, 6, 6))
    >>> bn = g.call("aten.batch_norm.default", input=conv, weight=None, bias=None,
    ...             running_mean=g.parameter("mean", (8,)), running_var=g.parameter("var", (8,)),
    ...             training=False, momentum=0.1, eps=1e-5, cudnn_enabled=False, out=(1, 8, 6, 6))
    >>> g.output(bn)
    >>> report = plan(g.build(), [fuse_conv_bn()])
    >>> [(p.rule, p.anchor, p.erase, [c.name for c in p.constants]) for p in report.plans], report.rejections
    ([('fuse-conv-bn', 'batch_norm', ('batch_norm', 'conv2d'), ['conv2d_bn_weight', 'conv2d_bn_bias'])], ())
    >>> report.after.node(report.after.outputs[0]).args
    (NodeRef(name='x'), NodeRef(name='conv2d_bn_weight'), NodeRef(name='conv2d_bn_bias'))
    >>> [n.name for n in report.before.nodes if n.op == "call_function"]
    ['conv2d', 'batch_norm']
    """
    _check_snapshot(snap)
    with no_cyclic_gc(keep=True):
        return _stages(snap, check_rules(rules), declined)


@contextmanager
def no_cyclic_gc(*, keep: bool = False) -> Iterator[None]:
    """Pause Python's cyclic garbage collector for the block, and restore it as it was (also on an
    error). Planning allocates many small records that form no cycles, and each full collection
    scans every live object: on a 50,000-node program the scans would add about 1 s to the 1.6 s of
    capture and planning. ``plan``, the adapter's capture and its transforms run under it. The
    collector is the process's: other threads go without cyclic collection meanwhile, and
    overlapping blocks in several threads are not coordinated (the first to leave turns it back on;
    it is never left off).

    ``keep``, for a block that makes no cyclic garbage (``plan``, capture; a transform makes some):
    when it ends, the young objects (what the block made and still holds, and the few the process
    made since its last collection) move to the collector's oldest generation unscanned, where the
    next full collection finds them, in place of the young collection that would otherwise scan
    them all at once (on a 50,000-node program about 0.1 s each for capture and planning). Not done
    while the process holds objects in ``gc.freeze()``'s permanent generation (they would move too)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if keep and not gc.get_freeze_count():
                gc.freeze()  # every tracked object, the block's young ones among them, out of reach
                gc.unfreeze()  # and back, into the oldest generation
            gc.enable()


MAX_RUNS = 8
"""How many times :func:`plan` runs a rule with ``repeat`` at most (each run is one stage)."""
RUNS_EXHAUSTED = "runs-exhausted"
"""The code of a candidate a rule with ``repeat`` would still rewrite after :data:`MAX_RUNS` runs."""


def runs(rule: Rule) -> int:
    """How many times :func:`plan` may run ``rule`` in a row: :data:`MAX_RUNS` for a rule with
    ``repeat`` (it runs again while it plans: a fold whose result another of its candidates reads,
    such as the ``add`` of ``conv(x) * s + t``), else 1."""
    return MAX_RUNS if getattr(rule, "repeat", False) is True else 1


def _decide(
    rule: Rule, snap: GraphSnapshot, node: NodeSnapshot, declined: Mapping[tuple[str, str], Reason] | None
) -> Result[RewritePlan, Reason]:
    """``rule``'s plan at ``node``, or the reason found outside the core for it (``declined``)."""
    known = declined.get((rule.name, node.name)) if declined else None
    if known is not None:
        return Failure(known)
    try:
        result = rule.plan_at(snap, node)
    except Exception as e:  # a bug in the rule: raised as it is, saying where
        e.add_note(f"raised by rule {rule.name!r} planning at node {node.name!r}")
        raise
    if isinstance(result, Success) and isinstance(result.unwrap(), RewritePlan):
        return result
    if isinstance(result, Failure) and isinstance(result.failure(), Reason):
        return result
    raise TypeError(
        f"rule {rule.name!r} planning at node {node.name!r} returned {result!r}, "
        "not Success(RewritePlan) or Failure(Reason)"
    )


def _anchors(rule: Rule, snap: GraphSnapshot) -> Iterator[NodeSnapshot]:
    """``rule``'s anchors in ``snap``; TypeError, naming the rule, for one that is no node of ``snap``
    (an exception the rule raises finding them is raised as it is, saying whose)."""
    try:
        found = rule.anchors(snap)
        found = list(found) if isinstance(found, Iterable) else found
    except Exception as e:  # a bug in the rule
        e.add_note(f"raised by rule {rule.name!r} finding its anchors")
        raise
    if not isinstance(found, list):
        raise TypeError(f"rule {rule.name!r} gave the anchors {found!r}, not an iterable of NodeSnapshots")
    for node in found:
        at = snap.index.get(node.name) if isinstance(node, NodeSnapshot) else None
        if at is None or (snap.nodes[at] is not node and snap.nodes[at] != node):
            raise TypeError(f"rule {rule.name!r} gave the anchor {node!r}, not a NodeSnapshot of the snapshot")
        yield node


def _left(
    rule: Rule,
    current: GraphSnapshot,
    first: GraphSnapshot,
    planned: set[str],
    reported: set[str],
    declined: Mapping[tuple[str, str], Reason] | None,
) -> list[Rejection]:
    """The candidates of the program (not of the rule's new nodes, nor those it planned) that
    ``rule`` would plan in one more run, after its last, with ``runs-exhausted`` (in place of the
    reason an earlier run declined one with: a batch norm after a fused one was no conv's then), and
    those it would decline that no run reported, with their reason."""
    out = []
    for node in _anchors(rule, current):
        if node.name not in first.index or node.name in planned:
            continue
        result = _decide(rule, current, node, declined)
        if isinstance(result, Failure) and node.name in reported:
            continue
        detail = (
            f"{rule.name} ran {MAX_RUNS} times in a row and would rewrite {node.name} in another run: "
            "plan on the result to go on"
        )
        reason = (
            result.failure()
            if isinstance(result, Failure)
            else Declined(code=RUNS_EXHAUSTED, node=node.name, detail=detail)
        )
        out.append(Rejection(rule=rule.name, node=node.name, reason=reason))
    return out


def _unfit(rule: Rule, node: NodeSnapshot, p: RewritePlan) -> PlanConflict | None:
    """Why the stage takes no plan ``p`` made at ``node``: its fields are not of their types, or it
    names another rule or anchor (checks outside the core find a plan by them)."""
    wrong = malformed(p)
    if wrong is not None:
        return PlanConflict(node=node.name, detail=f"malformed plan: {wrong}", path="plan")
    if (p.rule, p.anchor) != (rule.name, node.name):
        detail = f"the plan made at {node.name} names rule {p.rule!r} and anchor {p.anchor!r}"
        return PlanConflict(node=node.name, detail=detail, path="plan")
    return None


def _overlap(node: NodeSnapshot, claims: frozenset[str], claimed: Mapping[str, str]) -> PlanConflict | None:
    """A node of ``claims`` (a plan's made at ``node``) that an earlier plan of the stage took, or None."""
    overlap = sorted(c for c in claims if c in claimed)
    if overlap:
        detail = f"{overlap[0]} is taken by the plan at {claimed[overlap[0]]}"
        return PlanConflict(node=node.name, detail=detail, path="plan")
    return None


def _decline(rejections: list[Rejection], reported: set[str], first: GraphSnapshot, r: Rejection) -> None:
    """Report ``r`` once: a later run of a rule declines no candidate an earlier run decided (planned,
    or declined at any step), nor one of the rule's new nodes (not in ``first``, its first run's
    snapshot)."""
    if r.node in first.index and r.node not in reported:
        rejections.append(r)
        reported.add(r.node)


def _stages(
    snap: GraphSnapshot, rules: Sequence[Rule], declined: Mapping[tuple[str, str], Reason] | None
) -> RewriteReport:
    current, stages = snap, []
    rejections: list[Rejection] = []
    for rule in rules:
        first = current  # the nodes a rule's later runs report: those of its first run's snapshot
        reported: set[str] = set()  # planned or declined by an earlier run
        planned: set[str] = set()  # planned by an earlier run: a rule rewrites a candidate once
        for _ in range(runs(rule)):
            accepted: list[RewritePlan] = []
            claimed: dict[str, str] = {}
            taken: set[str] = set()  # declined in this run only as a node their plan consumes was taken
            for node in _anchors(rule, current):
                if node.name in planned:  # (an insertion that keeps its anchor would repeat every run)
                    continue
                result = _decide(rule, current, node, declined)
                if isinstance(result, Failure):
                    why: Reason | None = result.failure()
                else:
                    why = _unfit(rule, node, result.unwrap())
                    claims = result.unwrap().claims if why is None else frozenset()  # (made anew at each call: once)
                    if why is None:
                        why = _overlap(node, claims, claimed)
                        if why is not None and node.name not in reported:
                            taken.add(node.name)
                if why is not None:
                    _decline(rejections, reported, first, Rejection(rule=rule.name, node=node.name, reason=why))
                    continue
                p = result.unwrap()
                claimed.update(dict.fromkeys(claims, p.anchor))
                accepted.append(p)
            # (a plan reads through what another replaces only where it prunes a node the other claims)
            while any(claimed.get(c, p.anchor) != p.anchor for p in accepted for c in p.prune):
                void = _void(current, accepted)
                if not void:
                    break
                for p in accepted:  # declined, the rest rewritten (and looked at again without them)
                    if p.anchor in void:
                        why = void[p.anchor]
                        _decline(rejections, reported, first, Rejection(rule=rule.name, node=p.anchor, reason=why))
                accepted = [p for p in accepted if p.anchor not in void]
                claimed = {c: p.anchor for p in accepted for c in p.claims}
            step = _rewrite(current, accepted)
            misfits = _misfits(current, accepted) if isinstance(step, Failure) else {}
            if misfits:  # declined each at its candidate, the rest rewritten
                for p in accepted:
                    if p.anchor in misfits:
                        reason = replace(misfits[p.anchor], path="plan")
                        _decline(rejections, reported, first, Rejection(rule=rule.name, node=p.anchor, reason=reason))
                accepted = [p for p in accepted if p.anchor not in misfits]
                step = _rewrite(current, accepted)
            if isinstance(step, Failure):
                why = step.failure()
                why = why if why.path else replace(why, path="plan")
                for p in accepted:
                    _decline(rejections, reported, first, Rejection(rule=rule.name, node=p.anchor, reason=why))
                accepted = []
            else:
                current = step.unwrap()
            stages.append(tuple(accepted))
            reported.update(p.anchor for p in accepted)
            planned.update(p.anchor for p in accepted)
            # a candidate this stage rewrote is no longer declined by an earlier stage of the same rule,
            # nor one declined for an overlap that a plan of the stage consumed (the middle conv of a
            # chain merged pairwise: its node is the next pair's). A candidate declined for a reason
            # of its own stays reported, whatever erased it (a linear of one group that another's join took)
            done = {(rule.name, p.anchor) for p in accepted}
            if taken:
                done.update((rule.name, n) for p in accepted for n in p.claims if n in taken)
            rejections = [r for r in rejections if (r.rule, r.node) not in done]
            if not accepted:
                break
        else:
            if runs(rule) > 1:  # it still planned in its last run: what it would plan next is reported
                left = _left(rule, current, first, planned, reported, declined)
                again = {(r.rule, r.node) for r in left}
                rejections = [r for r in rejections if (r.rule, r.node) not in again] + left
    return RewriteReport(
        plans=tuple(p for s in stages for p in s),
        rejections=tuple(rejections),
        before=snap,
        after=current,
        stages=tuple(stages),
    )

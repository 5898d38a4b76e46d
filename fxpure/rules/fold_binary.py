"""fold_binary: conv | linear, then (* / + -) a constant per output channel  =>  the same op with W, b folded.

The binary op is ``y' = a * y + k`` per output channel of ``y`` (the conv's or linear's output);
then ``W' = a * W`` (along the output channels, in the weight's own layout) and ``b' = a * b + k``.
A bias appears when the op adds and there was none (``mm`` becomes ``addmm``). ``c / y`` is not
affine in ``y`` and is declined. Everything is computed in float32 (float64 for a float64
weight) and cast back, as ``fold_batch_norm`` does.

The candidates are the mul, div (``true_divide`` and ``div(..., rounding_mode=None)`` too; a
rounding one is declined ``arg-mismatch``), add, sub and rsub ops with an operand computed by a conv or a
linear whose other operand is not another activation of the op's shape: neither a residual
``x + y`` of two other ops nor ``x + conv(x)`` is one. An op of an edge program that reads the
output through a dtype copy (``to_edge`` writes a promotion so) is a candidate too, declined
``dtype-promotion`` as the aten form is; so is one reading the output quantized and dequantized
(a PT2E program's activation), declined ``quantized-output``, and one reading a linear that
``linear_to_conv2d`` made a 1x1 conv (squeezed and permuted back), declined as no conv's or
linear's output. The in-place ``y.mul_(c)``, ``div_``, ``add_`` and
``sub_`` of an aten program are candidates too (the conv's output, which they write, has no other
reader: ``conv-output-shared`` otherwise). A chain ``conv * s + t`` (a frozen batch
norm) folds whole: the rule runs again while it folds (``repeat``), and the second run folds the
``add`` into the first one's (still unmaterialised) weights.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Literal, TypeAlias

from fxpure.families import (
    ADD,
    ADD_,
    ADDMM,
    BMM,
    CAST,
    CLONE,
    CONV,
    DEQUANTIZE,
    DIV,
    DIV_,
    DROPOUT,
    LINEAR,
    MM,
    MUL,
    MUL_,
    PERMUTE,
    QUANTIZE_PER_TENSOR,
    RSUB,
    SQUEEZE,
    SUB,
    SUB_,
    UNSQUEEZE,
    VIEW,
)
from fxpure.linear import emit_linear, is_bias_add, is_linear, is_weight_product, linear, linear_of
from fxpure.pattern import (
    ANY,
    Bound,
    Const,
    Lit,
    Match,
    OneOf,
    Op,
    Pattern,
    PatternRule,
    Planner,
    Scalar,
    Var,
    idle,
    need,
    rule,
)
from fxpure.plan import RewritePlan
from fxpure.reasons import Declined, Malformed, Reason
from fxpure.snapshot import Arg, Dim, GraphSnapshot, NodeRef, NodeSnapshot, TensorSpec
from fxpure.weights import (
    FLOAT_DTYPES,
    Binary,
    Cast,
    Fill,
    Reshape,
    Unary,
    WeightExpr,
    infer_spec,
    out_channels,
    work_dtype,
)

NAME = "fold-binary"
NOT_PRODUCER = "producer-not-conv-or-linear"
DIVISOR = "output-is-divisor"
PER_CHANNEL = "not-per-channel"
PROMOTION = "dtype-promotion"
QUANTIZED_OUTPUT = "quantized-output"

# the convolutions, named for messages about a producer that is neither
CONV_OR_LINEAR = replace(CONV, noun="a convolution or a linear")
CONV_SHARED, LINEAR_SHARED = "conv-output-shared", "linear-output-shared"
DIRECT = OneOf(
    Op(
        CONV_OR_LINEAR,
        name="conv",
        code=NOT_PRODUCER,
        shared=CONV_SHARED,
        weight=Const("w"),
        bias=Const("b", optional=True),
    ),
    linear("lin", code=NOT_PRODUCER, shared=LINEAR_SHARED, bias_add=True),  # (candidates read a product)
)
# the output read through a dropout in eval mode, which returns it (BEiT's, DINOv2's layer scale:
# ``gamma * dropout(dense(x))``): the dropout goes with the op; or through a copy (edge spells that
# dropout as ``_clone_dim_order``): the copy stays, of the folded op's output, in its layout
PRODUCER = OneOf(*DIRECT.alternatives, *idle(DIRECT))


def _quantized(value: Pattern, at: str) -> Op:
    """``value`` quantized and dequantized (a PT2E program's activation), read by others too."""
    q = Op(QUANTIZE_PER_TENSOR, name=f"q_{at}", users=ANY, input=value)
    return Op(DEQUANTIZE, name=f"dq_{at}", users=ANY, input=q)


# in a PT2E program, the output quantized and dequantized (its weight dequantized too, its output
# read by others too; the constant dequantized too), or that read through a dropout or copy,
# quantized and dequantized again: to be declined (quantized-output)
QUANTIZED_PRODUCER = OneOf(
    Op(CONV_OR_LINEAR, name="conv", code=NOT_PRODUCER, users=ANY),
    linear("lin", weight=Var("qw"), users=ANY, code=NOT_PRODUCER, bias_add=True),
)
QUANTIZED = _quantized(OneOf(*QUANTIZED_PRODUCER.alternatives, *idle(_quantized(QUANTIZED_PRODUCER, "in"))), "out")
# a constant copied to the op's dtype: to_edge lifts a Python int (any number, in a float16 model)
# as an int64 or float32 tensor and copies it to the op's dtype
OPERAND = OneOf(Const("c"), Scalar("c"), Op(CAST, name="copy", self=Const("c")))
PROMOTED = Op(CAST, name="promoted", self=PRODUCER)
ALPHA = Scalar("alpha")
TRUE = Lit(None)  # a division's rounding mode: none (floor or trunc division is no scale)

# y = conv(x, w, b?) | linear(x, w, b?); c a constant (tensor or number); torch spells ``c - y``
# for a number c as rsub(y, c) (aten; edge turns it into sub)
PATTERN = OneOf(
    Op(MUL, name="bin", commute=True, self=PRODUCER, other=OPERAND),  # y * c, c * y
    Op(DIV, name="bin", self=PRODUCER, other=OPERAND, rounding_mode=TRUE),  # y / c
    # (not commute=True: with alpha the operands do not commute, and the fold tells them apart)
    Op(ADD, name="bin", self=PRODUCER, other=OPERAND, alpha=ALPHA),  # y + alpha c
    Op(ADD, name="bin", other=PRODUCER, self=OPERAND, alpha=ALPHA),  # c + alpha y (y matched first)
    Op(SUB, name="bin", self=PRODUCER, other=OPERAND, alpha=ALPHA),  # y - alpha c
    Op(SUB, name="bin", other=PRODUCER, self=OPERAND, alpha=ALPHA),  # c - alpha y (y matched first)
    Op(RSUB, name="bin", self=PRODUCER, other=OPERAND, alpha=ALPHA),  # c - alpha y
    Op(RSUB, name="bin", other=PRODUCER, self=OPERAND, alpha=ALPHA),  # torch.rsub(c, y): y - alpha c
    Op(DIV, name="bin", other=PRODUCER, self=OPERAND, rounding_mode=TRUE),  # c / y: to be declined (output-is-divisor)
    # y.mul_(c), y.div_(c), y.add_(c, alpha=), y.sub_(c, alpha=): an aten program may scale or shift
    # the output in place (timm's LayerScale(inplace=True)); the output is the one written
    Op(MUL_, name="bin", self=PRODUCER, other=OPERAND),
    Op(DIV_, name="bin", self=PRODUCER, other=OPERAND, rounding_mode=TRUE),
    Op(ADD_, name="bin", self=PRODUCER, other=OPERAND, alpha=ALPHA),
    Op(SUB_, name="bin", self=PRODUCER, other=OPERAND, alpha=ALPHA),
    # on edge, an op that promotes the output (a float16 conv times a float32 constant) reads it
    # through to_edge's dtype copy: to be declined (dtype-promotion), as the aten form is
    Op(MUL | DIV | ADD | SUB, name="bin", self=PROMOTED, other=OPERAND),
    Op(MUL | DIV | ADD | SUB, name="bin", other=PROMOTED, self=OPERAND),
    # a PT2E program's quantized output, whatever the other operand: to be declined (quantized-output)
    Op(MUL | DIV | ADD | SUB | RSUB, name="bin", self=QUANTIZED),
    Op(MUL | DIV | ADD | SUB | RSUB, name="bin", other=QUANTIZED),
)
MATMULS = ADDMM.targets | MM.targets
PRODUCTS = CONV.targets | LINEAR.targets | MATMULS
SQUEEZED = CONV.targets | MM.targets  # (what edge squeezes back after unsqueezing an unbatched input)
MOVES = PERMUTE.targets | SQUEEZE.targets  # (what linear-to-conv2d moves its conv's output back with)


def _computed_by_product(snap: GraphSnapshot, value: Arg) -> bool:
    """``value`` is a conv's or linear's output: its product's (``x @ W.T`` too, and ``x @ W`` of a
    weight stored (in, out), which the rule declines), or a reshape's (or a chain of them:
    ``to_edge`` writes a pair after each in-place op) after a matmul, or edge's squeeze after a
    conv or ``mm`` of an unsqueezed input (:func:`_unbatched`, declined), or a conv of a permuted or
    unsqueezed input squeezed and permuted back (``linear_to_conv2d``'s linear, declined), or the add
    of a ``bmm``'s bias;
    or a dtype copy of one (on edge, ``to_edge`` writes the promotion of ``conv_fp16 * c_fp32`` so:
    a candidate, declined as the aten form's is reported); or an eval dropout of one, or a copy (the
    ops :func:`fxpure.pattern.idle` takes); or one quantized and dequantized (a PT2E program's
    quantized activation: declined, as what reads it scales the values its quantization was fixed for)."""
    node = _node(snap, value)
    if node is not None and node.target in CAST.targets and node.args and _promotes(snap, node):
        return _computed_by_product(snap, node.args[0])
    idle = node is not None and (
        node.target in CLONE.targets or (node.target in DROPOUT.targets and node.arg(2, "train") is False)
    )
    if node is not None and idle and node.args:  # (a copy, or a dropout in eval mode: of its input)
        return _computed_by_product(snap, node.args[0])
    unquantized = _unquantized(snap, node)
    if unquantized is not node:  # (PT2E's quantized output: declined)
        return unquantized is not None and _computed_by_product(snap, NodeRef(unquantized.name))
    if node is not None and node.target in SQUEEZE.targets and _unbatched(snap, node):
        return True
    if node is not None and node.target in MOVES:  # (linear-to-conv2d's spelling of a linear: declined)
        while node is not None and node.target in MOVES:  # (quantized after each view in a PT2E program)
            node = _unquantized(snap, _node(snap, node.arg(0, "self")))
        conv = node if node is not None and node.target in CONV.targets else None
        x = _unquantized(snap, _node(snap, conv.arg(0, "input"))) if conv is not None else None
        return x is not None and x.target in MOVES | UNSQUEEZE.targets
    if node is None or node.target not in VIEW.targets:
        return node is not None and (
            node.target in PRODUCTS or is_linear(snap, node, in_out=True) or is_bias_add(snap, node)
        )
    while node.target in VIEW.targets:
        inner = node.args[0] if node.args else None
        if not isinstance(inner, NodeRef) or inner.name not in snap.index:
            return False
        node = snap.node(inner.name)
    return node.target in MATMULS or (node.target in BMM.targets and is_linear(snap, node)) or is_bias_add(snap, node)


def _unquantized(snap: GraphSnapshot, node: NodeSnapshot | None) -> NodeSnapshot | None:
    """``node``, or what it dequantizes where it dequantizes a quantize (a PT2E program's activation)."""
    while node is not None and node.target in DEQUANTIZE.targets:
        q = _node(snap, node.arg(0, "input"))
        if q is None or q.target not in QUANTIZE_PER_TENSOR.targets:
            break
        node = _node(snap, q.arg(0, "input"))
    return node


def _unbatched(snap: GraphSnapshot, squeeze: NodeSnapshot) -> bool:
    """``squeeze`` undoes the unsqueeze before the conv or ``mm`` it reads: how edge spells a conv of an
    unbatched input (``unsqueeze_copy``, ``convolution``, ``squeeze_copy``), and a linear of a rank-1
    input without bias (``mm`` for the conv). The rule declines what reads it."""
    product = _node(snap, squeeze.args[0]) if squeeze.args else None
    if product is None or product.target not in SQUEEZED or not product.args:
        return False
    x = _node(snap, product.args[0])
    return x is not None and x.target in UNSQUEEZE.targets


def _node(snap: GraphSnapshot, arg: Arg) -> NodeSnapshot | None:
    return snap.node(arg.name) if isinstance(arg, NodeRef) and arg.name in snap.index else None


def _promotes(snap: GraphSnapshot, copy: NodeSnapshot) -> bool:
    """``copy`` changes its input's dtype (not only its layout)."""
    x = copy.args[0]
    spec = snap.node(x.name).tensor_spec if isinstance(x, NodeRef) else None
    out = copy.tensor_spec
    return spec is not None and out is not None and spec.dtype != out.dtype


def _activation(snap: GraphSnapshot, value: Arg, shape: tuple[Dim, ...]) -> bool:
    """``value`` is computed at run time with the op's whole ``shape``, of two or more dims that are
    not 1 (a symbolic one counts): another activation, such as the block input of a residual add,
    which could not be one value per channel even if it were constant. (A batch-1 ``(1, C)`` or
    ``(1, C, 1, 1)`` operand could: it stays a candidate, declined ``not-constant``.)"""
    if not isinstance(value, NodeRef) or value.name not in snap.index or value.name in snap.constant_names:
        return False
    spec = snap.node(value.name).tensor_spec
    return spec is not None and spec.shape == shape and sum(d != 1 for d in shape) > 1


def _candidate(bin: Bound, snap: GraphSnapshot) -> bool:
    """A binary op with an operand computed by a conv or a linear, and whose other operand is no
    other activation of its shape (a residual ``x + y`` is not a scale or shift of ``y``); not the
    add of a ``bmm``'s bias, which is part of the linear (``fxpure.linear.is_bias_add``); nor one of
    a product that computes a weight (a merged LoRA's ``W + B @ A``: ``fxpure.linear.is_weight_product``)."""
    a, b, out = bin.args.get("self"), bin.args.get("other"), bin.spec
    whole = out.shape if out is not None else None
    pairs = ((a, b), (b, a))
    taken = any(_computed_by_product(snap, y) and not (whole and _activation(snap, c, whole)) for y, c in pairs)
    # (the bias add asked after: most binary ops, a residual add, read no product's output alone)
    return taken and not is_bias_add(snap, bin.node) and not any(_weight_product(snap, v) for v in (a, b))


def _weight_product(snap: GraphSnapshot, value: Arg) -> bool:
    """``value`` is a weight's computation by a product of constants, or a reshape of one."""
    node = _node(snap, value)
    while node is not None and node.target in VIEW.targets and node.args:
        node = _node(snap, node.args[0])
    return node is not None and is_weight_product(snap, node)


Scale: TypeAlias = tuple[Literal["mul", "div"], WeightExpr] | None
Affine: TypeAlias = tuple[Scale, WeightExpr | None]  # (a, k): y' = a * y + k; None: a = 1, k = 0


def _fill(value: float, work: str) -> WeightExpr:
    return Fill(shape=(1,), value=value, dtype=work)


def _times(x: WeightExpr, k: float, work: str) -> WeightExpr:
    return x if k == 1 else Unary(op="neg", x=x) if k == -1 else Binary(op="mul", a=x, b=_fill(k, work))


def _by(k: float, work: str) -> Scale:
    return None if k == 1 else ("mul", _fill(k, work))


# (op, y is its first operand) -> (c as a vector in the work dtype, alpha, work dtype) -> (a, k)
AFFINE: Mapping[tuple[str, bool], Callable[[WeightExpr, float, str], Affine]] = {
    ("mul", True): lambda c, _, __: (("mul", c), None),
    ("mul", False): lambda c, _, __: (("mul", c), None),
    ("div", True): lambda c, _, __: (("div", c), None),
    ("add", True): lambda c, alpha, work: (None, _times(c, alpha, work)),
    ("add", False): lambda c, alpha, work: (_by(alpha, work), c),
    ("sub", True): lambda c, alpha, work: (None, _times(c, -alpha, work)),
    ("sub", False): lambda c, alpha, work: (_by(-alpha, work), c),
    ("rsub", True): lambda c, alpha, work: (_by(-alpha, work), c),
    ("rsub", False): lambda c, alpha, work: (None, _times(c, -alpha, work)),
}


def _name(match: Match) -> str:
    """The binding name of the producer's outer node (a bmm's bias add, where it has one)."""
    if "conv" in match.bindings:
        return "conv"
    return next(n for n in ("lin_bias", "lin_out", "lin") if n in match.bindings)


def _producer(match: Match) -> Bound:
    """The node that carries the conv's or linear's output."""
    y = match.bindings[_name(match)]
    assert isinstance(y, Bound)  # the pattern binds ops under these names
    return y


_BINARIES = (MUL, DIV, ADD, SUB, RSUB, MUL_, DIV_, ADD_, SUB_)


def _key(bin: Bound, match: Match) -> tuple[str, bool]:
    # by the node's own family (a joined one matched it): mul_ scales as mul does, true_divide as div
    op = next(f.name for f in _BINARIES if bin.node.target in f.schemas).removesuffix("_")
    # what the op reads: y, its copy, or a dropout's of it
    read = match.bindings.get("promoted") or match.bindings.get("idle") or _producer(match)
    assert isinstance(read, Bound)
    return op, bin.args.get("self") == NodeRef(read.name)


def _dequantized(bin: Bound, match: Match, dq_out: Bound | None = None) -> Reason | None:
    """The op does not read a quantized activation (PT2E's quantize and dequantize of the output):
    scaled or shifted in the op, the values its quantization was calibrated for would change."""
    if dq_out is None:
        return None
    detail = (
        f"{bin.name}: reads the output of {_producer(match).name} quantized and dequantized ({dq_out.name}): "
        "folded into it, the scale or shift would change the values its quantization was calibrated for"
    )
    return Declined(code=QUANTIZED_OUTPUT, node=bin.name, detail=detail)


def _affine(bin: Bound, match: Match) -> Reason | None:
    """The op is affine in the producer's output (``c / y`` is not)."""
    if _key(bin, match) in AFFINE:
        return None
    y = _producer(match)
    detail = f"{bin.name} divides by the output of {y.name}: not a scale and shift of it"
    return Declined(code=DIVISOR, node=bin.name, detail=detail, path=match.sites[_name(match)].path)


def _same_dtype(bin: Bound, match: Match, promoted: Bound | None = None) -> Reason | None:
    """The op keeps the producer's dtype (folding cannot promote, e.g. float16 times a float32 tensor),
    and reads it as it is (not through the copy to_edge writes for a promotion)."""
    y = _producer(match)
    if bin.spec is None or y.spec is None:
        return Malformed(node=bin.name, detail="the op or its operand has no known dtype")
    if bin.spec.dtype == y.spec.dtype and promoted is None:
        return None
    through = f" (through {promoted.name})" if promoted is not None else ""
    turns = f"{bin.name} turns the {y.spec.dtype} output of {y.name}{through} into {bin.spec.dtype}"
    return Declined(code=PROMOTION, node=bin.name, detail=f"{turns} (a folded op keeps it)")


def _channels(w: TensorSpec, conv: Bound | None) -> int:
    n = w.shape[0] if conv is None else out_channels(w, transposed=conv.bool("transposed"), groups=conv.int("groups"))
    return n if isinstance(n, int) else -1


def _per_channel(
    bin: Bound, match: Match, c: WeightExpr | float | None = None, conv: Bound | None = None
) -> Reason | None:
    """A tensor constant broadcasts along the output channels only (size 1 or C there, 1 elsewhere)."""
    y, c_spec, w = _producer(match).spec, match.spec("c"), match.spec("w")
    if not isinstance(c, WeightExpr) or c_spec is None:
        return None
    if y is None or w is None:
        return Malformed(node=bin.name, detail="the producer's output or weight has no known shape")
    rank, n = len(y.shape), _channels(w, conv)
    axis = 1 if conv is not None else rank - 1
    aligned = (1,) * (rank - len(c_spec.shape)) + c_spec.shape
    if len(c_spec.shape) <= rank and all(d == 1 or (i == axis and d == n) for i, d in enumerate(aligned)):
        return None
    site = match.sites["c"]
    detail = (
        f"{site.role} of {bin.name} has shape {c_spec.shape}: it must broadcast along the {n} output channels "
        f"(dim {axis} of {y.shape}) only"
    )
    return Declined(code=PER_CHANNEL, node=bin.name, detail=detail, path=site.path)


def _vector(c: WeightExpr | float, work: str, dtype: str, *, scales: bool) -> WeightExpr:
    """The constant as a vector of 1 or C entries in the work dtype, first rounded to the op's
    ``dtype`` as torch rounds it on CPU: a mul's or div's second operand of one element (a number,
    a 0-d or one-element tensor: ``scales``) is read at full precision (a float16 ``y * 1e-7`` scales
    by 1e-7, ``y * tensor([100000])`` is finite), any other operand is rounded first (an add's or a
    sub's: ``y_fp16 - 1e5`` is -inf; a mul's first one: ``tensor(1e-7) * y`` scales by float16's
    1.19e-7; a vector)."""
    if not isinstance(c, WeightExpr):
        return _fill(float(c), work) if scales or dtype == work else Cast(x=_fill(float(c), dtype), dtype=work)
    spec = infer_spec(c).unwrap()
    as_op = c if spec.dtype == dtype or (scales and spec.numel == 1) else Cast(x=c, dtype=dtype)
    return Reshape(x=Cast(x=as_op, dtype=work), shape=(spec.numel,))


def _scaled(w: WeightExpr, scale: tuple[Literal["mul", "div"], WeightExpr], conv: Bound | None) -> WeightExpr:
    """``w`` (in the work dtype of ``scale``) times (or over) a per-output-channel vector, in the
    weight's layout."""
    op, vec = scale
    dims = tuple(d for d in infer_spec(w).unwrap().shape if isinstance(d, int))
    spec = infer_spec(vec).unwrap()
    n = spec.numel
    w32: WeightExpr = Cast(x=w, dtype=spec.dtype)
    ones = (1,) * (len(dims) - 2)
    if n == 1:
        return Binary(op=op, a=w32, b=vec)
    if conv is None or not conv.bool("transposed"):  # (OC, ...): output channels lead
        return Binary(op=op, a=w32, b=Reshape(x=vec, shape=(n, *(1,) * (len(dims) - 1))))
    g = conv.int("groups")  # (IC, OC/g, ...): output channel g*(OC/g)+j sits at [g*(IC/g)+i, j]
    grouped = Reshape(x=w32, shape=(g, dims[0] // g, *dims[1:]))
    per_out = Reshape(x=vec, shape=(g, 1, dims[1], *ones))
    return Reshape(x=Binary(op=op, a=grouped, b=per_out), shape=dims)


def _bias(b: WeightExpr | None, affine: Affine, n: int, dtype: str) -> WeightExpr | None:
    scale, shift = affine
    if b is None and shift is None:
        return None
    work = work_dtype(dtype)
    out: WeightExpr = Cast(x=b, dtype=work) if b is not None else Fill(shape=(n,), value=0.0, dtype=work)
    if b is not None and scale is not None:
        out = Binary(op=scale[0], a=out, b=scale[1])
    if shift is not None:
        out = Binary(op="add", a=out, b=shift)
    return Cast(x=out, dtype=dtype)


def _folded(
    p: Planner, w: WeightExpr, b: WeightExpr | None, affine: Affine, conv: Bound | None, old: NodeRef, name: str
) -> tuple[NodeRef, NodeRef | None]:
    """The new weight (the old one when the scale is 1) and bias (None when there is none)."""
    scale = affine[0]
    spec = infer_spec(w).unwrap()
    weight = old if scale is None else p.const(Cast(x=_scaled(w, scale, conv), dtype=spec.dtype), f"{name}_weight")
    bias = _bias(b, affine, _channels(spec, conv), spec.dtype)
    return weight, None if bias is None else p.const(bias, f"{name}_bias")


def _plan(
    p: Planner,
    bin: Bound,
    c: WeightExpr | float | None = None,
    w: WeightExpr | None = None,
    conv: Bound | None = None,
    b: WeightExpr | None = None,
    alpha: float = 1,
    copy: Bound | None = None,
) -> RewritePlan:
    # y' = conv(x, a * W, a * b + k) | linear(x, a * W, a * b + k)
    assert w is not None and c is not None  # (unbound only where the output is quantized: declined)
    kind, first = _key(bin, p.match)
    if copy is not None and isinstance(c, WeightExpr) and copy.spec is not None:  # the value the op reads
        c = Cast(x=c, dtype=copy.spec.dtype)
    dtype = infer_spec(w).unwrap().dtype
    work = work_dtype(dtype)
    # (first: the conv's or linear's output is the op's first operand, the constant its second)
    scales = kind in ("mul", "div") and first
    affine = AFFINE[(kind, first)](_vector(c, work, dtype, scales=scales), float(alpha), work)
    if conv is not None:
        weight, bias = _folded(p, w, b, affine, conv, conv.ref("weight"), f"{conv.name}_{kind}")
        return p.replace(bin, p.copied(p.respell(conv, name=f"{conv.name}_{kind}", weight=weight, bias=bias), "folded"))
    lin = linear_of(p.match)
    old = lin.t.ref("self") if lin.t is not None else lin.op.ref("weight")
    weight, bias = _folded(p, w, b, affine, None, old, f"{lin.op.name}_{kind}")
    return p.replace(bin, p.copied(emit_linear(p, lin, weight, bias, suffix=kind), "folded"))


FOLD_BINARY = rule(
    NAME,
    PATTERN,
    need.check(_dequantized, codes=(QUANTIZED_OUTPUT,)),
    need.check(_affine, codes=(DIVISOR,)),
    need.static("w"),
    need.dtype("w", FLOAT_DTYPES),
    need.check(_same_dtype, codes=(PROMOTION, "malformed-node")),
    need.check(_per_channel, codes=(PER_CHANNEL, "malformed-node")),
    plan=_plan,
    candidate=_candidate,
    repeat=True,
)


def fold_binary() -> PatternRule:
    """The binary-folding rule: a constant scale or shift per output channel folded into the conv or
    linear before it.

    >>> from fxpure.reasons import GENERIC_CODES
    >>> sorted(fold_binary().codes - GENERIC_CODES)
    ['arg-mismatch', 'conv-output-shared', 'dtype-promotion', 'linear-output-shared', 'not-constant', \
'not-per-channel', 'not-scalar', 'output-is-divisor', 'output-shared', 'producer-not-conv-or-linear', \
'quantized-output', 'runs-exhausted', 'symbolic-shape', 'unsupported-dtype', 'wrong-op']
    """
    return FOLD_BINARY

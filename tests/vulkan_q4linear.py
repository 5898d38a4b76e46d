"""An outside author's rule, written with the public kit only: the 4-bit path of ExecuTorch's Vulkan
quantized linear (``backends/vulkan/patterns/quantized_linear.py``: ``make_linear_q4gsw_op``), for a
torchao weight-only int4 program (``quantize_(m, IntxWeightOnlyConfig(weight_dtype=torch.int4,
granularity=PerGroup(g)))``, exported, in edge form or as an aten program).

``linear(x, dequantize_affine(W int8 [N, K], [1, g], scales [N, K/g], zeros [N, K/g]), b?)`` becomes
``et_vk.linear_q4gsw(x, packed, scales_t, g, b)``, anchored at the product (``linear``, ``addmm``,
``mm``). The new constants, computed with ``fxpure.weights`` only (the program's own are not
written):

* ``packed`` (uint8 ``[N, K8 / 2]``, ``K8`` = K padded to 8): ``r = W - zeros`` (each group's zero
  point subtracted: the kernels take no zero point, so a zero point is folded into the integer
  values, exact while they fit in 4 bits), padded with 0 along K to a multiple of 8, ``+ 8``, and
  byte ``j`` of row ``n`` = ``r[n, 2j] + 8 | (r[n, 2j + 1] + 8) << 4`` (the layout
  ``pack_q4_linear_weight__w_4x8`` reads: 8 nibbles per uint32, low nibble first);
* ``scales_t`` (float32 ``[K/g, N]``): the scales transposed, as the shader indexes them
  (``t_scales[group * N4 + n4]``).

``r`` must fit 4 bits, which only its data says (a value outside the declared range, or a zero
point that pushes ``W - zeros`` out of it): the packing reads ``Within(r, -8, 7)``, which the adapter
checks on the computed values, declining the plan ``value-range`` where it fails rather than
wrapping a value silently.

The bias is the program's own (float32, one per output channel; the shader reads ``N`` values, no
padding needed since ``N % 4 == 0`` is required). On edge, a rank > 2 input is flattened by the
linear's own ``view_copy``: the op reads the flat ``[M, K]`` value (the shaders compute
``sizes[-2]`` rows of batch 0 only, so a batched 3-D input would lose rows) and the view after the
product is kept, reading the op.

Declined, typed: an input dtype, weight dtype or output dtype other than float32 / int8 / float32
(``unsupported-dtype``); a declared range wider than 4 bits (``weight-range``); a block size other
than ``[1, g]`` with ``g`` dividing K (``not-per-group``); ``g`` not a multiple of 4 (``group-size``:
the shader's ``K4_per_group = group_size / 4``); N not a multiple of 4 (``channel-alignment``: the
prepack's ``VK_CHECK_COND(N % 4 == 0)``; upstream's pass does not check it); a ``bmm`` or
``matmul`` spelling, or a bias that is no float32 ``[N]`` vector (``no-kernel``); an ``aten.linear``
on a batched input (``batched-input``) or one of symbolic leading dims (``symbolic-shape``)."""

from __future__ import annotations

from collections.abc import Sequence
from math import prod

from fxpure.families import family
from fxpure.linear import linear_of, linear_root
from fxpure.pattern import Bound, Const, Match, PatternRule, Planner, Var, dequantized, need
from fxpure.pattern import rule as make_rule
from fxpure.plan import RewritePlan
from fxpure.reasons import Declined, Reason, SymbolicShape, UnsupportedDtype
from fxpure.snapshot import DTypeArg, TensorSpec
from fxpure.weights import Binary, Cast, Fill, PadTo, Permute, Reshape, Slice, WeightExpr, Within

NOT_Q, RANGE, PER_GROUP, GROUP = "not-quantized", "weight-range", "not-per-group", "group-size"
ALIGNMENT, NO_KERNEL, BATCHED = "channel-alignment", "no-kernel", "batched-input"
VALUE_RANGE = "value-range"
LOW, HIGH = -8, 7  # the int4 values the shader decodes: nibble - 8

# torchao's dequantize, as ``torch.ops.torchao.dequantize_affine.default._schema`` prints it (its
# ``output_dtype=6`` is float32); quant_min and quant_max read by the check below, not matched (strict=())
DQ_AFFINE = family(
    "dequantize_affine",
    "a torchao dequantize",
    [
        "torchao.dequantize_affine.default(Tensor input, SymInt[] block_size, Tensor scale, Tensor? zero_point,"
        " ScalarType input_dtype, Scalar? quant_min=None, Scalar? quant_max=None, ScalarType output_dtype=6)"
        " -> Tensor"
    ],
    strict=(),
)
# the op, as torch.ops.et_vk.linear_q4gsw.default._schema gives it (custom_ops_lib)
Q4GSW = family(
    "linear_q4gsw",
    "a Vulkan 4-bit linear",
    [
        "et_vk.linear_q4gsw.default(Tensor self, Tensor weights, Tensor weight_scales, int group_size,"
        " Tensor? bias=None) -> Tensor"
    ],
)
TARGET = "et_vk.linear_q4gsw.default"

DQW = dequantized(
    Const("wq"),
    name="dqw",
    family=DQ_AFFINE,
    code=NOT_Q,
    scale=Const("scales"),
    zero_point=Const("zeros", optional=True),
)
PATTERN = linear_root(input=Var("x"), weight=DQW, bias=Const("bias", optional=True))
# the candidates: every linear whose weight is a torchao dequantize of anything (declined saying why)
CANDIDATE = linear_root(input=Var("x"), weight=dequantized(Var("w"), family=DQ_AFFINE), bias=Var("b"))


def _dtype(value: object) -> str:
    return value.name if isinstance(value, DTypeArg) else str(value)


def _dtypes(dqw: Bound, match: Match) -> Reason | None:
    """float32 activations, an int8-stored weight declared int8, dequantized to float32 by float32
    scales (the shader's fp32 path; its fp16 one is not written here)."""
    lin = linear_of(match).op.name
    roles = [
        ("input", str(match.dtype("x"))),
        ("weight", f"{match.dtype('wq')}/{_dtype(dqw.args.get('input_dtype'))}"),
        ("dequantized weight", _dtype(dqw.args.get("output_dtype"))),
        ("weight scales", str(match.dtype("scales"))),
    ]
    want = {"input": "float32", "weight": "int8/int8", "dequantized weight": "float32", "weight scales": "float32"}
    for role, dtype in roles:
        if dtype != want[role]:
            return UnsupportedDtype(node=lin, role=role, dtype=dtype)
    return None


def _range(dqw: Bound, match: Match) -> Reason | None:
    """The declared range lies in 4 bits, ``[-8, 7]``."""
    low, high = dqw.args.get("quant_min"), dqw.args.get("quant_max")
    if isinstance(low, int) and isinstance(high, int) and LOW <= low <= high <= HIGH:
        return None
    detail = f"weight of {linear_of(match).op.name}: declared range [{low}, {high}] is not within [{LOW}, {HIGH}]"
    return Declined(code=RANGE, node=dqw.name, detail=detail)


def group_size(match: Match) -> int:
    """K over the number of groups (the scales' dim 1)."""
    return int(match.shape("wq")[1]) // int(match.shape("scales")[1])


def _per_group(dqw: Bound, match: Match, zeros: WeightExpr | None = None) -> Reason | None:
    """Rank-2 weight, block ``[1, g]``, scales (and zero points) ``[N, K / g]``."""
    name = linear_of(match).op.name
    w, s = match.shape("wq"), match.spec("scales")
    z = match.spec("zeros") if zeros is not None else None
    block = dqw.args.get("block_size")
    if len(w) != 2 or s is None or len(s.shape) != 2:
        detail = f"weight of {name}: weight {w}, scales {s.shape if s else None}: not [N, K] by [N, K/g]"
        return Declined(code=PER_GROUP, node=dqw.name, detail=detail)
    n, k = w
    groups = s.shape[1]
    ok = isinstance(groups, int) and groups > 0 and k % groups == 0 and s.shape[0] == n
    if ok and isinstance(groups, int) and block != (1, k // groups):
        ok = False
    if ok and z is not None and z.shape != s.shape:
        ok = False
    if not ok:
        zs = z.shape if z is not None else None
        detail = f"weight of {name}: {w} in blocks {block}, scales {s.shape}, zero points {zs}: not one per group"
        return Declined(code=PER_GROUP, node=dqw.name, detail=detail)
    return None


def _group_size(match: Match) -> Reason | None:
    """A group is a whole number of texels (``K4_per_group = group_size / 4``)."""
    g = group_size(match)
    if g % 4 == 0:
        return None
    lin = linear_of(match).op.name
    return Declined(code=GROUP, node=lin, detail=f"{lin}: group size {g}, not a multiple of 4")


def _aligned(match: Match) -> Reason | None:
    """N a multiple of 4 (the prepack's ``VK_CHECK_COND(N % 4 == 0)``; K is one, as a whole number of
    groups of a multiple of 4: the shaders read K from the input, the padding to 8 is never read)."""
    n = match.shape("wq")[0]
    if n % 4 == 0:
        return None
    lin = linear_of(match).op.name
    return Declined(code=ALIGNMENT, node=lin, detail=f"{lin}: {n} output channels, not a multiple of 4")


def _bias(match: Match, bias: WeightExpr | None = None) -> Reason | None:
    """None, or float32 ``[N]`` (an addmm's ``self`` may be a matrix that broadcasts)."""
    if bias is None:
        return None
    spec, n = match.spec("bias"), match.shape("wq")[0]
    if spec is not None and spec.shape == (n,) and spec.dtype == "float32":
        return None
    lin = linear_of(match).op.name
    got = (spec.shape, spec.dtype) if spec is not None else "unknown"
    return Declined(code=NO_KERNEL, node=lin, detail=f"{lin}: a bias {got}, not {n} float32 values")


def _input(match: Match) -> Reason | None:
    """A ``linear``, ``addmm`` or ``mm`` whose operand is ``(..., M, K)`` with every dim before M 1
    (the shaders compute batch 0)."""
    lin = linear_of(match)
    name = lin.op.name
    if lin.op.family.name not in ("linear", "addmm", "mm"):
        return Declined(code=NO_KERNEL, node=name, detail=f"{name}: a {lin.op.node.target}, not a linear")
    flat = lin.operand
    spec = match.snap.node(flat.name).tensor_spec if flat is not None else None
    if spec is None or len(spec.shape) < 2:
        detail = f"{name}: an input of shape {spec.shape if spec else None}, not (..., rows, K)"
        return Declined(code=NO_KERNEL, node=name, detail=detail)
    batch = spec.shape[:-2]
    if not all(isinstance(d, int) for d in batch):
        return SymbolicShape(node=name, role="input", shape=spec.shape)
    if prod(d for d in batch if isinstance(d, int)) != 1:
        return Declined(code=BATCHED, node=name, detail=f"{name}: input {spec.shape}; the kernels compute batch 0")
    return None


def _i32(x: WeightExpr) -> WeightExpr:
    return Cast(x=x, dtype="int32")


def _int(value: int) -> Fill:
    return Fill(shape=(), value=value, dtype="int32")


def centred(wq: WeightExpr, zeros: WeightExpr | None, n: int, k: int, g: int) -> WeightExpr:
    """``W - zeros`` as int32 ``[N, K]`` (each group's zero point broadcast over its ``g`` values)."""
    w = _i32(wq)
    if zeros is None:
        return w
    grouped = Reshape(x=w, shape=(n, k // g, g))
    z = Reshape(x=_i32(zeros), shape=(n, k // g, 1))
    return Reshape(x=Binary(op="sub", a=grouped, b=z), shape=(n, k))


def packed(r: WeightExpr, n: int, k: int) -> WeightExpr:
    """uint8 ``[N, K8 / 2]``: byte ``j`` = ``(r[2j] + 8) | (r[2j + 1] + 8) << 4``."""
    half = -(-k // 8) * 4
    shifted = Binary(op="add", a=PadTo(x=r, dim=1, multiple=8), b=_int(8))
    pairs = Reshape(x=shifted, shape=(n, half, 2))
    even = Reshape(x=Slice(x=pairs, dim=2, start=0, stop=1), shape=(n, half))
    odd = Reshape(x=Slice(x=pairs, dim=2, start=1, stop=2), shape=(n, half))
    return Cast(x=Binary(op="add", a=Binary(op="mul", a=odd, b=_int(16)), b=even), dtype="uint8")


def emit(
    p: Planner, dqw: Bound, weights: WeightExpr, weight_scales: WeightExpr, bias: WeightExpr | None
) -> RewritePlan:
    """The plan: ``linear_q4gsw`` of the product's own operand with the given packed weight and
    scales, the view after a flattened product kept (reading the op)."""
    lin = linear_of(p.match)
    n = p.match.shape("wq")[0]
    base = dqw.ref("input").name
    flat = lin.operand
    assert flat is not None  # (_input checked it)
    flat_spec = p.match.snap.node(flat.name).tensor_spec
    assert flat_spec is not None
    spec = TensorSpec(shape=(*flat_spec.shape[:-1], n), dtype="float32")
    new = p.call(
        Q4GSW.schemas[TARGET],
        name=f"{lin.op.name}_q4gsw",
        spec=spec,
        provenance=lin.op.name,
        self=flat,
        weights=p.const(weights, f"{base}_q4gsw"),
        weight_scales=p.const(weight_scales, f"{base}_q4gsw_scales"),
        group_size=group_size(p.match),
        bias=bias,
    )
    if lin.view_out is not None:  # the view after a flattened product stays, reading the op
        return p.replace(lin.outer, p.respell(lin.view_out, self=new))
    return p.replace(lin.outer, new)


def _plan(
    p: Planner,
    dqw: Bound,
    wq: WeightExpr,
    scales: WeightExpr,
    zeros: WeightExpr | None = None,
    bias: WeightExpr | None = None,
) -> RewritePlan:
    n, k = p.match.shape("wq")
    r = Within(x=centred(wq, zeros, n, k, group_size(p.match)), low=LOW, high=HIGH)  # (checked on the data)
    return emit(p, dqw, packed(r, n, k), Permute(x=scales, dims=(1, 0)), bias)


q4gsw_linear: PatternRule = make_rule(
    "vulkan-linear-q4gsw",
    PATTERN,
    need.static("wq"),
    need.static("scales"),
    need.check(_per_group, codes=(PER_GROUP,), at="dqw"),
    need.check(_dtypes, codes=("unsupported-dtype",), at="dqw"),
    need.check(_range, codes=(RANGE,), at="dqw"),
    need.check(_group_size, codes=(GROUP,), at="wq"),
    need.check(_aligned, codes=(ALIGNMENT,), at="wq"),
    need.check(_bias, codes=(NO_KERNEL,), at="bias"),
    need.check(_input, codes=(NO_KERNEL, BATCHED, "symbolic-shape"), at="x"),
    plan=_plan,
    codes=(VALUE_RANGE,),  # (the adapter's, where Within fails)
    candidate=CANDIDATE,
)

RULES: Sequence[PatternRule] = (q4gsw_linear,)

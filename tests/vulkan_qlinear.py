"""An outside author's rules, written with the public kit only: the int8 path of ExecuTorch's Vulkan
quantized linear (``backends/vulkan/patterns/quantized_linear.py``), for a PT2E static int8 program in
edge form.

* ``q8ta_linear``: ``dq(xq) -> linear(dq(int8 W per channel), b?) -> [relu] -> q`` becomes
  ``et_vk.q8ta_linear`` (``et_vk.q8ta_linear_gemv`` where the input has one row), anchored at the
  output quantize;
* ``linear_q8ta_q8csw``: the same linear whose output is not quantized (or one ``q8ta_linear``
  declined for its output alone, a quantize to a narrower range) becomes ``et_vk.linear_q8ta_q8csw``,
  anchored at the linear, run after it. That op reads the FLOAT input and quantizes it itself with
  the input's scale and zero point (``QuantizedLinear.cpp``: ``quantize_and_pack_linear_input``; the
  partitioner's ``op_registry`` declares its input float, and its reference computes on it): it reads
  the dequantize's output, which requantizes to the int8 input exactly. (Upstream passes the int8
  value, ``pattern_input_node``, after the partitioner has looked.) Its registered implementation
  (which torch also traces it with) adds the bias unsliced, so a bias the kernel would need padded
  (output channels not a multiple of 4) is added after it instead, as the program holds it (upstream
  pads it, and its own pass then fails on that program: ``tests/test_vulkan_qlinear.py``). NOTE: the
  Vulkan partitioner declares every input of this op float (the int8 weight too), so a program that
  holds it before partitioning keeps it outside the delegate, where it has no kernel: this rule is
  correct by the kernels' arithmetic but not lowerable today (``RULES`` has it last; ``PARTITIONABLE``
  leaves it out).

The kernels (``Q8taLinear.cpp``, ``Q8taLinearGemv.cpp`` and their shaders) take the int8 weight
``[OC, K]`` as the program holds it (they pack it themselves), its int32 sums per output channel (for
the input zero point), its scales per output channel and the bias, each read four channels at a time:
sums, scales and bias hold ``align_up_4(OC)`` values. Those are NEW constants here (``SumOver``,
``PadTo``); upstream pads the program's scales and bias in place, so another reader of a shared scale
sees the padded one. Declined, typed, where the kernels would compute something else: ``K`` not a
multiple of 4 (``channel-alignment``, the kernels' ``VK_CHECK_COND(K % 4 == 0)``), a weight quantized
per tensor or on another axis (``not-per-channel``), nonzero or unknown weight zero points
(``asymmetric-weight``: the kernels take none), a non-int8 value (``unsupported-dtype``), a weight
range wider than int8 (``weight-range``), an output quantized to a narrower range than the kernels'
clamp (``no-kernel``), an input with batch dims (``batched-input``: the shaders compute rows
``sizes[-2]`` only, batch 0; upstream passes a ``(B, M, K)`` input as it is), and the reshapes around a
flattened product that are the model's own (``no-kernel``). Tested torch-free in
``tests/core/test_vulkan_qlinear_core.py``, on real programs in ``tests/test_vulkan_qlinear.py``."""

from __future__ import annotations

from collections.abc import Sequence
from math import prod

from fxpure.families import DEQUANTIZE_PER_TENSOR, QUANTIZE_PER_TENSOR, RELU, family
from fxpure.linear import Linear, linear, linear_input, linear_of, linear_root
from fxpure.pattern import (
    ANY,
    ONE,
    Bound,
    Const,
    Match,
    OneOf,
    Op,
    PatternRule,
    Planner,
    Scalar,
    Users,
    Var,
    dequantized,
    need,
)
from fxpure.pattern import rule as make_rule
from fxpure.plan import RewritePlan
from fxpure.reasons import Declined, Reason, SymbolicShape, UnsupportedDtype
from fxpure.snapshot import DTypeArg, NodeRef
from fxpure.weights import PadTo, SumOver, WeightExpr

ALIGN = 4  # the kernels read sums, scales and bias a texel (four channels) at a time
NOT_Q, ALIGNMENT, PER_CHANNEL, ASYMMETRIC = "not-quantized", "channel-alignment", "not-per-channel", "asymmetric-weight"
RANGE, NO_KERNEL, BATCHED = "weight-range", "no-kernel", "batched-input"

_ARGS = "Tensor x, float input_scale, int input_zero_point, Tensor weights, Tensor weight_sums, Tensor weight_scales"
# the ops' schemas, as torch.ops.et_vk.<op>.default._schema gives them (custom_ops_lib), declared to the kit
Q8TA = family(
    "q8ta_linear",
    "a Vulkan int8 linear",
    [
        f"et_vk.{op}.default({_ARGS}, float output_scale, int output_zero_point, Tensor? bias=None,"
        ' str activation="none") -> Tensor'
        for op in ("q8ta_linear", "q8ta_linear_gemv")
    ],
)
Q8CSW = family(
    "linear_q8ta_q8csw",
    "a Vulkan int8 linear",
    [f"et_vk.linear_q8ta_q8csw.default({_ARGS}, Tensor? bias=None) -> Tensor"],
)

# the input: an int8 value dequantized per tensor (by numbers: parameters computed at run time are
# a dynamically quantized input, declined not-scalar)
DQX = dequantized(
    Var("xq"), name="dqx", family=DEQUANTIZE_PER_TENSOR, code=NOT_Q, scale=Scalar("x_scale"), zero_point=Scalar("x_zp")
)
# the weight: an int8 constant dequantized (per channel, checked below: a per-tensor one is declined)
DQW = dequantized(Const("wq"), name="dqw", code=NOT_Q, scale=OneOf(Const("scales"), Scalar("scale")))
BIAS = Const("bias", optional=True)
QUANTIZE = (QUANTIZE_PER_TENSOR,)


def _quantized(product: OneOf, relu_users: Users = ONE) -> Op:
    """``q(product)`` or ``q(relu(product))``."""
    relu = Op(RELU, name="relu", code=NOT_Q, users=relu_users, self=product)
    return Op(
        QUANTIZE_PER_TENSOR,
        name="q",
        scale=Scalar("out_scale"),
        zero_point=Scalar("out_zp"),
        input=OneOf(product, relu, noun="a linear"),
    )


# anchored at the output quantize; its candidates: every quantize of a linear (or of its relu) whose
# weight is dequantized, whatever the input and the weight are (declined saying why)
Q8TA_PATTERN = _quantized(linear(input=DQX, weight=DQW, bias=BIAS))
Q8TA_CANDIDATE = _quantized(linear(input=Var("x"), weight=dequantized(Var("w")), bias=Var("b"), users=ANY), ANY)
# anchored at the linear
Q8CSW_PATTERN = linear_root(input=DQX, weight=DQW, bias=BIAS)
Q8CSW_CANDIDATE = linear_root(input=Var("x"), weight=dequantized(Var("w")), bias=Var("b"))


def _dtype(op: Bound) -> str:
    d = op.args.get("dtype")
    return d.name if isinstance(d, DTypeArg) else str(d)


def _int8(dqx: Bound, dqw: Bound, match: Match, q: Bound | None = None) -> Reason | None:
    """The input, the weight (stored and declared) and the output (where quantized) are int8."""
    lin = linear_of(match).op
    stored = match.dtype("wq")
    roles = [
        ("quantized input", _dtype(dqx)),
        ("weight", stored if stored == _dtype(dqw) else f"{stored}/{_dtype(dqw)}"),
    ]
    for role, dtype in [*roles, *([("quantized output", _dtype(q))] if q is not None else [])]:
        if dtype != "int8":
            return UnsupportedDtype(node=lin.name, role=role, dtype=dtype)
    return None


def _weight_range(dqw: Bound, match: Match) -> Reason | None:
    """The weight's declared range lies in int8's (the kernels read the int8 values as they are)."""
    low, high = dqw.args.get("quant_min"), dqw.args.get("quant_max")
    if isinstance(low, int) and isinstance(high, int) and -128 <= low <= high <= 127:
        return None
    detail = f"weight of {linear_of(match).op.name}: range [{low}, {high}] is not within int8's"
    return Declined(code=RANGE, node=dqw.name, detail=detail)


def _per_channel(dqw: Bound, match: Match, scales: WeightExpr | None = None) -> Reason | None:
    """Scales one per output channel, along the weight's dim 0."""
    name, oc = linear_of(match).op.name, match.shape("wq")[0]
    axis = dqw.args.get("axis")
    spec = match.spec("scales") if scales is not None else None
    if axis is None or spec is None:
        return Declined(code=PER_CHANNEL, node=dqw.name, detail=f"weight of {name}: quantized per tensor")
    if axis not in (0, -2) or spec.shape != (oc,):
        detail = f"weight of {name}: scales {spec.shape} on axis {axis}, not one per each of {oc} output channels"
        return Declined(code=PER_CHANNEL, node=dqw.name, detail=detail)
    return None


def _symmetric(dqw: Bound, match: Match) -> Reason | None:
    """Zero points all known to be 0: the kernels take none (``custom_ops_lib`` dequantizes with zeros)."""
    zero = dqw.args.get("zero_point")
    info = match.snap.constants.get(zero.name) if isinstance(zero, NodeRef) else None
    values = info.values if info is not None else (zero,) if isinstance(zero, int) else None
    if values is not None and not any(values):
        return None
    what = "not a known constant" if values is None else f"{values[:4]}, not all 0"
    detail = f"weight of {linear_of(match).op.name}: zero points {what}"
    return Declined(code=ASYMMETRIC, node=dqw.name, detail=detail)


def _aligned(match: Match) -> Reason | None:
    """In channels a multiple of 4 (``VK_CHECK_COND(K % 4 == 0)``)."""
    k = match.shape("wq")[1]
    if k % ALIGN == 0:
        return None
    lin = linear_of(match).op.name
    return Declined(code=ALIGNMENT, node=lin, detail=f"{lin}: {k} input channels, not a multiple of {ALIGN}")


def _full_range(q: Bound) -> Reason | None:
    """The output quantized to int8's whole range, to which the kernels clamp."""
    low, high = q.args.get("quant_min"), q.args.get("quant_max")
    if (low, high) == (-128, 127):
        return None
    detail = f"{q.name}: its output is quantized to [{low}, {high}], the kernels' to [-128, 127]"
    return Declined(code=NO_KERNEL, node=q.name, detail=detail)


def _bias(match: Match, bias: WeightExpr | None = None) -> Reason | None:
    """A bias of one float32 value per output channel (what the kernels read; an addmm's may broadcast)."""
    if bias is None:
        return None
    spec, oc = match.spec("bias"), match.shape("wq")[0]
    if spec is not None and spec.shape == (oc,) and spec.dtype == "float32":
        return None
    lin = linear_of(match).op.name
    shape = (spec.shape, spec.dtype) if spec is not None else "unknown"
    return Declined(code=NO_KERNEL, node=lin, detail=f"{lin}: a bias {shape}, not {oc} float32 values")


def _input(match: Match) -> Reason | None:
    """The linear reads the input as it is (spelled ``linear``, ``addmm`` or ``mm``; around a flattened
    product, the linear's own reshapes), of shape ``(..., rows, K)`` where any dim before ``rows`` is 1:
    the shaders compute ``sizes[-2]`` rows of batch 0 only."""
    lin = linear_of(match)
    name = lin.op.name
    if lin.t_view is not None or lin.op.node.target.endswith("matmul.default"):
        return Declined(code=NO_KERNEL, node=name, detail=f"{name}: a {lin.op.node.target}, not a linear")
    if not linear_input(match, lin)[1]:
        return Declined(code=NO_KERNEL, node=name, detail=f"{name}: the reshapes around it are the model's own")
    x = match.spec("xq")
    if x is None or len(x.shape) < 2:
        detail = f"{name}: an input of shape {x.shape if x else None}, not (..., rows, K)"
        return Declined(code=NO_KERNEL, node=name, detail=detail)
    batch = x.shape[:-2]
    if not all(isinstance(d, int) for d in batch):
        return SymbolicShape(node=name, role="input", shape=x.shape)
    if prod(d for d in batch if isinstance(d, int)) != 1:
        detail = f"{name}: input {x.shape} has batch dims; the kernels compute batch 0 only"
        return Declined(code=BATCHED, node=name, detail=detail)
    return None


def _one_row(match: Match) -> bool:
    """The input has one row (``_input`` checked the dims before it are 1): the gemv kernel's case."""
    x = match.spec("xq")
    return x is not None and x.shape[-2] == 1


def _vector(p: Planner, expr: WeightExpr, ref: object, oc: int, name: str) -> WeightExpr | NodeRef:
    """A per-channel vector as the kernels read it: the program's own where aligned, else a new
    constant padded to ``align_up_4(oc)`` (the original stays as it is for its other readers)."""
    if oc % ALIGN == 0:
        return expr
    base = ref.name if isinstance(ref, NodeRef) else name
    return p.const(PadTo(x=expr, dim=0, multiple=ALIGN), f"{base}_padded")


def _operands(
    p: Planner, dqw: Bound, wq: WeightExpr, scales: WeightExpr, bias: WeightExpr | None
) -> tuple[NodeRef, WeightExpr | NodeRef, WeightExpr | NodeRef | None]:
    """The weight's sums, its scales and the bias, padded to the kernels' texel width."""
    oc = p.match.shape("wq")[0]
    w_ref = dqw.ref("input")
    summed = SumOver(x=wq, dims=(1,), dtype="int32")
    sums = p.const(PadTo(x=summed, dim=0, multiple=ALIGN) if oc % ALIGN else summed, f"{w_ref.name}_sums")
    lin = linear_of(p.match)
    return (
        sums,
        _vector(p, scales, dqw.args.get("scale"), oc, f"{w_ref.name}_scales"),
        None if bias is None else _vector(p, bias, lin.bias, oc, f"{lin.op.name}_bias"),
    )


def _plan_q8ta(
    p: Planner,
    q: Bound,
    dqw: Bound,
    xq: NodeRef,
    x_scale: float,
    x_zp: int,
    out_scale: float,
    out_zp: int,
    wq: WeightExpr,
    relu: Bound | None = None,
    scales: WeightExpr | None = None,
    bias: WeightExpr | None = None,
) -> RewritePlan:
    assert scales is not None  # (_per_channel checked it)
    op = "q8ta_linear_gemv" if _one_row(p.match) else "q8ta_linear"
    lin = linear_of(p.match)
    sums, w_scales, b = _operands(p, dqw, wq, scales, bias)
    new = p.call(
        Q8TA.schemas[f"et_vk.{op}.default"],
        name=f"{lin.op.name}_q8ta",
        spec=q.spec,
        provenance=lin.op.name,
        x=xq,
        input_scale=x_scale,
        input_zero_point=x_zp,
        output_scale=out_scale,
        output_zero_point=out_zp,
        activation="relu" if relu is not None else "none",
        weights=wq,
        weight_sums=sums,
        weight_scales=w_scales,
        bias=b,
    )
    return p.replace(q, new)


def _plan_q8csw(
    p: Planner,
    dqx: Bound,
    dqw: Bound,
    x_scale: float,
    x_zp: int,
    wq: WeightExpr,
    scales: WeightExpr | None = None,
    bias: WeightExpr | None = None,
) -> RewritePlan:
    assert scales is not None  # (_per_channel checked it)
    lin: Linear = linear_of(p.match)
    spec = lin.outer.spec
    # linear_q8ta_q8csw's registered implementation, which is also what torch traces it with (its
    # meta), adds the bias unsliced: a bias padded to 4 fails to trace. Where it would be padded, the
    # op takes none and the program's own bias is added after it (one value per output channel).
    after = bias is not None and p.match.shape("wq")[0] % ALIGN != 0
    sums, w_scales, b = _operands(p, dqw, wq, scales, None if after else bias)
    new = p.call(
        Q8CSW.schemas["et_vk.linear_q8ta_q8csw.default"],
        name=f"{lin.op.name}_q8csw",
        spec=spec,
        provenance=lin.op.name,
        x=NodeRef(dqx.name),
        input_scale=x_scale,
        input_zero_point=x_zp,
        weights=wq,
        weight_sums=sums,
        weight_scales=w_scales,
        bias=b,
    )
    if after:
        new = p.call("aten.add.Tensor", name=f"{lin.op.name}_q8csw_bias", spec=spec, self=new, other=bias)
    return p.replace(lin.outer, new)


_COMMON = (
    need.static("wq"),
    need.rank("wq", (2,)),
    need.check(_per_channel, codes=(PER_CHANNEL,), at="dqw"),
    need.check(_symmetric, codes=(ASYMMETRIC,), at="dqw"),
    need.check(_weight_range, codes=(RANGE,), at="dqw"),
    need.check(_aligned, codes=(ALIGNMENT,), at="wq"),
    need.check(_bias, codes=(NO_KERNEL,), at="bias"),
    need.check(_input, codes=(NO_KERNEL, BATCHED, "symbolic-shape"), at="xq"),
)

q8ta_linear: PatternRule = make_rule(
    "vulkan-q8ta-linear",
    Q8TA_PATTERN,
    need.check(_int8, codes=("unsupported-dtype",), at="dqx"),
    *_COMMON,
    need.check(_full_range, codes=(NO_KERNEL,), at="q"),
    plan=_plan_q8ta,
    candidate=Q8TA_CANDIDATE,
)


def _int8_in(dqx: Bound, dqw: Bound, match: Match) -> Reason | None:
    return _int8(dqx, dqw, match)


linear_q8ta_q8csw: PatternRule = make_rule(
    "vulkan-linear-q8ta-q8csw",
    Q8CSW_PATTERN,
    need.check(_int8_in, codes=("unsupported-dtype",), at="dqx"),
    *_COMMON,
    plan=_plan_q8csw,
    candidate=Q8CSW_CANDIDATE,
)

RULES: Sequence[PatternRule] = (q8ta_linear, linear_q8ta_q8csw)
"""Both, in order: a linear whose output is quantized first, then the others."""
PARTITIONABLE: Sequence[PatternRule] = (q8ta_linear,)
"""What the Vulkan partitioner takes when written before it (see ``linear_q8ta_q8csw``)."""

"""An outside author's rule, written with the public kit only: an eval batch norm BEFORE a conv,
folded into that conv ("fold-bn-into-next-conv").

``conv(bn(x), W, b)``, where ``bn(x) = x * s + t`` per input channel (``s = gamma / sqrt(var + eps)``,
``t = beta - mean * s``), becomes ``conv(x, W', b')``. With ``G`` groups of ``C/G`` input channels,
input channel ``c = g * C/G + i`` of group ``g``:

* a conv, ``W`` of shape ``(OC, C/G, k...)``, output ``o`` in group ``g = o // (OC/G)``:
  ``W'[o, i, k...] = W[o, i, k...] * s[c]``, ``b'[o] = b[o] + sum_{i, k...} W[o, i, k...] * t[c]``;
* a transposed conv, ``W`` of shape ``(C, OC/G, k...)``, output ``o = g * OC/G + j``:
  ``W'[c, j, k...] = W[c, j, k...] * s[c]``, ``b'[o] = b[o] + sum_{i, k...} W[c, j, k...] * t[c]``

(no bias: 0). Exact only where every output position receives every tap of the kernel from inside
the input, so that ``t``'s share is the same at every position:

* a conv without padding (``"valid"``, zeros, or ``"same"`` of a kernel of size 1). A padded conv
  pads ``x`` with zeros where the original padded ``bn(x)`` with zeros, i.e. ``x`` with ``-t/s``:
  declined ``conv-padding`` (no op pads with a value per channel);
* a transposed conv of stride 1, no output padding, and a padding of at least ``dilation * (k - 1)``
  in each dim (which crops every output the kernel reaches only in part; a 1x1 one, any padding).
  Any other is declined ``transposed-conv``: near its edges, or between strides, an output position
  receives fewer taps, and ``t``'s share there is another.

Computed in float32 (float64 for float64) and cast back to the weight's dtype, as the kit's
``fold_batch_norm`` does.
"""

from __future__ import annotations

from fxpure.families import CONV
from fxpure.pattern import Bound, Const, Match, Op, Planner, Var, eval_batch_norm, need, rule
from fxpure.plan import RewritePlan
from fxpure.reasons import Declined, Reason
from fxpure.snapshot import NodeRef
from fxpure.weights import (
    FLOAT_DTYPES,
    Binary,
    Reshape,
    SumOver,
    WeightExpr,
    as_dtype,
    batch_norm_affine,
    work_dtype,
)

PADDING, TRANSPOSED, CHANNELS = "conv-padding", "transposed-conv", "channel-mismatch"

# conv(bn(x, gamma?, beta?, mean, var, training=False)[0], w, b?): the bn read by the conv only
PATTERN = Op(
    CONV,
    name="conv",
    input=eval_batch_norm(Var("x"), name="bn"),
    weight=Const("w"),
    bias=Const("b", optional=True),
)


def _exact(conv: Bound, match: Match) -> Reason | None:
    """Every output position of the conv receives every tap of its kernel from inside the input."""
    padding, kernel = conv.args.get("padding"), match.shape("w")[2:]
    pads = None if isinstance(padding, str) else conv.ints("padding")  # ("valid", "same": conv{1,2,3}d.padding)
    if not conv.bool("transposed"):
        if padding == "valid" or (padding == "same" and all(k == 1 for k in kernel)):
            return None
        if pads is not None and all(p == 0 for p in pads):
            return None
        detail = f"{conv.name} pads its input ({padding!r}) with zeros where the batch norm's output would be padded"
        return Declined(code=PADDING, node=conv.name, detail=detail, path="conv.padding")
    stride, dilation, extra = conv.ints("stride"), conv.ints("dilation"), conv.ints("output_padding")
    why: tuple[str, str] | None = None
    if any(s != 1 for s in stride):
        why = ("stride", f"stride {stride}: the outputs between strides receive other taps")
    elif any(e != 0 for e in extra):
        why = ("output_padding", f"output padding {extra}: the last outputs receive fewer taps")
    elif pads is not None:
        edge = tuple(d * (k - 1) for d, k in zip(dilation, kernel, strict=True))
        if all(p >= e for p, e in zip(pads, edge, strict=True)):
            return None
        why = ("padding", f"padding {pads} < {edge}: the outputs near its edges receive fewer taps")
    arg, told = why or ("padding", f"padding {padding!r}")
    return Declined(
        code=TRANSPOSED, node=conv.name, detail=f"{conv.name} is a transposed conv of {told}", path=f"conv.{arg}"
    )


def _per_input_channel(conv: Bound, match: Match) -> Reason | None:
    """The batch norm has one statistic per input channel of the conv."""
    w = match.shape("w")
    cin = w[0] if conv.bool("transposed") else conv.int("groups") * w[1]
    mean = match.spec("mean")
    if mean is not None and mean.shape == (cin,):
        return None
    found = None if mean is None else mean.shape
    detail = f"the batch norm before {conv.name} has statistics of shape {found}, the conv reads {cin} channels"
    return Declined(code=CHANNELS, node=conv.name, detail=detail, path="conv.input/bn.running_mean")


def _fold(
    p: Planner,
    conv: Bound,
    bn: Bound,
    x: NodeRef,
    w: WeightExpr,
    mean: WeightExpr,
    var: WeightExpr,
    b: WeightExpr | None = None,
    gamma: WeightExpr | None = None,
    beta: WeightExpr | None = None,
) -> RewritePlan:
    dims, dtype, groups = p.match.shape("w"), p.match.dtype("w"), conv.int("groups")
    work = work_dtype(dtype)
    s, t = batch_norm_affine(mean=mean, var=var, gamma=gamma, beta=beta, eps=bn.float("eps"), dtype=work)
    ones = (1,) * (len(dims) - 2)
    if conv.bool("transposed"):  # W (C, OC/G, k...) as (G, C/G, OC/G, k...); s, t as (G, C/G, 1, 1...)
        icg, ocg = dims[0] // groups, dims[1]
        grouped = Reshape(x=as_dtype(w, work), shape=(groups, icg, *dims[1:]))
        scale, shift = (Reshape(x=v, shape=(groups, icg, 1, *ones)) for v in (s, t))
        taps = (1, *range(3, len(dims) + 1))  # (C/G, k...) of each (g, j)
    else:  # W (OC, C/G, k...) as (G, OC/G, C/G, k...): group g's outputs meet its own channels
        ocg, icg = dims[0] // groups, dims[1]
        grouped = Reshape(x=as_dtype(w, work), shape=(groups, ocg, *dims[1:]))
        scale, shift = (Reshape(x=v, shape=(groups, 1, icg, *ones)) for v in (s, t))
        taps = tuple(range(2, len(dims) + 1))  # (C/G, k...) of each (g, o)
    weight: WeightExpr = Reshape(x=Binary(op="mul", a=grouped, b=scale), shape=dims)
    summed = SumOver(x=Binary(op="mul", a=grouped, b=shift), dims=taps, dtype=work)
    bias: WeightExpr = Reshape(x=summed, shape=(groups * ocg,))
    if b is not None:
        bias = Binary(op="add", a=as_dtype(b, work), b=bias)
    new_w = p.const(as_dtype(weight, dtype), f"{conv.name}_bnin_weight")
    new_b = p.const(as_dtype(bias, dtype), f"{conv.name}_bnin_bias")
    return p.replace(conv, p.respell(conv, name=f"{conv.name}_bnin", input=x, weight=new_w, bias=new_b))


fold_bn_into_conv = rule(
    "fold-bn-into-next-conv",
    PATTERN,
    need.static("w"),
    need.static("mean"),
    need.dtype("w", FLOAT_DTYPES),
    need.dtype("x", FLOAT_DTYPES),
    need.check(_exact, codes=(PADDING, TRANSPOSED)),
    need.check(_per_input_channel, codes=(CHANNELS,)),
    plan=_fold,
)

"""Reach of the torch-free strategies: every rejection code of every rule in ``fxpure.rules.RULES``, and
every plan shape, is drawn by them.

The fuzzer's generator (``tests.core.test_fuzz.build_graph``) with its own steps draws the common cases;
:data:`RARE` adds steps for what it never draws: channel counts beyond 8 and groups beyond 10, channels
not a multiple of the texel width, symbolic channels and weights, batch norms whose statistics do not fit
the conv, linears spelled with other ``alpha``/``beta`` or weight transposes, a weight transpose read by
two matmuls, convs on unbatched inputs, numbers that are graph values. Each is a random step like the
fuzzer's (channels, groups, dtypes, spellings drawn), so the rest of the graph varies around it.

``test_every_code_and_plan_shape_is_drawn`` plans ``GRAPHS`` seeded graphs of each kind (the fuzzer's,
the same with one thing wrong, and ones with rare steps) with every rule, counts what each rule declined
with which code (a fallback plan counts for the code it stands in for) and the shapes of its plans, and
asserts every code outside :data:`UNREACHABLE` and every shape in :data:`SHAPES` was seen; the counts are
printed (``pytest -s``). ``test_codes_found_outside_the_core_are_reported_as_given``: the adapter's codes,
which no graph can draw, through ``plan(declined=...)``. ``test_every_rule_on_rare_graphs``: the fuzzer's
properties on the graphs with rare steps.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TypeAlias

from hypothesis import given, settings
from hypothesis import strategies as st

from fxpure import GraphSnapshot, NodeRef, RewritePlan, plan
from fxpure.families import CONV, SCHEMAS
from fxpure.plan import Rule
from fxpure.reasons import Declined
from fxpure.rules import RULES, concat_parallel_linears, quantized_conv
from fxpure.snapshot import Arg, DTypeArg, TensorSpec
from fxpure.testing import spec
from tests.core.test_fuzz import (
    SIZE,
    STEPS,
    Q,
    _batch_norm,
    _below,
    _bias,
    _binary,
    _conv,
    _conv_args,
    _corrupt,
    _dequantized_weight,
    _Gen,
    _linear,
    _qparams,
    _then,
    build_graph,
    check_every_rule,
)

GRAPHS = 500  # seeded graphs of each kind
WIDE = (3, 6, 12, 16, 22, 24, 33)  # channel counts beyond the fuzzer's (2, 4, 8), odd and not multiples of 4
SYM = "c0"  # a symbolic channel (or feature) count


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _wide_conv_shapes(gen: _Gen, transposed: bool) -> tuple[int, int, int]:
    """Input channels, groups (any divisor: 1, a few, more than 10, depthwise) and output channels."""
    cin = gen.pick(WIDE)
    divisors = _divisors(cin)
    groups = divisors[-2] if gen.flip(4) else gen.pick(divisors)  # the largest but depthwise: 11, 12 too
    cout = groups * gen.pick((1, 1, 2, 3)) if transposed or groups == cin else groups * gen.pick((1, 2, 3))
    return cin, groups, cout


def _channels_in(gen: _Gen, cin: int) -> int | str:
    """The input's channel dim as the graph records it: mostly static, sometimes symbolic."""
    return SYM if gen.flip(4) else cin


def _grouped(gen: _Gen) -> None:
    """A conv (rank 1 or 2, any spelling) with wide, grouped or depthwise channels; its input's channel
    count sometimes symbolic."""
    transposed = gen.flip(5)
    targets = [t for t in sorted(SCHEMAS) if t.startswith(("aten.conv", "aten.convolution"))]
    fixed = [t for t in targets if SCHEMAS[t].fixed.get("transposed", transposed) == transposed]
    target = gen.pick([t for t in fixed if "3d" not in t])
    rank = 1 if "1d" in target else 2 if "2d" in target else gen.pick((1, 2))
    cin, groups, cout = _wide_conv_shapes(gen, transposed)
    k = gen.pick((1, 3))
    w_shape = (cin, cout // groups, *(k,) * rank) if transposed else (cout, cin // groups, *(k,) * rank)
    x_shape = (gen.batch, _channels_in(gen, cin), *(SIZE,) * rank)
    x = gen.input(x_shape)
    args = {
        "input": x,
        "weight": gen.constant(w_shape),
        "bias": _bias(gen, cout) if not gen.flip(5) else gen.constant((gen.pick((max(1, cout - 1), cout + 1)),)),
        **_conv_args(gen, target, rank, transposed, k),
        "groups": groups,
    }
    out = spec(gen.batch, cout, *(SIZE,) * rank, dtype=gen.dtype)
    gen.result(gen.call(target, out, **args), out)


def _quantized_grouped(gen: _Gen) -> None:
    """dq(int8 x) -> conv(dq(int8 W)) -> [relu] -> q with wide, grouped or depthwise channels (output
    channels per group not a multiple of 4: the kernels' texel width), a 1-d conv, symbolic channels,
    a conv read by others too; sometimes dequantized again and scaled."""
    rank = 1 if gen.flip(8) else 2
    target = "aten.conv1d.default" if rank == 1 else gen.pick(("aten.convolution.default", "aten.conv2d.default"))
    transposed = target == "aten.convolution.default" and gen.flip(4)
    cin, groups, cout = _wide_conv_shapes(gen, transposed)
    k = gen.pick((1, 3))
    w_shape = (cin, cout // groups, *(k,) * rank) if transposed else (cout, cin // groups, *(k,) * rank)
    sym = gen.flip(8)
    xqs = spec(gen.batch, SYM if sym else cin, *(SIZE,) * rank, dtype="int8")
    xq = gen.input(xqs.shape, "int8")
    xs = spec(*xqs.shape, dtype="float32")
    qparams = _qparams(gen, xq, "int8")
    if gen.flip(8):
        qparams["scale"] = gen.input((), "float32")  # a scale that is a graph value (a symbolic float)
    dqx = gen.call(f"{Q}.dequantize_per_tensor.default", xs, **qparams)
    w = gen.constant(w_shape, "int8")
    if rank == 2:
        dqw = _dequantized_weight(gen, w, w_shape, transposed)
    else:
        dqw = gen.call(
            f"{Q}.dequantize_per_tensor.default", spec(*w_shape), **{**_qparams(gen, w, "int8"), "zero_point": 0}
        )
    args = {
        "input": dqx,
        "weight": dqw,
        "bias": gen.constant((cout,), "float32") if gen.flip() else None,
        **_conv_args(gen, target, rank, transposed, k),
        "groups": groups,
    }
    out = spec(xs.shape[0], SYM if sym and gen.flip() else cout, *(SIZE,) * rank)
    y = gen.call(target, out, **args)
    if gen.flip(6):
        gen.result(y, out)  # the conv's output read by others too
    if gen.flip():
        y = gen.call("aten.relu.default", out, self=y)
    q = gen.call(f"{Q}.quantize_per_tensor.default", spec(*out.shape, dtype="int8"), **_qparams(gen, y, "int8"))
    if gen.flip(3):  # dequantized again and scaled (a layer scale of a PT2E program)
        dq = gen.call(f"{Q}.dequantize_per_tensor.default", out, **_qparams(gen, q, "int8"))
        gen.call("aten.mul.Tensor", out, self=dq, other=gen.constant((1,)))


def _vector(gen: _Gen, n: int) -> NodeRef:
    """A statistics vector: mostly of ``n`` entries, sometimes of another count."""
    return gen.constant((n if not gen.flip(3) else gen.pick((3, n + 1)),))


def _odd_product(gen: _Gen) -> None:
    """A conv or a linear whose weight has a symbolic size or is int8, or whose weight or bias does not
    fit its output channels (as ``symbolic_trace`` records a model whatever its tensors)."""
    conv = gen.flip()
    c = gen.pick((2, 4, 8))
    x_shape = (gen.batch, c, SIZE, SIZE) if conv else (gen.batch, c)
    w_shape: tuple[int | str, ...] = (c, c, 1, 1) if conv else (c, c)
    match gen.choose(4):
        case 0:
            w_shape = (SYM, *w_shape[1:])
        case 1:
            w_shape = (gen.pick((3, c + 1)), *w_shape[1:])
    w = gen.constant(w_shape, gen.pick((gen.dtype, gen.dtype, "int8")))
    bias = gen.constant((gen.pick((c, 3, c + 1)),)) if gen.flip() else None
    out = spec(*x_shape, dtype=gen.dtype)
    x = gen.input(x_shape)
    if conv:
        y = gen.call("aten.conv2d.default", out, input=x, weight=w, bias=bias)
    else:
        y = gen.call("aten.linear.default", out, input=x, weight=w, bias=bias)
    gen.result(y, out)


def _scale(gen: _Gen) -> None:
    """A value times, plus, minus or over a per-channel constant (what folds into a conv's or a linear's
    weight and bias)."""
    x, xs = gen.act([2, 4])
    c = xs.shape[1]
    op = gen.pick(("mul", "add", "sub", "div"))
    other = gen.constant((c, 1, 1) if len(xs.shape) == 4 else (c,))
    gen.result(gen.call(f"aten.{op}.Tensor", xs, self=x, other=other), xs)


def _odd_batch_norm(gen: _Gen) -> None:
    """An eval batch norm whose statistics, scale or shift do not fit its input's channels."""
    x, xs = gen.act([2, 4])
    c = xs.shape[1]
    assert isinstance(c, int)
    args: dict[str, Arg] = {
        "input": x,
        "weight": _vector(gen, c) if gen.flip() else None,
        "bias": _vector(gen, c) if gen.flip() else None,
        "running_mean": _vector(gen, c),
        "running_var": _vector(gen, c),
        "training": False,
        "momentum": 0.1,
        "eps": 1e-5,
        "cudnn_enabled": False,
    }
    gen.result(gen.call("aten.batch_norm.default", xs, **args), xs)


def _shared_matmul(gen: _Gen) -> None:
    """Two or three linears in the matmul spelling on one rank-3 input (view -> mm/addmm -> view), one
    product also read by another node; features sometimes symbolic."""
    f = gen.pick((2, 4))
    sym = gen.flip(3)
    x = gen.input((gen.batch, 2, SYM if sym else f))
    rows: int | str = 2 * gen.batch if isinstance(gen.batch, int) else "s1"
    copy = "_copy" if gen.g.dialect == "edge" else ""
    flat = gen.call(f"aten.view{copy}.default", spec(rows, SYM if sym else f, dtype=gen.dtype), self=x, size=(-1, f))
    shared = gen.choose(3)
    for i in range(2 + gen.choose(2)):
        wt = gen.call(
            f"aten.permute{copy}.default", spec(f, f, dtype=gen.dtype), self=gen.constant((f, f)), dims=(1, 0)
        )
        mm_spec = spec(rows, f, dtype=gen.dtype)
        if gen.flip():
            y = gen.call("aten.addmm.default", mm_spec, self=gen.constant((f,)), mat1=flat, mat2=wt)
        else:
            y = gen.call("aten.mm.default", mm_spec, self=flat, mat2=wt)
        if i == shared:  # the product read by another node too
            gen.result(gen.call("aten.relu.default", mm_spec, self=y), mm_spec)
        back = spec(gen.batch, 2, f, dtype=gen.dtype)
        batch = gen.batch if isinstance(gen.batch, int) else -1
        gen.result(gen.call(f"aten.view{copy}.default", back, self=y, size=(batch, 2, f)), back)


def _odd_linear(gen: _Gen) -> None:
    """A linear in the matmul spelling with what the rules do not take: ``alpha``/``beta`` other than 1,
    a weight "transpose" that keeps the dims (square weight) or is another op, one weight transpose read
    by two matmuls, a bias that is not one value per output, symbolic features, an input of rank 1 or 5;
    then sometimes a batch norm or a scale."""
    f = gen.pick((2, 4, 8))
    sym = gen.flip(4)
    kind = gen.choose(6)
    if kind == 5:  # aten.linear on a rank-1 or rank-5 input
        x_shape: tuple[int | str, ...] = gen.pick(((f,), (gen.batch, 2, 2, 2, f)))
        x = gen.input(x_shape)
        out = spec(*x_shape[:-1], f, dtype=gen.dtype)
        gen.result(gen.call("aten.linear.default", out, input=x, weight=gen.constant((f, f))), out)
        return
    x_shape = (gen.batch, SYM if sym else f)
    x = gen.input(x_shape)
    w = gen.constant((f, f))
    copy = "_copy" if gen.g.dialect == "edge" else ""
    wt_spec = spec(f, f, dtype=gen.dtype)
    if kind == 0:  # the "transpose" keeps the dims
        wt = gen.call(f"aten.permute{copy}.default", wt_spec, self=w, dims=(0, 1))
    elif kind == 1:  # the weight comes out of another op
        wt = gen.call("aten.relu.default", wt_spec, self=w)
    else:
        wt = gen.call(f"aten.permute{copy}.default", wt_spec, self=w, dims=(1, 0))
    out = spec(gen.batch, f, dtype=gen.dtype)
    times = 2 if kind == 2 else 1  # kind 2: the transpose read by two matmuls
    for _ in range(times):
        bias: NodeRef | None = gen.constant(gen.pick(((f,), (1, f), (gen.batch, f)))) if kind == 3 else _bias(gen, f)
        if bias is not None:
            alpha, beta = (gen.pick((1, 2.0)), gen.pick((1, 0.5))) if kind == 4 else (1, 1)
            y = gen.call("aten.addmm.default", out, self=bias, mat1=x, mat2=wt, alpha=alpha, beta=beta)
        else:
            y = gen.call("aten.mm.default", out, self=x, mat2=wt)
        gen.result(y, out)


def _odd_conv1d(gen: _Gen) -> None:
    """A 1-d conv on an unbatched (C, L) input, or with symbolic channels; its weight a constant, computed
    by another op (a relu, a dequantize of a computed tensor), or a dequantized int8 constant (per tensor,
    per channel, or of another rank than the dequantize says)."""
    c = gen.pick((2, 4))
    unbatched = gen.flip(3)
    x_shape: tuple[int | str, ...] = (c, SIZE) if unbatched else (gen.batch, SYM if gen.flip(3) else c, SIZE)
    x = gen.input(x_shape)
    w_shape = (c, c, 1)
    match gen.choose(6):
        case 0:
            w = gen.call("aten.relu.default", spec(*w_shape, dtype=gen.dtype), self=gen.constant(w_shape))
        case 1 | 2:  # a dequantized int8 weight: computed, or a constant of another rank than it says
            wq = gen.input(w_shape, "int8") if gen.flip() else gen.constant((c,), "int8")
            w = gen.call(
                f"{Q}.dequantize_per_tensor.default", spec(*w_shape), **{**_qparams(gen, wq, "int8"), "zero_point": 0}
            )
        case 3:  # per tensor or per channel
            w = _dequantized_weight(gen, gen.constant(w_shape, "int8"), w_shape, False)
        case _:
            w = gen.constant(w_shape)
    out = spec(*x_shape[:-2], c, SIZE, dtype=gen.dtype) if not unbatched else spec(c, SIZE, dtype=gen.dtype)
    target = gen.pick(("aten.conv1d.default", "aten.convolution.default"))
    args = {"input": x, "weight": w, **_conv_args(gen, target, 1, False, 1)}
    if target == "aten.convolution.default":
        args["bias"], args["groups"] = None, 1
    gen.result(gen.call(target, out, **args), out)


def _sequence(gen: _Gen) -> None:
    """A new (batch, time, features) input."""
    shape = (gen.batch, 2, gen.pick((2, 4, 8)))
    gen.acts.append((gen.input(shape), spec(*shape, dtype=gen.dtype)))


def _swap(gen: _Gen) -> None:
    """(B, T, F) -> (B, F, T): a permute or a transpose (edge: their ``_copy``), as before a batch norm
    over features (Conformer's conv module); sometimes the wrong dims."""
    x, xs = gen.act([3])
    copy = "_copy" if gen.g.dialect == "edge" else ""
    b, t, f = xs.shape
    wrong = gen.flip(6)
    out = spec(b, t if wrong else f, f if wrong else t, dtype=xs.dtype)
    if gen.flip():
        gen.result(gen.call(f"aten.permute{copy}.default", out, self=x, dims=(0, 1, 2) if wrong else (0, 2, 1)), out)
    else:
        dims = (2, 2) if wrong else gen.pick(((1, 2), (2, 1), (-1, 1)))
        gen.result(gen.call(f"aten.transpose{copy}.int", out, self=x, dim0=dims[0], dim1=dims[1]), out)


def _odd_operand(gen: _Gen) -> None:
    """A conv's output times, plus or minus a number that is a graph value (a symbolic size, as
    ``aten.sym_size`` gives), as operand or as ``alpha``; or a constant of a wider dtype (the op promotes)."""
    c = gen.pick((2, 4))
    x = gen.input((gen.batch, c, SIZE, SIZE), "float16")
    out = spec(gen.batch, c, SIZE, SIZE, dtype="float16")
    y = gen.call("aten.conv2d.default", out, input=x, weight=gen.constant((c, c, 1, 1), "float16"))
    match gen.choose(3):
        case 0:
            gen.result(gen.call("aten.mul.Scalar", out, self=y, other=gen.input((), "int64")), out)
        case 1:
            alpha = gen.input((), "int64")
            gen.result(
                gen.call("aten.add.Tensor", out, self=y, other=gen.constant((c, 1, 1), "float16"), alpha=alpha), out
            )
        case _:
            wide = spec(*out.shape, dtype="float32")
            gen.result(gen.call("aten.mul.Tensor", wide, self=y, other=gen.constant((c, 1, 1), "float32")), wide)


def _idle(gen: _Gen) -> None:
    """A dropout (in eval mode or, once in four, training) or a copy of the latest value, as a model's
    ``nn.Dropout`` between a conv or linear and its batch norm is exported (edge: a copy)."""
    x, xs = gen.act([2, 3, 4, 5])
    if gen.flip():
        gen.result(gen.call("aten.clone.default", xs, self=x), xs)
        return
    gen.result(gen.call("aten.dropout.default", xs, self=x, p=0.5, train=gen.flip(4)), xs)


def _copied_operand(gen: _Gen) -> None:
    """A conv's output times a number as ``to_edge`` spells it: lifted (int64 or float32) and copied to
    the op's dtype (``_to_dim_order_copy``); sometimes the copy is read again (a graph output)."""
    c, dtype = gen.pick((2, 4)), gen.pick(("float16", "float32"))
    out = spec(gen.batch, c, SIZE, SIZE, dtype=dtype)
    x = gen.input((gen.batch, c, SIZE, SIZE), dtype)
    y = gen.call("aten.conv2d.default", out, input=x, weight=gen.constant((c, c, 1, 1), dtype))
    number = gen.constant((), gen.pick(("int64", "float32")))
    name = gen.name("copy")
    kwargs: dict[str, Arg] = {"dtype": DTypeArg(dtype), "dim_order": ()}
    k = gen.g.node("dim_order_ops._to_dim_order_copy.default", (number,), kwargs, name=name, out=spec(dtype=dtype))
    gen.read.add(number.name)
    gen.computed.append(k)
    gen.result(gen.call("aten.mul.Tensor", out, self=y, other=k), out)
    if gen.flip():
        gen.extra.append(k)


def _merging_view(gen: _Gen) -> None:
    """The latest value viewed as one dim, in aten (edge's ``view_copy`` takes any strides): a reader
    that needs the value's own strides."""
    ref, out = gen.acts[-1]
    if gen.g.dialect == "edge" or len(out.shape) < 2:
        return
    flat = math.prod(d for d in out.shape if isinstance(d, int)) if out.is_static else "s3"
    gen.result(gen.call("aten.view.default", spec(flat, dtype=out.dtype), self=ref, size=(-1,)), spec(flat))


def _strided_read(gen: _Gen) -> None:
    """The latest value read by strides (``as_strided``), sometimes through a relu first."""
    ref, out = gen.acts[-1]
    if gen.flip():
        ref = gen.call("aten.relu.default", out, self=ref)
    size = tuple(d if isinstance(d, int) else 1 for d in out.shape)
    strides = tuple(math.prod(size[i + 1 :]) for i in range(len(size)))
    read = gen.g.node("aten.as_strided.default", (ref, size, strides), name=f"strided_{len(gen.computed)}", out=size)
    gen.read.add(ref.name)
    gen.computed.append(read)
    gen.result(read, spec(*size, dtype=out.dtype))


def _empty_linear(gen: _Gen) -> None:
    """A linear of no input features, of no output features, or on an empty sequence."""
    f = gen.pick((2, 4))
    lead, i, o = gen.pick((((gen.batch,), 0, f), ((gen.batch,), f, 0), ((gen.batch, 0), f, f)))
    x = gen.input((*lead, i))
    out = spec(*lead, o, dtype=gen.dtype)
    gen.result(gen.call("aten.linear.default", out, input=x, weight=gen.constant((o, i)), bias=_bias(gen, o)), out)


def _dynamic_linear(gen: _Gen) -> None:
    """A linear whose input is quantized at run time: its scale and zero point are computed
    (``choose_qparams``, here any computed values) and read as tensors (``.tensor`` overloads)."""
    f = gen.pick((2, 4))
    x = gen.input((gen.batch, f))
    n = len(gen.computed)
    qp = gen.g.node(
        f"{Q}.choose_qparams.tensor",
        (x, -128, 127, 1e-5, DTypeArg("int8")),
        name=f"qp_{n}",
        out=(spec(1), spec(1, dtype="int64")),
    )
    scale = gen.g.getitem(qp, 0, name=f"qp_scale_{n}", out=(1,))
    zero = gen.g.getitem(qp, 1, name=f"qp_zero_{n}", out=spec(1, dtype="int64"))
    args = (scale, zero, -128, 127, DTypeArg("int8"))
    xq = gen.g.node(
        f"{Q}.quantize_per_tensor.tensor", (x, *args), name=f"dyn_q_{n}", out=spec(gen.batch, f, dtype="int8")
    )
    xd = gen.g.node(f"{Q}.dequantize_per_tensor.tensor", (xq, *args), name=f"dyn_dq_{n}", out=(gen.batch, f))
    gen.computed.extend([xq, xd])
    out = spec(gen.batch, f)
    gen.result(gen.call("aten.linear.default", out, input=xd, weight=gen.constant((f, f)), bias=_bias(gen, f)), out)


def _viewed_parallel_linears(gen: _Gen) -> None:
    """Two linears reading one new (batch, time, features) input, the second's output viewed as one dim."""
    _sequence(gen)
    gen.pin = gen.acts[-1]
    _linear(gen)
    gen.pin = gen.acts[-2]
    _linear(gen)
    gen.pin = None
    _merging_view(gen)


def _matmul_linear(gen: _Gen) -> None:
    """An aten program's ``x @ W.T``: a matmul of a transposed weight (``t``, ``transpose``,
    ``permute``), sometimes of a computed one (attention's ``q @ k.T``: no linear), or of a batch of
    constant matrices (on a rank-1 input: its product is a matrix a batch norm may read); on a rank-1, 2 or 3
    input, two of them sometimes on one input. (An edge program spells it ``mm``: the fuzzer's linear.)"""
    if gen.g.dialect == "edge":
        _linear(gen)
        return
    f, o = gen.pick((2, 4, 8)), gen.pick((2, 4, 8))
    batched = gen.flip()
    lead: tuple[int | str, ...] = () if batched or gen.flip(4) else gen.pick(((gen.batch,), (gen.batch, 2)))
    x = gen.input((*lead, f))
    # the weight's shape, its transposes (target and arguments) and the product's shape
    shapes: tuple[tuple[int, ...], tuple[int, ...], TensorSpec]
    transposes: list[tuple[str, dict[str, Arg]]]
    if batched:  # (o, o, f) transposed to (o, f, o): x (f,) @ it is (o, o)
        swap: tuple[str, dict[str, Arg]] = ("aten.transpose.int", {"dim0": -2, "dim1": -1})
        shapes, transposes = ((o, o, f), (o, f, o), spec(o, o, dtype=gen.dtype)), [swap, swap]
        transposes.append(("aten.permute.default", {"dims": (0, 2, 1)}))
    else:
        shapes = ((o, f), (f, o), spec(*lead, o, dtype=gen.dtype))
        transposes = [("aten.t.default", {}), ("aten.transpose.int", {"dim0": 0, "dim1": 1})]
        transposes.append(("aten.permute.default", {"dims": (1, 0)}))
    for _ in range(1 + gen.flip(3)):
        target, args = gen.pick(transposes)
        w = gen.constant(shapes[0]) if batched else gen.tensor(shapes[0])
        wt = gen.call(target, spec(*shapes[1], dtype=gen.dtype), self=w, **args)
        out = shapes[2]
        gen.result(gen.call("aten.matmul.default", out, self=x, other=wt), out)


def _misdeclared_weight(gen: _Gen) -> None:
    """A conv1d whose dequantized weight declares another shape than its integer constant holds (a
    pass that wrote wrong metadata): the weight expression of the conv2d's weight does not type."""
    x = gen.input((gen.batch, 2, SIZE))
    dq = gen.call(
        f"{Q}.dequantize_per_tensor.default", spec(2, 2, 1), **_qparams(gen, gen.constant((4,), "int8"), "int8")
    )
    out = spec(gen.batch, 2, SIZE, dtype=gen.dtype)
    gen.result(gen.call("aten.conv1d.default", out, input=x, weight=dq), out)


RARE: tuple[Callable[[_Gen], None], ...] = (
    _grouped,
    _grouped,
    _quantized_grouped,
    _quantized_grouped,
    _then(_odd_product, _odd_batch_norm),
    _then(_odd_product, _binary),
    _then(_odd_product, _scale),
    _then(_odd_linear, _batch_norm),
    _then(_odd_linear, _binary),
    _then(_conv, _idle, _batch_norm),
    _then(_linear, _idle, _batch_norm),
    _odd_linear,
    _shared_matmul,
    _then(_sequence, _linear, _swap, _batch_norm),
    _odd_conv1d,
    _viewed_parallel_linears,
    _then(_grouped, _strided_read),
    _odd_operand,
    _copied_operand,
    _empty_linear,
    _dynamic_linear,
    _then(_matmul_linear, _batch_norm),
    _then(_matmul_linear, _batch_norm),
    _then(_matmul_linear, _binary),
    _matmul_linear,
    _misdeclared_weight,
)


def rare_graph(choose: Callable[[int], int]) -> GraphSnapshot:
    """A random graph whose steps are the fuzzer's and the rare ones (half of them rare)."""
    return build_graph(choose, steps=STEPS + RARE * max(1, round(len(STEPS) / len(RARE))))


Source: TypeAlias = Callable[[int], GraphSnapshot]


def _sources() -> Mapping[str, Source]:
    def valid(i: int) -> GraphSnapshot:
        return build_graph(random.Random(i).randrange)

    def malformed(i: int) -> GraphSnapshot:
        rng = random.Random(10**6 + i)
        return _corrupt(rng.randrange, build_graph(rng.randrange))

    def rare(i: int) -> GraphSnapshot:
        return rare_graph(random.Random(2 * 10**6 + i).randrange)

    return {"valid": valid, "malformed": malformed, "rare": rare}


def _rules() -> Iterator[Rule]:
    for factory in RULES.values():
        yield factory()


# codes no graph can draw, with why; the adapter's codes reach the core only through plan(declined=...)
ADAPTER = {
    "module-call": "found by the adapter: an nn.Module or torch function call in a symbolic_trace graph",
    "in-subgraph": "found by the adapter: a candidate in a control-flow branch",
    "non-finite-weight": "found by the adapter: a folded weight computed with torch is inf or NaN",
    "weight-underflow": "found by the adapter: a folded float16 weight loses a channel to underflow",
    "preserved-signature": "found by the adapter: a node a preserved module call signature names",
    "op-not-allowed": "found by the adapter: a new node's op the program's verifier refuses",
    "written-between": "found by the adapter: an in-place write between a tensor's old reads and the new one",
    "dim-order-changes": "found by the adapter: a new node laid out otherwise than its input once lowered",
    "unsupported-argument": "found by the adapter: a new node's literal it cannot write into a program",
}
NO_OVERLAP = (
    "a rule's plans claim only nodes its match alone reads (shared ones are declined): never two at once;"
    " and its new convs and linears read one dtype, as its checks made them"
)
RUNS = "needs a chain of more than MAX_RUNS rewrites, each making the next (test_fold_binary_core has one)"
UNREACHABLE: Mapping[str, Mapping[str, str]] = {name: ADAPTER for name in RULES} | {
    "quantized-conv": {
        **ADAPTER,
        "plan-conflict": NO_OVERLAP,
        "bad-weight-expr": "the layouts are built from a geometry _shapes checked, the vectors _vectors checked;"
        " where the fallback's plan fails, the reason it stood in for is reported",
    },
    "fold-binary": {
        **ADAPTER,
        "wrong-op": "an operand computed by another op fails the Const alternative as deep (not-constant), which wins",
        "runs-exhausted": RUNS,
    },
    "fuse-conv-bn": {**ADAPTER, "runs-exhausted": RUNS},
    "fuse-linear-bn": {**ADAPTER, "runs-exhausted": RUNS},
    "linear-to-conv2d": {**ADAPTER, "runs-exhausted": RUNS.replace("test_fold_binary_core", "its core test")},
    "conv1d-to-conv2d": {
        **ADAPTER,
        "wrong-op": "a weight computed by another op fails the Const alternative as deep (not-constant), which wins",
    },
    "concat-parallel-linears": {
        **ADAPTER,
        "plan-conflict": NO_OVERLAP,
        "bad-weight-expr": "_fit checks every member's weight and bias shape and dtype before they are concatenated",
        "runs-exhausted": RUNS,
    },
}


def _features(snap: GraphSnapshot, p: RewritePlan) -> set[str]:
    """What tells plans of one rule apart: the ops it adds and removes, the program's dialect and
    constants (lifted or ``get_attr``), a fallback; for each conv it removes, its spatial rank,
    transposed, grouped or depthwise, with or without bias."""
    gone = (*p.erase, *(o for o, _ in p.replace), *p.prune)  # (a pruned node goes unless another reads it)
    removed = [snap.node(n) for n in dict.fromkeys(gone) if n in snap.index]
    out = {f"dialect={snap.dialect}", "lifted" if snap.lifted else "get_attr"}
    out |= {f"+{n.target}" for n in p.nodes} | {f"-{n.target}" for n in removed}
    if p.instead_of is not None:
        out.add(f"instead-of={p.instead_of.code}")
    for n in removed:
        args = CONV.bind(snap, n).value_or(None) if n.target in CONV.targets else None
        if args is None:
            continue
        x = args["input"]
        x_spec = snap.node(x.name).tensor_spec if isinstance(x, NodeRef) else None
        groups = args["groups"]
        cin = x_spec.shape[1] if x_spec is not None and len(x_spec.shape) > 1 else None
        out.add(f"rank={args['rank']}")
        out.add("transposed" if args["transposed"] else "not-transposed")
        out.add("depthwise" if groups != 1 and groups == cin else "grouped" if groups != 1 else "groups=1")
        out.add("bias" if args["bias"] is not None else "no-bias")
    return out


# what every rule's plans must show, each at least once (besides every op a plan adds or removes,
# which the counts list)
COMMON = {"dialect=aten", "dialect=edge", "lifted", "get_attr"}
CONVS = {"not-transposed", "transposed", "groups=1", "grouped", "depthwise", "bias", "no-bias"}
SHAPES: Mapping[str, set[str]] = {
    "fuse-conv-bn": COMMON | CONVS | {"rank=1", "rank=2", "rank=3"},
    "split-group-conv": COMMON
    | {"rank=1", "rank=2", "grouped", "bias", "no-bias", "+aten.slice.Tensor", "+aten.slice_copy.Tensor"},
    "quantized-conv": COMMON
    | {"rank=2", "transposed", "not-transposed", "groups=1", "grouped", "depthwise", "bias", "no-bias"}
    | {f"+et_vk.q8ta_conv2d{k}.default" for k in ("", "_pw", "_dw", "_transposed")}
    | {"-aten.relu.default", "instead-of=channel-alignment", "instead-of=no-kernel", "instead-of=asymmetric-weight"},
    "fuse-linear-bn": COMMON
    | {f"-aten.{op}.default" for op in ("linear", "addmm", "mm", "permute", "t", "view", "permute_copy", "t_copy")},
    "fold-binary": COMMON
    | CONVS
    | {f"-aten.{op}.{o}" for op in ("mul", "add", "sub", "div") for o in ("Tensor", "Scalar")}
    | {"-aten.linear.default", "-aten.addmm.default", "-aten.mm.default", "-aten.view.default"},
    "conv1d-to-conv2d": COMMON
    | {"transposed", "not-transposed", "grouped", "depthwise", "bias", "no-bias"}
    | {"+aten.conv2d.default", "+aten.conv2d.padding", "+aten.conv_transpose2d.input", "+aten.convolution.default"}
    | {"+quantized_decomposed.dequantize_per_tensor.default", "+quantized_decomposed.dequantize_per_channel.default"},
    "linear-to-conv2d": COMMON
    | {"-aten.linear.default", "-aten.addmm.default", "-aten.mm.default", "-aten.view.default"}
    | {"+aten.permute.default", "+aten.permute_copy.default", "+aten.conv2d.default", "+aten.convolution.default"},
    "concat-parallel-linears": COMMON
    | {"+aten.split_with_sizes.default", "+aten.slice.Tensor", "+aten.slice_copy.Tensor"}
    | {"-aten.linear.default", "-aten.addmm.default", "-aten.mm.default"},
}


def _codes(r: Rule) -> frozenset[str]:
    """The codes a rule says it can give (every rule in RULES says)."""
    codes = getattr(r, "codes", None)
    assert isinstance(codes, frozenset) and codes, f"{r.name} declares no codes"
    return codes


def _table(counts: Counter[tuple[str, str]], rule: str) -> str:
    return "\n".join(f"    {k:50} {n}" for (r, k), n in sorted(counts.items()) if r == rule)


def _draw(
    rules: Sequence[Rule],
    graphs: Iterable[GraphSnapshot],
    codes: Counter[tuple[str, str]],
    shapes: Counter[tuple[str, str]],
) -> None:
    """Plan each graph with each rule alone; count the codes it declined with (a fallback plan counts
    for the code it stands in for) and the features of its plans."""
    for snap in graphs:
        for r in rules:
            report = plan(snap, [r])
            codes.update((r.name, j.reason.code) for j in report.rejections)
            codes.update((r.name, p.instead_of.code) for p in report.plans if p.instead_of is not None)
            shapes.update((r.name, f) for p in report.plans for f in _features(snap, p))


def test_every_code_and_plan_shape_is_drawn() -> None:
    codes: Counter[tuple[str, str]] = Counter()
    shapes: Counter[tuple[str, str]] = Counter()
    rules = list(_rules())
    sources = _sources()
    rare = [sources["rare"](i) for i in range(GRAPHS)]
    for name, source in sources.items():
        _draw(rules, rare if name == "rare" else map(source, range(GRAPHS)), codes, shapes)
    # the policies besides the defaults: the fallback off (channel-alignment and the rest declined as
    # they are), one split instead of slices
    _draw([quantized_conv(fallback="none"), concat_parallel_linears(split=True)], rare, codes, shapes)
    missing, unreached = [], []
    for r in rules:
        own = _codes(r)
        codes.update({(r.name, c): 0 for c in own})  # listed with 0 when never drawn
        print(f"{r.name}: codes\n{_table(codes, r.name)}\n  plan features\n{_table(shapes, r.name)}")
        skip = UNREACHABLE.get(r.name, {})
        assert set(skip) <= own, f"{r.name}: {set(skip) - own} are no codes of it"
        missing += [f"{r.name}: {c}" for c in sorted(own) if c not in skip and not codes[(r.name, c)]]
        missing += [f"{r.name}: {c} (listed unreachable)" for c in sorted(skip) if codes[(r.name, c)]]
        unreached += [f"{r.name}: {f}" for f in sorted(SHAPES[r.name]) if not shapes[(r.name, f)]]
    assert not missing, f"codes never drawn: {missing}"
    assert not unreached, f"plan shapes never drawn: {unreached}"


def test_codes_found_outside_the_core_are_reported_as_given() -> None:
    """The adapter's codes (:data:`ADAPTER`) reach a report through ``plan(declined=...)``: every rule
    reports each at a candidate of a random graph, in place of its own decision."""
    for r in _rules():
        snap = next(g for g in map(_sources()["rare"], range(GRAPHS)) if any(True for _ in r.anchors(g)))
        anchor = next(iter(r.anchors(snap))).name
        for code in ADAPTER:
            why = Declined(code=code, node=anchor, detail=code)
            report = plan(snap, [r], declined={(r.name, anchor): why})
            assert [j.reason for j in report.rejections if j.node == anchor] == [why]
            assert anchor not in {p.anchor for p in report.plans}


@st.composite
def rare_graphs(draw: st.DrawFn) -> GraphSnapshot:
    """:func:`rare_graph` with hypothesis making the choices (so failures shrink)."""
    return rare_graph(lambda n: draw(_below(n)))


@settings(max_examples=2 * settings().max_examples)
@given(rare_graphs())
def test_every_rule_on_rare_graphs(snap: GraphSnapshot) -> None:
    """The fuzzer's properties (``test_every_rule_on_random_graphs``) on graphs with the rare steps."""
    check_every_rule(snap)

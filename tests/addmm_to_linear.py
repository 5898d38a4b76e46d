"""An outside author's rule, written with the public kit only: ExecuTorch's ``addmm_mm_to_linear``
(``backends/transforms/addmm_mm_to_linear.py``), ``addmm(b, x, t(W))`` -> ``linear(x, W, b)`` and
``mm(x, t(W))`` -> ``linear(x, W)``, for a backend that lowers ``linear`` rather than a matrix
product of a transpose. Better than upstream: the transpose is checked to swap the weight's two dims
(``permute(W, [0, 1])`` is no transpose: declined ``not-a-transpose``), addmm's ``beta`` and
``alpha`` are honoured (folded into a new bias and weight; a bias that is no constant cannot be
scaled so: ``bias-not-scalable``), a bias that is not one value per output is declined
(``bias-not-vector``), and every addmm or mm of a transpose ends as a plan or a typed reason. Where
the product is a linear of an input of rank > 2, flattened before it and unflattened after (edge's
spelling of ``nn.Linear`` on a sequence), the linear reads that input and the two reshapes go (the
upstream pass drops them only after a dequantize); a model's own flatten stays.

An edge program takes ``aten.linear`` only when ``to_edge`` was given it as an exception
(``EdgeCompileConfig(_core_aten_ops_exception_list=[torch.ops.aten.linear.default])``); without,
the plan is declined ``op-not-allowed`` and the program stays as it was. Tested torch-free in
``tests/core/test_addmm_to_linear_core.py`` and on real programs in ``tests/test_addmm_to_linear.py``."""

from __future__ import annotations

from fxpure.families import ADDMM, MM, PERMUTE, TRANSPOSE, TRANSPOSE_DIMS, VIEW
from fxpure.linear import linear_input, linear_of
from fxpure.pattern import ANY, Bound, Const, Match, OneOf, Op, Planner, Scalar, Var, need, rule
from fxpure.plan import RewritePlan
from fxpure.reasons import Declined, Reason
from fxpure.snapshot import NodeRef
from fxpure.weights import FLOAT_DTYPES, Binary, Cast, Fill, WeightExpr, work_dtype

NOT_TRANSPOSE, NOT_VECTOR, NOT_SCALABLE = "not-a-transpose", "bias-not-vector", "bias-not-scalable"
NO_PRODUCT = "alpha-zero"


def _transpose(w: Const | Var) -> OneOf:
    # W's transpose in every spelling (shared: tied weights keep it for their other readers); the
    # dims are read, not matched, so that an identity permute is declined saying so
    return OneOf(
        Op(PERMUTE, name="lin_t", users=ANY, self=w, dims=Var("dims")),
        Op(TRANSPOSE, name="lin_t", users=ANY, self=w),
        Op(TRANSPOSE_DIMS, name="lin_t", users=ANY, self=w, dim0=Var("dim0"), dim1=Var("dim1")),
        noun="a transpose",
    )


def _products(w: Const | Var, b: Const | Var | OneOf) -> OneOf:
    # named as fxpure.linear names a linear's nodes (lin, lin_t, lin_in, lin_out), for linear_of
    t, beta, alpha = _transpose(w), Scalar("beta"), Scalar("alpha")
    flat, out = Op(VIEW, name="lin_in", users=ANY, self=Var("x")), Op(VIEW, name="lin_out")
    return OneOf(
        # the product of a flattened input, unflattened after: first, so that it is matched whole
        Op(ADDMM, name="lin", self=b, mat1=flat, mat2=t, user=out, beta=beta, alpha=alpha),
        Op(MM, name="lin", self=flat, mat2=t, user=out),
        Op(ADDMM, name="lin", self=b, mat1=Var("x"), mat2=t, beta=beta, alpha=alpha),
        Op(MM, name="lin", self=Var("x"), mat2=t),
    )


# addmm(b, x, t(W), beta, alpha) or mm(x, t(W)), W a constant, b a constant or any tensor
PATTERN = _products(Const("w"), OneOf(Const("b"), Var("b")))
# its candidates: every addmm and mm of a transpose, of whatever (a computed weight is declined)
CANDIDATE = _products(Var("w"), Var("b"))


def _swaps(
    lin_t: Bound, dims: tuple[int, ...] | None = None, dim0: int | None = None, dim1: int | None = None
) -> Reason | None:
    # W is 2-D (need.rank): t(W) swaps its dims; a permute must be (1, 0), a transpose name both dims
    # (each in any sign)
    if dims is not None:
        swap = len(dims) == 2 and all(-2 <= d < 2 for d in dims) and [d % 2 for d in dims] == [1, 0]
    elif dim0 is not None and dim1 is not None:
        swap = min(dim0, dim1) >= -2 and max(dim0, dim1) < 2 and dim0 % 2 != dim1 % 2
    else:
        swap = True
    if swap:
        return None
    given = dims if dims is not None else (dim0, dim1)
    detail = f"{lin_t.name}: dims {given} do not swap the weight's two dims"
    return Declined(code=NOT_TRANSPOSE, node=lin_t.name, detail=detail)


def _bias(lin: Bound, match: Match, beta: float = 1, b: WeightExpr | NodeRef | None = None) -> Reason | None:
    if b is None or beta == 0:  # mm, or addmm(b, ...) with beta 0, which ignores b
        return None
    out = match.shape("w")[0]
    spec = match.spec("b")
    if spec is None or spec.shape != (out,):
        shape = spec.shape if spec is not None else "unknown"
        detail = f"{lin.name}: a bias of shape {shape}, not one per each of the {out} outputs"
        return Declined(code=NOT_VECTOR, node=lin.name, detail=detail)
    if beta != 1 and not isinstance(b, WeightExpr):
        detail = f"{lin.name}: beta={beta} scales a bias computed at run time"
        return Declined(code=NOT_SCALABLE, node=lin.name, detail=detail)
    return None


def _product(lin: Bound, alpha: float = 1) -> Reason | None:
    # addmm(b, x, Wt, alpha=0) is beta * b: torch skips the product (a NaN in x stays out), a
    # linear of a zero weight would not
    if alpha != 0:
        return None
    return Declined(code=NO_PRODUCT, node=lin.name, detail=f"{lin.name}: alpha=0, no product to write as a linear")


def _scaled(e: WeightExpr, by: float, dtype: str) -> WeightExpr:
    work = work_dtype(dtype)
    wide = e if dtype == work else Cast(x=e, dtype=work)
    product = Binary(op="mul", a=wide, b=Fill(shape=(), value=float(by), dtype=work))
    return product if dtype == work else Cast(x=product, dtype=dtype)


def _to_linear(
    p: Planner,
    x: NodeRef,
    w: WeightExpr,
    b: WeightExpr | NodeRef | None = None,
    beta: float = 1,
    alpha: float = 1,
) -> RewritePlan:
    # (a weight or bias the program holds is read as it is; a view of one, b.view(4), or a scaled
    # one becomes a new constant)
    lin, dtype = linear_of(p.match), p.match.dtype("w")
    name = lin.op.name
    weight = w if alpha == 1 else _scaled(w, alpha, dtype)
    bias = None if b is None or beta == 0 else b if beta == 1 or isinstance(b, NodeRef) else _scaled(b, beta, dtype)
    # the input: x where the reshapes around the product are the linear's own, else what it reads
    read, own = linear_input(p.match, lin)
    assert read is not None  # (x, or the flattening reshape: nodes)
    outer = lin.outer if own else lin.op  # (a model's own reshape of the output stays, and its flatten)
    new = p.call("aten.linear.default", name=f"{name}_linear", spec=outer.spec, input=read, weight=weight, bias=bias)
    return p.replace(outer, new) if own else p.finish([(outer, new)], erase=[lin.op])


addmm_to_linear = rule(
    "addmm-to-linear",
    PATTERN,
    need.static("w"),
    need.rank("w", (2,)),
    need.dtype("w", FLOAT_DTYPES),
    need.check(_swaps, codes=(NOT_TRANSPOSE,)),
    need.check(_product, codes=(NO_PRODUCT,), at="alpha"),
    need.check(_bias, codes=(NOT_VECTOR, NOT_SCALABLE), at="b"),
    plan=_to_linear,
    candidate=CANDIDATE,
)

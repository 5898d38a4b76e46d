"""An outside author's rule, written with the public kit only (``fxpure.linear``, ``fxpure.pattern``,
``fxpure.weights``): two consecutive linears, the inner one read by the outer one only, merged into
one, ``linear(linear(x, W1, b1), W2, b2)`` -> ``linear(x, W2 @ W1, W2 @ b1 + b2)``, its weight and
bias planned with ``MatMul`` and ``Binary``; no adapter code, no torch. Tested torch-free in
``tests/core/test_merge_linears_core.py`` and on real programs in ``tests/test_merge_linears.py``."""

from __future__ import annotations

from fxpure.linear import emit_linear, linear, linear_input, linear_of, linear_root
from fxpure.pattern import ANY, Bound, Const, Match, OneOf, Planner, Var, idle, need, rule
from fxpure.plan import RewritePlan
from fxpure.reasons import Declined, Reason
from fxpure.snapshot import NodeRef
from fxpure.weights import FLOAT_DTYPES, Binary, Cast, MatMul, WeightExpr, work_dtype

GROWS = "merged-weight-larger"


# linear(linear(x, W1, b1?), W2, b2?) in any spelling, the inner linear read by the outer one only
# (through an eval dropout or a copy too; a bmm's bias is the add after it)
INNER = linear("inner", weight=Const("w1"), bias=Const("b1", optional=True), bias_add=True)
PATTERN = linear_root(
    "outer", weight=Const("w2"), bias=Const("b2", optional=True), input=OneOf(INNER, *idle(INNER), noun="a linear")
)
# its candidates: a linear of a linear, whatever its weights and readers (one of an input is none:
# nothing to report), so that a computed weight, a weight stored [in, out] or a shared inner linear
# is declined, saying why
ANY_INNER = linear("inner", weight=Var("w1"), bias=Var("b1"), users=ANY, bias_add=True, weight_in_out=Var("w1_io"))
CHAIN = linear_root(
    "outer",
    weight=Var("w2"),
    bias=Var("b2"),
    input=OneOf(ANY_INNER, *idle(ANY_INNER)),
    weight_in_out=Var("w2_io"),
)


def _no_larger(outer: Bound, match: Match) -> Reason | None:
    # a bottleneck (LoRA's B @ A: 6 -> 2 -> 6) costs less as two products than as one
    (hidden, inputs), (outputs, _) = match.shape("w1"), match.shape("w2")  # (static: need.static)
    if outputs * inputs <= hidden * (inputs + outputs):
        return None
    detail = f"{outer.name}: a {outputs}x{inputs} weight is larger than {hidden}x{inputs} and {outputs}x{hidden}"
    return Declined(code=GROWS, node=outer.name, detail=detail)


def _merge(
    p: Planner, w1: WeightExpr, w2: WeightExpr, b1: WeightExpr | None = None, b2: WeightExpr | None = None
) -> RewritePlan:
    outer, inner = linear_of(p.match, "outer"), linear_of(p.match, "inner")
    # what the inner product reads: x, or the model's own flatten of it, whose rows the reshapes
    # between the two products only regroup (one that moved features would leave W2's inner size
    # another than W1's rows: the MatMul, ill-typed, declines the plan)
    x, _ = linear_input(p.match, inner)
    assert x is not None  # (the pattern matched the inner linear's input)
    dtype = p.match.dtype("w1")
    work = work_dtype(dtype)  # a float16 product accumulated in float32, and rounded once

    def wide(e: WeightExpr) -> WeightExpr:
        return e if dtype == work else Cast(x=e, dtype=work)

    def back(e: WeightExpr) -> WeightExpr:
        return e if dtype == work else Cast(x=e, dtype=dtype)

    weight = p.const(back(MatMul(a=wide(w2), b=wide(w1))), f"{outer.op.name}_merged_weight")
    bias: NodeRef | None = outer.bias  # b2 alone: read as the program holds it
    if b1 is not None:
        through = MatMul(a=wide(w2), b=wide(b1))  # b1 through W2
        both = through if b2 is None else Binary(op="add", a=through, b=wide(b2))
        bias = p.const(back(both), f"{outer.op.name}_merged_bias")
    new = emit_linear(p, outer, weight, bias, input=x, in_features=p.match.shape("w1")[1], suffix="merged")
    return p.replace(outer.outer, new)


merge_linears = rule(
    "merge-linears",
    PATTERN,
    need.static("w1"),
    need.static("w2"),
    need.rank("w1", (2,)),
    need.rank("w2", (2,)),
    need.rank("b1", (1,)),  # (addmm's self may be a matrix: no bias of a linear)
    need.rank("b2", (1,)),
    need.dtype("w1", FLOAT_DTYPES),
    need.dtype("w2", FLOAT_DTYPES),
    need.check(_no_larger, codes=(GROWS,)),
    plan=_merge,
    # a linear of a linear, shared or not (one of an input is no candidate: no decline to report)
    candidate=CHAIN,
)

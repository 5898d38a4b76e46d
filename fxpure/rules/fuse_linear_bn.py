"""fuse_linear_bn: linear -> eval batch_norm over its features  =>  linear with the batch norm folded into W, b.

A batch norm normalises dim 1; a linear writes its features in its last dim. They line up
for a ``[N, F]`` output (the linear's own, or a reshape, view or flatten of it to ``[N, F]``:
then the batch norm becomes that reshape of the new linear), or when a permute (or transpose)
puts the features at dim 1 first (``bn(linear(x).transpose(1, 2))``): then the batch norm becomes
that permute of the new linear. ``BatchNorm1d(T)`` straight on a ``[B, T, F]`` output is declined,
even when T == F, as is one on a flatten that merges the features (``[B, T * F]``).
"""

from __future__ import annotations

from returns.result import Result

from fxpure.families import ADD, CLONE, CONV, DROPOUT, FLATTEN, PERMUTE, TRANSPOSE_DIMS, VIEW
from fxpure.linear import emit_linear, is_bias_add, linear, linear_of
from fxpure.pattern import Bound, Match, OneOf, Op, PatternRule, Planner, eval_batch_norm, idle, need, rule
from fxpure.plan import RewritePlan
from fxpure.reasons import BadExpr, Declined, Malformed, Reason
from fxpure.snapshot import GraphSnapshot, NodeRef, NodeSnapshot
from fxpure.weights import FLOAT_DTYPES, WeightExpr, fold_batch_norm

NAME = "fuse-linear-bn"
NOT_LINEAR = "producer-not-linear"
LINEAR_SHARED = "linear-output-shared"
AXIS = "bn-axis-mismatch"

# the linear in any spelling (a bmm's bias add too), read by the batch norm (or the permute) only
LINEAR = linear("lin", code=NOT_LINEAR, shared=LINEAR_SHARED, bias_add=True)
# the linear, or read through a dropout in eval mode (it goes) or a copy (edge spells that dropout so:
# it stays, of the fused linear's output)
READ = OneOf(LINEAR, *idle(LINEAR, code=NOT_LINEAR, shared=LINEAR_SHARED), noun="a linear")
# the op that moves a [B, T, F] linear output to [B, F, T]: permute (edge: permute_copy) or transpose
SWAP = Op(PERMUTE | TRANSPOSE_DIMS, name="perm", code=NOT_LINEAR, shared=LINEAR_SHARED, self=READ)
# a model's flatten of a [B, T, F] linear output to [B * T, F] (BatchNorm1d over the features): a
# reshape or view (edge: view_copy), or, as an aten program keeps it, y.flatten(0, 1)
FLAT = Op(VIEW | FLATTEN, name="flat", code=NOT_LINEAR, shared=LINEAR_SHARED, self=READ)

# bn(linear(x, w, b?) | permute(linear(x, w, b?)) | flatten(...), gamma?, beta?, mean, var,
# training=False)[0], the linear read directly or through a dropout or copy
PATTERN = eval_batch_norm(OneOf(*READ.alternatives, SWAP, FLAT, noun="a linear (or a permute or flatten of one)"))


def _source_dim(perm: Bound, rank: int) -> int | None:
    """The dim of the permute's input that lands at dim 1 of its output (None: not a permutation of it)."""
    dims = perm.args.get("dims")
    if dims is None:  # transpose(dim0, dim1)
        a, b = perm.int("dim0") % rank, perm.int("dim1") % rank
        return b if a == 1 else a if b == 1 else 1
    picked = [d % rank for d in dims if isinstance(d, int)] if isinstance(dims, tuple) else []
    return picked[1] if sorted(picked) == list(range(rank)) and rank > 1 else None


def _dim(flat: Bound, arg: str, rank: int) -> str:
    """A flatten's dim ``arg`` as a dim of its input (a negative one counted from the end)."""
    dim = flat.args.get(arg)
    return str(dim % rank if isinstance(dim, int) and not isinstance(dim, bool) and rank > 0 else dim)


def _axes(bn: Bound, match: Match, perm: Bound | None = None, flat: Bound | None = None) -> Reason | None:
    """The batch norm's channel dim (1) is the linear's feature dim (its last): directly, through a
    permute, or through a reshape, view or flatten to [N, F] (a row-major reshape whose last size is
    the features' keeps each row one output's features, whatever dims it merges: read off its output
    shape, for a flatten's dims as for a view's sizes)."""
    spec = linear_of(match).spec
    if spec is None or not spec.shape:
        return Malformed(node=bn.name, detail="the linear's output has no known shape")
    if flat is not None:
        shape = flat.spec.shape if flat.spec is not None else None
        if shape is not None and len(shape) == 2 and shape[-1] == spec.shape[-1] and isinstance(shape[-1], int):
            return None
        detail = f"{bn.name} normalises dim 1 of {flat.name} {shape}, a reshape of the linear's output {spec.shape}"
        if flat.node.target in FLATTEN.targets:  # which dims it merges, by schema name
            merged = (_dim(flat, arg, len(spec.shape)) for arg in ("start_dim", "end_dim"))
            detail += " (its dims {} to {} merged)".format(*merged)
        return Declined(code=AXIS, node=bn.name, detail=f"{detail}: not its features", path=match.sites["flat"].path)
    rank = len(spec.shape)
    source = 1 if perm is None else _source_dim(perm, rank)
    if source is None and perm is not None:
        detail = f"{perm.args.get('dims')} is not a permutation of {rank} dims"
        return Malformed(node=perm.name, detail=detail, path=match.sites["perm"].path)
    if source == rank - 1:
        return None
    via = "" if perm is None else f" (through {perm.name})"
    detail = (
        f"{bn.name} normalises dim {source} of the linear's output {spec.shape}{via}, "
        f"but the linear's features are its last dim ({rank - 1})"
    )
    return Declined(code=AXIS, node=bn.name, detail=detail, path=match.sites["perm" if perm else "bn"].path)


def read_by(bn: Bound, snap: GraphSnapshot) -> NodeSnapshot | None:
    """What the batch norm ``bn`` normalises, looked at through the ops this rule's pattern reads a
    linear through (a permute, reshape, flatten, dropout or copy; a few at most): the node that
    computes it, None for no node (an input, a constant)."""
    x = bn.args.get("input")
    for _ in range(3):
        node = snap.node(x.name) if isinstance(x, NodeRef) and x.name in snap.index else None
        if node is None or node.target not in _BETWEEN or not node.args:
            return node
        x = node.args[0]
    return None


def _candidate(bn: Bound, snap: GraphSnapshot) -> bool:
    """Every batch norm but one of a conv (``fuse-conv-bn``'s to fuse or decline), or of an add (read
    directly or through what the pattern takes) that is no linear's bias (:func:`fxpure.linear.is_bias_add`):
    such an add is no linear, and its near miss as a bias add would read as if it were one."""
    node = read_by(bn, snap)
    return node is None or not (
        node.target in CONV.targets or (node.target in ADD.targets and not is_bias_add(snap, node))
    )


def _plan(
    p: Planner,
    bn: Bound,
    w: WeightExpr,
    mean: WeightExpr,
    var: WeightExpr,
    gamma: WeightExpr | None,
    beta: WeightExpr | None,
    b: WeightExpr | None = None,
    perm: Bound | None = None,
    flat: Bound | None = None,
) -> Result[RewritePlan, BadExpr]:
    # linear(x, W * s, (b - mean) * s + beta) [-> the same permute]; mm becomes addmm
    lin = linear_of(p.match)
    base = lin.op.name
    folded = fold_batch_norm(weight=w, bias=b, mean=mean, var=var, gamma=gamma, beta=beta, eps=bn.float("eps"))

    def emit(wb: tuple[WeightExpr, WeightExpr]) -> RewritePlan:
        weight, bias = p.const(wb[0], f"{base}_bn_weight"), p.const(wb[1], f"{base}_bn_bias")
        new = p.copied(emit_linear(p, lin, weight, bias, suffix="bn"), "bn")  # (the copy reads the linear)
        if perm is not None:
            new = p.respell(perm, name=f"{perm.name}_bn", self=new)
        if flat is not None:
            new = p.respell(flat, name=f"{flat.name}_bn", self=new)
        return p.replace(bn, new)

    return folded.map(emit)


_BETWEEN = SWAP.family.targets | FLAT.family.targets | DROPOUT.targets | CLONE.targets

FUSE_LINEAR_BN = rule(
    NAME,
    PATTERN,
    need.check(_axes, codes=(AXIS, "malformed-node")),
    need.static("w"),
    need.rank("w", (2,)),  # (x @ W.T of a batch of matrices is no linear)
    need.dtype("w", FLOAT_DTYPES),
    need.channels("mean", of="w"),
    plan=_plan,
    candidate=_candidate,
    repeat=True,  # a batch norm after a fused one (conv, bn, bn) fuses in the next run
)


def fuse_linear_bn() -> PatternRule:
    """The linear + batch-norm fusion rule: every eval batch norm over a linear's features folded into it.

    >>> from fxpure.reasons import GENERIC_CODES
    >>> sorted(fuse_linear_bn().codes - GENERIC_CODES)
    ['arg-mismatch', 'bn-axis-mismatch', 'bn-stats-used', 'bn-training-mode', 'channel-mismatch', \
'linear-output-shared', 'not-constant', 'producer-not-linear', 'runs-exhausted', 'symbolic-shape', \
'unsupported-dtype', 'unsupported-rank']
    """
    return FUSE_LINEAR_BN

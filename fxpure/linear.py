"""A linear layer in every spelling export produces, as one pattern, and re-emitting it.

``torch.export`` keeps ``aten.linear``; ``to_edge`` turns it into ``permute_copy(W)`` feeding
``addmm(b, x, ·)`` (or ``mm`` without bias), wrapped in ``view_copy`` reshapes when the input
has more than two dims, or, when that input is not contiguous, into ``bmm`` of the input and the
weight's transpose broadcast over the batch, the bias added after; a backend that preserves
``linear`` keeps it in edge too. ``x @ W.T``
stays ``matmul`` of a transpose in an aten program. Rules match all of them with :func:`linear`
and write the result back, in the same spelling (a ``matmul`` as ``linear``), with
:func:`emit_linear`; :func:`is_linear` tells which products can be linears at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

from returns.result import Success

from fxpure.families import (
    ADD,
    ADDMM,
    BMM,
    EXPAND,
    LINEAR,
    MATMUL,
    MM,
    PERMUTE,
    TRANSPOSE,
    TRANSPOSE_DIMS,
    VIEW,
    family,
)
from fxpure.pattern import ANY, ONE, Bound, Const, Lit, Match, OneOf, Op, Pattern, Planner, Users, Var, When, match
from fxpure.plan import MAX_DEPTH, constant_expr
from fxpure.schema import parse_schema
from fxpure.snapshot import GraphSnapshot, NodeRef, NodeSnapshot, TensorSpec, ref_list

# a 2-D weight's transpose in every spelling: t, W.T (numpy_T), W.mT, W.mH and W.adjoint() of a real
# weight, permute by (1, 0) or negative dims, transpose(0, 1) or movedim(0, 1) in either order or
# with negative dims (a swap of a weight's two dims: each rule checks its weight is 2-D)
MATRIX_T = family(
    "matrix_t",
    "a transpose",
    [f"aten.{op}.default(Tensor self) -> Tensor" for op in ("numpy_T", "mT", "mH", "adjoint")],
)
MOVEDIM = family(
    "movedim",
    "a transpose",
    [
        parse_schema(
            "aten.movedim.int(Tensor self, int source, int destination) -> Tensor",
            rename={"source": "dim0", "destination": "dim1"},
        )
    ],
)
_SWAPS = ((0, 1), (1, 0), (-2, -1), (-1, -2), (0, -1), (-1, 0), (-2, 1), (1, -2))
# the conjugate transposes are transposes of a real matrix only (of a complex one they also conjugate)
_CONJUGATES = frozenset({"aten.mH.default", "aten.adjoint.default"})


def _real(snap: GraphSnapshot, node: NodeSnapshot) -> bool:
    return node.target not in _CONJUGATES or (
        node.tensor_spec is not None and not node.tensor_spec.dtype.startswith("complex")
    )


_REAL = When(_real, "of a real matrix")


def _of_weight(snap: GraphSnapshot, node: NodeSnapshot) -> bool:
    return _is_linear(snap, node, True, MAX_DEPTH + 1)


def _parts(
    name: str,
    input: Pattern | None,
    weight: Pattern | None,
    bias: Pattern | None,
    code: str,
    shared: str,
    weight_in_out: Pattern | None = None,
) -> tuple[Pattern, Pattern, Pattern, OneOf, Op]:
    x = input if input is not None else Var("x")
    w = weight if weight is not None else Const("w")
    b = bias if bias is not None else Const("b", optional=True)
    # the transpose may be shared (tied weights, ``wt = W.T`` read twice): a plan leaves it to its other readers
    t = OneOf(
        Op(
            PERMUTE,
            name=f"{name}_t",
            users=ANY,
            code=code,
            shared=shared,
            self=w,
            dims=Lit((1, 0), (-1, -2), (1, -2), (-1, 0)),
        ),
        Op(TRANSPOSE | MATRIX_T, name=f"{name}_t", users=ANY, code=code, shared=shared, when=_REAL, self=w),
        *(
            Op(
                TRANSPOSE_DIMS | MOVEDIM,
                name=f"{name}_t",
                users=ANY,
                code=code,
                shared=shared,
                self=w,
                dim0=Lit(a),
                dim1=Lit(b),
            )
            for a, b in _SWAPS
        ),
        # (the weight stored (in, out), read as it is: GPT-2's Conv1D, ``x @ W``)
        *([weight_in_out] if weight_in_out is not None else []),
    )
    flat = Op(VIEW, name=f"{name}_in", users=ANY, code=code, self=x)
    return x, w, b, t, flat


# a weight's transpose in any spelling, what it reads bound as ``w`` (what is_linear looks for)
_WEIGHT_TRANSPOSE = _parts("w", None, Var("w"), None, "wrong-op", "output-shared")[3]


def _products(
    name: str, x: Pattern, b: Pattern, t: OneOf, users: Users, code: str, shared: str, user: Op | None = None
) -> tuple[Op, Op]:
    one = Lit(1, 1.0)
    addmm = Op(
        ADDMM, name=name, users=users, code=code, shared=shared, user=user, self=b, mat1=x, mat2=t, beta=one, alpha=one
    )
    return addmm, Op(MM, name=name, users=users, code=code, shared=shared, user=user, self=x, mat2=t)


def _bmm(
    name: str,
    x: Pattern,
    t: OneOf,
    code: str,
    shared: str,
    user: Op | None = None,
    when: When | None = None,
) -> Op:
    """``bmm(x, view(expand(W.T)))``: the weight's transpose broadcast over the batch, as
    decompositions and ``to_edge`` spell a linear on an input that is not contiguous (the input's
    own expand and view stay the ``x`` it reads)."""
    # (shared like the transpose: a plan leaves them to their other readers)
    expand = Op(EXPAND, name=f"{name}_te", users=ANY, code=code, shared=shared, self=t)
    return Op(
        BMM,
        name=name,
        code=code,
        shared=shared,
        user=user,
        when=when,
        self=x,
        mat2=Op(VIEW, name=f"{name}_tv", users=ANY, code=code, shared=shared, self=expand),
    )


def linear(
    name: str = "lin",
    *,
    input: Pattern | None = None,
    weight: Pattern | None = None,
    bias: Pattern | None = None,
    users: Users = ONE,
    code: str = "wrong-op",
    shared: str = "output-shared",
    bias_add: bool = False,
    weight_in_out: Pattern | None = None,
) -> OneOf:
    """``y = x @ W.T + b`` in any spelling, as the operand of another op. Binds the product as
    ``name`` (``linear``, ``addmm``, ``mm``, ``matmul`` or ``bmm``), the weight transpose as ``{name}_t`` and the
    reshapes around a rank > 2 product as ``{name}_in`` / ``{name}_out`` where the spelling has
    them; by default the input as ``x``, the weight (out, in) as ``w``, the bias as ``b`` (None,
    or unbound for ``mm``, ``matmul`` and a ``bmm`` no add follows; ``addmm``'s ``self``, which may
    be a matrix: check its shape before writing an ``aten.linear``). A ``matmul`` reads a batch of
    matrices where ``W`` has more than two dims: check ``w``'s rank where :func:`is_linear` has not
    chosen the product. A ``bmm`` (a linear on an input that is not contiguous, after
    decompositions and on edge) reads ``x``, a batch of matrices, and the weight's transpose
    broadcast as ``view(expand(W.T))``, bound as ``{name}_tv`` and ``{name}_te``. ``bias_add``:
    also the add of a constant after a ``bmm``'s reshape, its bias (:func:`is_bias_add`), bound as
    ``{name}_bias``, for a rule whose candidates read a linear (:func:`is_linear`, or such an add):
    where every add can meet the pattern (a batch norm's input, say) its near misses would read as
    if an add were a linear. ``weight_in_out``: a pattern for a weight stored (in, out) that
    ``addmm``, ``mm``, ``matmul`` and ``bmm`` read as it is, with no transpose (GPT-2's ``Conv1D``,
    ``addmm(b, x, W)``; ``x @ W``); where it matches, ``weight`` and ``{name}_t`` are unbound (and
    :attr:`Linear.in_out` is true). Use :func:`linear_root` to anchor a rule at the linear itself.

    >>> [a.family.name for a in linear().alternatives]
    ['linear', 'addmm', 'mm', 'matmul', 'view', 'view', 'view']
    >>> [a.family.name for a in linear(bias_add=True).alternatives][-2:]
    ['add', 'view']
    """
    x, w, b, t, flat = _parts(name, input, weight, bias, code, shared, weight_in_out)
    addmm, mm = _products(name, x, b, t, users, code, shared)
    addmm_nd, mm_nd = _products(name, flat, b, t, ONE, code, shared)
    # a matmul or bmm of two activations (attention's q @ k.T) or of a batch of matrices is no
    # linear: a wrong op. One of a weight computed further up than is_linear looks, or of one
    # stored (in, out), is, here: its weight pattern says whether it takes that weight, and why not
    of_weight = When(_of_weight, "of a weight")

    def bmm(users: Users) -> Op:
        product = _bmm(name, x, t, code, shared, when=of_weight)
        return Op(VIEW, name=f"{name}_out", users=users, code=code, shared=shared, self=product)

    # bmm has no bias: the add of one after it is the linear's
    added = Op(
        ADD, name=f"{name}_bias", users=users, code=code, shared=shared, self=bmm(ONE), other=b, alpha=Lit(1, 1.0)
    )
    return OneOf(
        Op(LINEAR, name=name, users=users, code=code, shared=shared, input=x, weight=w, bias=b),
        addmm,
        mm,
        Op(MATMUL, name=name, users=users, code=code, shared=shared, when=of_weight, self=x, other=t),
        Op(VIEW, name=f"{name}_out", users=users, code=code, shared=shared, self=addmm_nd),
        Op(VIEW, name=f"{name}_out", users=users, code=code, shared=shared, self=mm_nd),
        *([added] if bias_add else []),
        bmm(users),
        noun="a linear",  # (whatever spelling: one noun, not the seven ops)
    )


def linear_root(
    name: str = "lin",
    *,
    input: Pattern | None = None,
    weight: Pattern | None = None,
    bias: Pattern | None = None,
    code: str = "wrong-op",
    shared: str = "output-shared",
    weight_in_out: Pattern | None = None,
) -> OneOf:
    """The same linear as :func:`linear`, anchored at its product (``linear``, ``addmm``, ``mm``,
    ``matmul`` or ``bmm``): the reshape after a rank > 2 product is matched as its one user,
    ``{name}_out``; a ``bmm``'s bias, added after that, is not matched (nor bound). A rule anchored
    here takes :func:`is_linear` as its ``candidate`` (with ``in_out=True`` where it gives
    ``weight_in_out``)."""
    x, w, b, t, flat = _parts(name, input, weight, bias, code, shared, weight_in_out)
    out = Op(VIEW, name=f"{name}_out", code=code, shared=shared)
    addmm_nd, mm_nd = _products(name, flat, b, t, ONE, code, shared, user=out)
    addmm, mm = _products(name, x, b, t, ONE, code, shared)
    return OneOf(
        Op(LINEAR, name=name, code=code, shared=shared, input=x, weight=w, bias=b),
        addmm_nd,
        mm_nd,
        addmm,
        mm,
        Op(MATMUL, name=name, code=code, shared=shared, self=x, other=t),
        _bmm(name, x, t, code, shared, user=out),
    )


def is_linear(snap: GraphSnapshot, node: NodeSnapshot, *, in_out: bool = False) -> bool:
    """Whether the product ``node`` may be a linear's: every ``linear``, ``addmm`` and ``mm`` (a
    rule says why one is not) but a weight's computation (a merged LoRA's ``B @ A``:
    :func:`is_weight_product`), and a ``matmul`` only where it reads a transpose (two dims
    swapped) of a 2-D weight, ``x @ W.T``: a weight being a value computed from constants alone
    (a parameter, a dequantized one, a slice of one; a rule says if it cannot take it). A
    ``matmul`` of two activations (attention's ``q @ k.T``) or of a batch of matrices is no
    linear: no candidate, and a wrong op to :func:`linear` (``When``).
    ``rule(candidate=lambda root, snap: is_linear(snap, root.node))`` for a rule anchored at
    :func:`linear_root`. ``in_out``: a weight stored (in, out) counts too, read
    as it is (``x @ W``, a 2-D weight computed from constants), for a rule whose pattern takes one
    (``weight_in_out``).

    >>> from fxpure.testing import GraphBuilder
    >>> g = GraphBuilder()
    >>> x, k, w = g.input("x", (2, 3, 8)), g.input("k", (2, 4, 8)), g.parameter("w", (5, 8))
    >>> lin = g.call("aten.matmul.default", name="lin", self=x, other=g.call("aten.t.default", self=w, out=(8, 5)),
    ...              out=(2, 3, 5))
    >>> kt = g.call("aten.transpose.int", self=k, dim0=-2, dim1=-1, out=(2, 8, 4))
    >>> g.output(g.call("aten.matmul.default", name="qk", self=x, other=kt, out=(2, 3, 4)), lin)
    >>> snap = g.build()
    >>> is_linear(snap, snap.node("lin")), is_linear(snap, snap.node("qk"))
    (True, False)
    """
    return _is_linear(snap, node, in_out, 9)


def _is_linear(snap: GraphSnapshot, node: NodeSnapshot, in_out: bool, most: int) -> bool:
    """``is_linear``, its weight computed from constants by at most ``most`` nodes (with the transpose)."""
    # (is_weight_product asked last: its walk up from the first operand costs more than the look at a
    # matmul's second, which is no 2-D weight's transpose on most, attention's q @ k.T)
    if node.target in _BMMS:  # (no weight product)
        return _broadcast_weight(snap, node, in_out, most) is not None
    if node.target not in _MATMULS:
        return node.target in _PRODUCTS and not is_weight_product(snap, node)
    other = _node(snap, MATMUL.bind(snap, node).map(lambda a: a.get("other")).value_or(None))
    return _is_weight_t(snap, other, in_out, most) and not is_weight_product(snap, node)


def is_weight_product(snap: GraphSnapshot, node: NodeSnapshot) -> bool:
    """Whether ``node`` is an ``mm`` or ``matmul`` of two constants, the second no weight's
    transpose: a weight's computation (a merged LoRA's ``B @ A``), no linear. (A linear of a
    constant input, a learned query's ``q @ W.T``, stays one.)"""
    if node.target not in _CONSTANT_PRODUCTS:
        return False
    first = _node(snap, node.arg(0, "self"))
    second = _node(snap, node.arg(1, "mat2" if node.target in MM.targets else "other"))
    return (
        first is not None
        and second is not None
        and _of_constants(snap, first.name, most=3)  # (asked first: an activation reaches an input, or 3 nodes, soon)
        and not _is_weight_t(snap, second, False, MAX_DEPTH + 1)
        and constant_expr(snap, node.name) is not None
    )


def _node(snap: GraphSnapshot, arg: object) -> NodeSnapshot | None:
    """The node ``arg`` refers to, if it is a reference to one of ``snap``."""
    return snap.node(arg.name) if isinstance(arg, NodeRef) and arg.name in snap.index else None


def is_bias_add(snap: GraphSnapshot, node: NodeSnapshot) -> bool:
    """Whether ``node`` adds a constant to a ``bmm`` linear's output (its reshape): the linear's bias
    in that spelling, part of the linear as ``addmm``'s ``self`` is (:func:`linear` with ``bias_add`` matches it so):
    a rule that folds a shift on a linear's output into its bias takes no such add for one."""
    if node.target not in ADD.targets or node.kwargs.get("alpha", 1) != 1 or len(node.args) != 2:
        return False
    view, bias = (_node(snap, a) for a in node.args)
    bmm = _node(snap, view.args[0]) if view is not None and view.target in VIEW.targets and view.args else None
    if bmm is None or bmm.target not in _BMMS or bias is None:  # (asked first: the walk up from the bias costs)
        return False
    # (an add that promotes, a float16 output plus a float32 constant, is no bias of the float16 linear)
    same = (
        view is not None
        and view.tensor_spec is not None
        and view.tensor_spec.dtype == getattr(node.tensor_spec, "dtype", None)
    )
    return same and _of_constants(snap, bias.name) and is_linear(snap, bmm)


def _broadcast_weight(snap: GraphSnapshot, bmm: NodeSnapshot, in_out: bool, most: int) -> NodeSnapshot | None:
    """The transpose of a 2-D weight that ``bmm`` reads broadcast over its batch, ``view(expand(W.T))``
    with the matrix's sizes kept (``in_out``: or the weight itself, stored (in, out)), else None."""
    view = _node(snap, BMM.bind(snap, bmm).map(lambda a: a.get("mat2")).value_or(None))
    expand = _node(snap, view.args[0]) if view is not None and view.target in VIEW.targets and view.args else None
    t = _node(snap, expand.args[0]) if expand is not None and expand.target in EXPAND.targets and expand.args else None
    if t is None or view is None or expand is None or not _is_weight_t(snap, t, in_out, most):
        return None
    sizes = [n.tensor_spec.shape[-2:] if n.tensor_spec is not None else None for n in (t, expand, view)]
    return t if sizes[0] is not None and sizes[0] == sizes[1] == sizes[2] else None


def _is_weight_t(snap: GraphSnapshot, t: NodeSnapshot | None, in_out: bool, most: int) -> bool:
    """``t`` is the transpose of a 2-D weight computed from constants alone (``in_out``: or any 2-D
    value computed from constants, a weight stored (in, out)), by at most ``most`` nodes."""
    # a 2-D result (cheapest, asked first: attention's k.T is 4-D), computed from constants by at most 8
    # nodes besides the transpose, which reads the weight alone (attention's k.T reaches an input soon)
    if t is None or (t.tensor_spec is not None and len(t.tensor_spec.shape) != 2):
        return False
    if not _of_constants(snap, t.name, most=most):
        return False
    if in_out and t.tensor_spec is not None:  # a 2-D constant (without a known shape, a transpose below)
        return True
    # the transpose as linear() matches it, each spelling and its dims in one place
    found = match(_WEIGHT_TRANSPOSE, snap, t)
    w = found.unwrap().bindings.get("w") if isinstance(found, Success) else None
    if not isinstance(w, NodeRef) or w.name not in snap.index:
        return False
    spec = snap.node(w.name).tensor_spec
    return spec is not None and len(spec.shape) == 2


_PRODUCTS, _MATMULS, _BMMS = LINEAR.targets | ADDMM.targets | MM.targets, MATMUL.targets, BMM.targets
_CONSTANT_PRODUCTS = MM.targets | MATMUL.targets  # (the products constant_expr reads)


def _of_constants(snap: GraphSnapshot, name: str, most: int = 8) -> bool:
    """``name`` is computed from constants alone, by at most ``most`` nodes (a weight's
    dequantize, slice or cast; an activation reaches an input, or more nodes, soon)."""
    todo, seen, constants = [name], set(), snap.constant_names
    while todo:
        at = todo.pop()
        if at in seen or at in constants:
            continue
        seen.add(at)
        node = snap.node(at)
        if node.op != "call_function" or len(seen) > most:
            return False
        todo.extend(ref_list(node))
    return True


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class Linear:
    """The nodes of one matched linear: the product (``linear``, ``addmm``, ``mm``, ``matmul`` or
    ``bmm``), the weight transpose and the reshapes where the spelling has them; for ``bmm``, the
    transpose's expand and view (``t_expand``, ``t_view``) and the add of the bias after it, if
    any (``bias_add``). ``outer`` carries the result."""

    op: Bound
    t: Bound | None
    view_in: Bound | None
    view_out: Bound | None
    t_expand: Bound | None = None
    t_view: Bound | None = None
    bias_add: Bound | None = None

    @property
    def outer(self) -> Bound:
        """The node whose value is the linear's output."""
        return self.bias_add or self.view_out or self.op

    @property
    def spec(self) -> TensorSpec | None:
        """The linear's output spec."""
        return self.outer.spec

    @property
    def in_out(self) -> bool:
        """The product reads its weight stored (in, out) as it is (a pattern's ``weight_in_out``):
        no node holds the weight (out, in)."""
        return self.t is None and self.op.node.target not in LINEAR.targets

    @property
    def weight(self) -> NodeRef:
        """The weight node (out, in): what the transpose reads where the spelling has one. A
        planner that keeps it passes it to :func:`emit_linear`. ValueError for a weight stored
        (in, out) (:attr:`in_out`): give :func:`emit_linear` a new constant, the transpose of it."""
        if self.in_out:
            raise ValueError(f"{self.op.name} reads its weight stored (in, out): no node holds it (out, in)")
        return self.t.ref("self") if self.t is not None else self.op.ref("weight")

    @property
    def operand(self) -> NodeRef | None:
        """The value the product itself multiplies by the weight: ``linear``'s ``input``, ``addmm``'s
        ``mat1``, the ``self`` of ``mm``, ``matmul`` and ``bmm``; on edge, for a rank > 2 input, the
        flattening reshape (:attr:`view_in`). None where it is no node. :func:`linear_input` says
        what the linear reads before such a reshape."""
        arg = self.op.args.get(_INPUT.get(self.op.node.target, "self"))
        return arg if isinstance(arg, NodeRef) else None

    @property
    def bias(self) -> NodeRef | None:
        """The node the linear adds as its bias: ``linear``'s ``bias``, ``addmm``'s ``self``, the
        constant added after a ``bmm`` (:attr:`bias_add`); None where it adds none (``mm``, a
        ``matmul``, a linear without one). An ``addmm``'s ``self`` may be a matrix: check its shape
        before writing it as an ``aten.linear``'s bias."""
        if self.bias_add is not None:
            return self.bias_add.ref("other")
        b = self.op.args.get("self" if self.op.node.target in ADDMM.targets else "bias")
        return b if isinstance(b, NodeRef) else None

    def stored_spec(self, snap: GraphSnapshot) -> TensorSpec | None:
        """The spec of the weight as the product reads it, (in, out): the transpose's, or the
        weight's where it is stored so."""
        if self.t is not None:
            return self.t.spec
        read = (
            self.t_expand.args["self"]
            if self.t_expand is not None
            else self.op.args.get("mat2", self.op.args.get("other"))
        )
        return snap.node(read.name).tensor_spec if isinstance(read, NodeRef) and read.name in snap.index else None


def linear_of(m: Match, name: str = "lin") -> Linear:
    """The linear a :func:`linear` pattern called ``name`` bound in ``m``."""

    def get(key: str) -> Bound | None:
        value = m.bindings.get(key)
        return value if isinstance(value, Bound) else None

    op = get(name)
    if op is None:
        raise KeyError(f"the match binds no linear called {name!r}")
    return Linear(
        op=op,
        t=get(f"{name}_t"),
        view_in=get(f"{name}_in"),
        view_out=get(f"{name}_out"),
        t_expand=get(f"{name}_te"),
        t_view=get(f"{name}_tv"),
        bias_add=get(f"{name}_bias"),
    )


def linear_input(m: Match, lin: Linear) -> tuple[NodeRef | None, bool]:
    """What the linear ``lin`` that ``m`` bound reads, and whether the reshapes around a flattened
    product (``{name}_in``, ``{name}_out``: edge, rank > 2) are the linear's own, ``[*lead, I] ->
    [M, I]`` before and ``[M, O] -> [*lead, O]`` after. When they are not (a model's own flatten,
    ``fc(x.reshape(-1, 8)).reshape(-1, 2, 5)``), the product is a rank-2 linear on the flattened
    input, which is returned, with False: ``{name}_out`` is then the model's reshape of the
    linear's output, and the pattern's ``x`` not the linear's input. A ``bmm`` is a linear on what
    it reads, a batch of matrices: its ``{name}_out`` is the linear's own where it keeps the shape,
    else (an input of rank 4 or more, whose leading dims the batch merges) a reshape of the
    linear's output, and False. None for an input that is no node.

    >>> from fxpure.pattern import match
    >>> from fxpure.testing import GraphBuilder
    >>> g = GraphBuilder()
    >>> x, w = g.input("x", (4, 6, 8)), g.parameter("w", (5, 8))
    >>> flat = g.call("aten.view_copy.default", self=x, size=(24, 8), out=(24, 8))
    >>> t = g.call("aten.permute_copy.default", self=w, dims=(1, 0), out=(8, 5))
    >>> mm = g.call("aten.mm.default", name="mm", self=flat, mat2=t, out=(24, 5))
    >>> g.output(g.call("aten.view_copy.default", self=mm, size=(12, 2, 5), out=(12, 2, 5)))
    >>> snap = g.build()
    >>> m = match(linear_root(), snap, snap.node("mm")).unwrap()
    >>> m.bindings["x"], linear_input(m, linear_of(m)), linear_of(m).operand
    (NodeRef(name='x'), (NodeRef(name='view_copy'), False), NodeRef(name='view_copy'))
    """
    flat, out, product = lin.view_in, lin.view_out, lin.op
    # the product's input: linear's input, addmm's mat1 (its self is the bias), mm's self
    keys = ("self",) if flat is not None else ("input", "mat1", "self")
    bound = next(((flat or product).args[k] for k in keys if k in (flat or product).args), None)
    ref = bound if isinstance(bound, NodeRef) else None
    if lin.t_view is not None:  # bmm
        shapes = [v.spec.shape if v is not None and v.spec is not None else None for v in (out, product)]
        return ref, out is None or (shapes[0] is not None and shapes[0] == shapes[1])
    if flat is None or out is None:
        return ref, True
    x = m.snap.node(ref.name).tensor_spec if ref is not None and ref.name in m.snap.index else None
    own = (
        x is not None
        and flat.spec is not None
        and out.spec is not None
        and product.spec is not None
        and x.shape[-1:] == flat.spec.shape[-1:]
        and out.spec.shape == (*x.shape[:-1], product.spec.shape[-1])
    )
    return (ref, True) if own else (NodeRef(flat.name), False)


def _features(spec: TensorSpec | None, n: int | None) -> TensorSpec | None:
    if spec is None or n is None:
        return spec
    return TensorSpec(shape=(*spec.shape[:-1], n), dtype=spec.dtype)


def _check_width(p: Planner, lin: Linear, input: NodeRef | None, in_features: int | None) -> None:
    """Decline the plan (``malformed-node``) for an ``input`` of ``emit_linear`` whose last size is
    not the one the new nodes are declared with: that of the value it stands for (the flattening
    reshape's input, else the product's), or ``in_features``; and for ``in_features`` with a
    reshape that merges dims (a model's own flatten, which it cannot re-size)."""
    if input is None or input.name not in p.match.snap.index:
        return
    snap, op = p.match.snap, lin.op
    read = lin.view_in.args["self"] if lin.view_in is not None else op.args[_INPUT.get(op.node.target, "self")]
    old = snap.node(read.name).tensor_spec if isinstance(read, NodeRef) and read.name in snap.index else None
    given = snap.node(input.name).tensor_spec
    if old is None or given is None or not old.shape or not given.shape:
        return
    view = lin.view_in
    if in_features is not None and view is not None and view.spec and view.spec.shape[-1:] != old.shape[-1:]:
        p._refuse(
            f"emit_linear of {op.name}: in_features with {view.name}, a reshape that merges dims (the "
            "model's own): re-spell it in the rule"
        )
        return
    want = old.shape[-1] if in_features is None else in_features
    if given.shape[-1] != want:
        p._refuse(
            f"emit_linear of {op.name}: input {input.name} has {given.shape[-1]} features, and the new "
            f"linear is declared with {want} (pass in_features={given.shape[-1]})"
        )


_INPUT = {"aten.linear.default": "input", "aten.addmm.default": "mat1"}


def _emit_bmm(
    p: Planner, lin: Linear, weight: NodeRef, bias: NodeRef | None, out_features: int | None, suffix: str
) -> NodeRef:
    """``emit_linear`` of a ``bmm``: the new weight's transpose broadcast as the old one was, the
    product, its reshape, and the bias added after it (a new ``add`` where there was none)."""
    assert lin.t_expand is not None and lin.t_view is not None  # (emit_linear asked)

    def sized(node: Bound, source: NodeRef) -> NodeRef:
        # ``node`` (a view or expand) on ``source``, its last size out_features
        size, spec = node.args["size"], _features(node.spec, out_features)
        if out_features is not None and isinstance(size, tuple):
            size = (*size[:-1], out_features)
        return p.respell(node, name=f"{node.name}_{suffix}", spec=spec, self=source, size=size)

    op = lin.op
    new_t = _transposed(p, lin, weight, _features(lin.stored_spec(p.match.snap), out_features), suffix)
    mat2 = sized(lin.t_view, sized(lin.t_expand, new_t))
    result = p.respell(op, name=f"{op.name}_{suffix}", spec=_features(op.spec, out_features), mat2=mat2)
    if lin.view_out is not None:
        result = sized(lin.view_out, result)
    if bias is None:
        return result
    spec = _features(lin.outer.spec, out_features)
    if lin.bias_add is not None:
        return p.respell(lin.bias_add, name=f"{lin.bias_add.name}_{suffix}", spec=spec, self=result, other=bias)
    return p.call(
        "aten.add.Tensor", name=f"{op.name}_{suffix}_bias", spec=spec, self=result, other=bias, provenance=op.name
    )


def _transposed(p: Planner, lin: Linear, weight: NodeRef, spec: TensorSpec | None, suffix: str) -> NodeRef:
    """The new weight (out, in) as the product reads it, (in, out): the linear's transpose re-spelled
    on it, or, for a weight that was stored (in, out), a new transpose."""
    if lin.t is not None:
        return p.respell(lin.t, name=f"{lin.t.name}_{suffix}", spec=spec, self=weight)
    name = f"{lin.op.name}_{suffix}_t"
    return p.call("aten.permute.default", name=name, spec=spec, self=weight, dims=(1, 0), provenance=lin.op.name)


def emit_linear(
    p: Planner,
    lin: Linear,
    weight: NodeRef,
    bias: NodeRef | None,
    *,
    out_features: int | None = None,
    input: NodeRef | None = None,
    in_features: int | None = None,
    suffix: str = "new",
) -> NodeRef:
    """The same linear re-spelled with a new weight (out, in) and bias (a bias may appear: ``mm``
    becomes ``addmm``; a ``matmul`` becomes ``linear``); ``out_features`` when the weight has
    another number of rows; ``input`` when it reads another value (the flattening reshape, where
    the spelling has one, re-spelled on it), ``in_features`` when that value's last size is another
    than the linear's input's (the plan is declined ``malformed-node`` at ``plan`` if an existing
    node's is and ``in_features`` does not say so); a ``bmm`` reads its input as it is (declined so
    for ``input``: the spelling is the program's). Returns the node that carries
    the result (the new ``outer``); the weight of a linear that read it stored (in, out) is read
    through a new transpose."""
    op = lin.op
    name = f"{op.name}_{suffix}"
    _check_width(p, lin, input, in_features)
    if lin.t is None and not lin.in_out:  # aten.linear
        x = op.args["input"] if input is None else input
        result = p.respell(op, name=name, spec=_features(op.spec, out_features), input=x, weight=weight, bias=bias)
    elif lin.t_expand is not None and lin.t_view is not None:  # bmm: the weight broadcast again, the bias added
        if input is not None:  # (the match's spelling: the plan is declined)
            p._refuse(f"emit_linear of {op.name}: a bmm reads its input as it is (no input=)")
        return _emit_bmm(p, lin, weight, bias, out_features, suffix)
    elif op.node.target in _MATMULS:  # x @ W.T, in an aten program: a linear, with or without bias
        x = op.args["self"] if input is None else input
        spec = _features(op.spec, out_features)
        result = p.call(
            "aten.linear.default", name=name, spec=spec, input=x, weight=weight, bias=bias, provenance=op.name
        )
    else:
        w_spec = lin.stored_spec(p.match.snap)
        t_spec = (
            TensorSpec(shape=(w_spec.shape[0], out_features), dtype=w_spec.dtype)
            if w_spec and out_features is not None
            else None
        )
        if w_spec and in_features is not None:
            t_spec = TensorSpec(shape=(in_features, *(t_spec or w_spec).shape[1:]), dtype=w_spec.dtype)
        new_t = _transposed(p, lin, weight, t_spec or w_spec, suffix)
        spec = _features(op.spec, out_features)
        x = op.args["mat1"] if op.node.target.startswith("aten.addmm") else op.args["self"]
        if input is not None:
            flat = lin.view_in
            if flat is None:
                x = input
            else:
                size = flat.args["size"]
                if in_features is not None and isinstance(size, tuple):
                    size = (*size[:-1], in_features)
                flat_spec = _features(flat.spec, in_features)
                x = p.respell(flat, name=f"{flat.name}_{suffix}", spec=flat_spec, self=input, size=size)
        if bias is None:
            result = p.call("aten.mm.default", name=name, spec=spec, self=x, mat2=new_t, provenance=op.name)
        elif op.node.target.startswith("aten.addmm"):
            result = p.respell(op, name=name, spec=spec, self=bias, mat1=x, mat2=new_t)
        else:
            result = p.call(
                "aten.addmm.default", name=name, spec=spec, self=bias, mat1=x, mat2=new_t, provenance=op.name
            )
    out = lin.view_out
    if out is None:
        return result
    size = out.args["size"]
    if out_features is not None and isinstance(size, tuple):
        size = (*size[:-1], out_features)
    return p.respell(out, name=f"{out.name}_{suffix}", spec=_features(out.spec, out_features), self=result, size=size)

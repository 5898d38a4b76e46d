"""fxpure.linear: the one pattern for every spelling of a linear, built inside the tests (a rule's
pattern is built at import, which mutation testing cannot see): what each spelling binds and
where, what a match erases and prunes, and the names and codes a caller passes in."""

from __future__ import annotations

from typing import Any

import pytest
from returns.result import Failure, Success

from fxpure.families import ADDMM, PERMUTE, RELU, TRANSPOSE
from fxpure.linear import (
    MATRIX_T,
    emit_linear,
    is_bias_add,
    is_linear,
    linear,
    linear_input,
    linear_of,
    linear_root,
)
from fxpure.pattern import ANY, ONE, Bound, Const, Lit, Match, OneOf, Op, Pattern, Planner, Root, Var, match, rule
from fxpure.plan import RewritePlan, plan
from fxpure.reasons import Reason
from fxpure.rules.linear_to_conv2d import linear_to_conv2d
from fxpure.snapshot import GraphSnapshot, NodeRef, TensorSpec
from fxpure.testing import GraphBuilder, spec
from fxpure.weights import Fill, Source
from tests.core.test_linear_to_conv2d_core import linear as graph
from tests.core.test_linear_to_conv2d_core import with_symbolic_sizes

# (spelling, rank, bias) -> {bound name: pattern path}, the nodes a rewrite erases, those it prunes
PRODUCT = {"x": "lin.mat1", "lin_t": "lin.mat2/lin_t", "w": "lin.mat2/lin_t.self"}
ND = {"lin_in": "lin.mat1/lin_in", "x": "lin.mat1/lin_in.self", "lin_out": "lin.user/lin_out"}
EXPECTED: dict[tuple[str, int, str], tuple[dict[str, str], tuple[str, ...], tuple[str, ...]]] = {
    ("linear", 2, "param"): ({"lin": "lin", "x": "lin.input", "w": "lin.weight", "b": "lin.bias"}, ("lin",), ()),
    ("addmm", 2, "param"): ({"lin": "lin", "b": "lin.self", **PRODUCT}, ("lin",), ("lin_t",)),
    ("addmm", 2, "none"): ({"lin": "lin", **PRODUCT, "x": "lin.self"}, ("lin",), ("lin_t",)),
    ("addmm", 3, "param"): ({"lin": "lin", "b": "lin.self", **PRODUCT, **ND}, ("lin", "lin_out"), ("lin_in", "lin_t")),
    ("addmm", 3, "none"): (
        {"lin": "lin", **PRODUCT, "lin_in": "lin.self/lin_in", "x": "lin.self/lin_in.self", "lin_out": ND["lin_out"]},
        ("lin", "lin_out"),
        ("lin_in", "lin_t"),
    ),
}


def _match(snap: GraphSnapshot, pattern: Root, node: str = "lin") -> Match:
    result = match(pattern, snap, snap.node(node))
    assert isinstance(result, Success), result
    found: Match = result.unwrap()
    return found


def _reason(snap: GraphSnapshot, pattern: Root, node: str = "lin") -> Reason:
    result = match(pattern, snap, snap.node(node))
    assert isinstance(result, Failure), result
    reason: Reason = result.failure()
    return reason


@pytest.mark.parametrize("dialect", ["aten", "edge"])
@pytest.mark.parametrize(("spelling", "rank", "bias"), sorted(EXPECTED))
def test_linear_root_binds_each_spelling_where_it_is(spelling: str, rank: int, bias: str, dialect: str) -> None:
    snap = graph(spelling=spelling, dialect=dialect, lead=(2, 5)[: rank - 1], bias=bias)
    m = _match(snap, linear_root())
    sites, erase, prune = EXPECTED[(spelling, rank, bias)]
    assert {k: s.path for k, s in m.sites.items()} == sites
    assert (m.erase, m.prune) == (erase, prune)
    lin = linear_of(m)
    names = (lin.op.name, lin.t and lin.t.name, lin.view_in and lin.view_in.name, lin.view_out and lin.view_out.name)
    assert names == ("lin", *(n if n in sites else None for n in ("lin_t", "lin_in", "lin_out")))
    assert lin.outer.name == ("lin_out" if rank > 2 and spelling != "linear" else "lin")
    assert lin.weight == NodeRef("w")  # the (out, in) weight, not its transpose
    assert ("b" in m.bindings) == (spelling == "linear" or bias == "param")  # mm has no bias to bind
    assert lin.bias == (NodeRef("b") if bias == "param" else None)  # (the outside author read it by spelling)
    assert lin.operand == NodeRef("lin_in" if "lin_in" in sites else "x")  # what the product multiplies


def test_a_transposed_weight_by_t_is_a_linear_too() -> None:
    m = _match(graph(spelling="t", lead=(2,)), linear_root())
    assert m.sites["lin_t"].path == "lin.mat2/lin_t" and (m.erase, m.prune) == (("lin",), ("lin_t",))


def test_names_and_operand_patterns_are_the_callers() -> None:
    snap = graph(spelling="addmm", dialect="edge", lead=(2, 5))
    pattern = linear_root("fc", input=Var("inp"), weight=Const("ww"), bias=Const("bb"))
    m = _match(snap, pattern)
    assert {k: s.path for k, s in m.sites.items()} == {
        "fc": "fc",
        "bb": "fc.self",
        "fc_in": "fc.mat1/fc_in",
        "inp": "fc.mat1/fc_in.self",
        "fc_t": "fc.mat2/fc_t",
        "ww": "fc.mat2/fc_t.self",
        "fc_out": "fc.user/fc_out",
    }
    assert linear_of(m, "fc").outer.name == "lin_out"
    with pytest.raises(KeyError, match="no linear called 'lin'"):
        linear_of(m)
    # a linear() spelled as aten.linear binds the caller's names as well
    m = _match(graph(), linear_root("fc", input=Var("inp"), weight=Const("ww"), bias=Const("bb")))
    assert {k: s.path for k, s in m.sites.items()} == {
        "fc": "fc",
        "inp": "fc.input",
        "ww": "fc.weight",
        "bb": "fc.bias",
    }


def _product(
    *,
    t: str = "aten.permute_copy.default",
    dims: tuple[int, ...] = (1, 0),
    reads: int = 1,
    rank: int = 2,
    bias: bool = True,
) -> GraphSnapshot:
    """relu(addmm(b, x, t(w))) (mm without bias; reshaped around for rank 3), edge, with the
    transpose op and the number of relus reading the linear as given; ``t="linear"``: an
    ``aten.linear`` instead."""
    g = GraphBuilder(dialect="edge")
    w, b = g.parameter("w", (6, 8)), g.parameter("b", (6,))
    x = g.input("x", (2, 5, 8)[3 - rank :])
    if t == "linear":
        y = g.call("aten.linear.default", name="lin", out=(2, 6), input=x, weight=w, bias=b if bias else None)
    else:
        if rank == 3:
            x = g.call("aten.view_copy.default", name="lin_in", out=(10, 8), self=x, size=(-1, 8))
        wt = g.call(t, name="lin_t", out=(8, 6), self=w, **({"dims": dims} if "permute" in t else {}))
        rows = (2, 10)[rank - 2]
        if bias:
            y = g.call("aten.addmm.default", name="lin", out=(rows, 6), self=b, mat1=x, mat2=wt)
        else:
            y = g.call("aten.mm.default", name="lin", out=(rows, 6), self=x, mat2=wt)
        if rank == 3:
            y = g.call("aten.view_copy.default", name="lin_out", out=(2, 5, 6), self=y, size=(2, 5, 6))
    g.output(*[g.call("aten.relu.default", name=f"relu{i or ''}", self=y) for i in range(reads)])
    return g.build()


@pytest.mark.parametrize("root", [True, False])
def test_codes_are_the_callers(root: bool) -> None:
    """A caller's own codes for another op and for a shared inner node (``linear`` as an operand
    of a relu, or ``linear_root`` anchored at the product)."""

    def reason(snap: GraphSnapshot, code: str = "wrong-op", shared: str = "output-shared") -> tuple[str, str]:
        pattern: Root = (
            linear_root(code=code, shared=shared) if root else Op(RELU, self=linear(code=code, shared=shared))
        )
        r = _reason(snap, pattern, "lin" if root else "relu")
        return r.code, r.path

    at = "lin" if root else "relu.self/lin"
    not_t = _product(t="aten.relu.default")
    assert reason(not_t) == ("wrong-op", f"{at}.mat2/lin_t")
    assert reason(not_t, code="no-linear") == ("no-linear", f"{at}.mat2/lin_t")
    assert reason(_product(dims=(0, 1))) == ("arg-mismatch", f"{at}.mat2/lin_t.dims")
    if not root:  # the linear read twice is the operand's shared output; the root has no such check
        for t in ("linear", "aten.permute_copy.default"):
            assert reason(_product(t=t, reads=2)) == ("output-shared", "relu.self/lin")
            assert reason(_product(t=t, reads=2), shared="lin-shared") == ("lin-shared", "relu.self/lin")
        # a relu of the input: no alternative gets further than another, the first one (linear) speaks
        g = GraphBuilder(dialect="edge")
        g.output(g.call("aten.relu.default", name="relu", self=g.input("x", (2, 8))))
        assert reason(g.build(), code="no-linear") == ("no-linear", "relu.self/lin")
    if root:  # a transpose another node reads too (tied weights) is no reason: a plan leaves it to that node
        m = _match(graph(spelling="addmm", dialect="edge", lead=(2,), t_shared=True), linear_root(shared="t-shared"))
        assert "lin_t" in m.prune and "lin_t" not in m.erase


def test_a_linear_operand_matches_every_spelling_below_its_reader() -> None:
    m = _match(_product(t="linear"), Op(RELU, self=linear()), "relu")
    assert {k: s.path for k, s in m.sites.items()} == {
        "lin": "relu.self/lin",
        "x": "relu.self/lin.input",
        "w": "relu.self/lin.weight",
        "b": "relu.self/lin.bias",
    }
    assert (m.erase, m.prune) == (("relu", "lin"), ())
    m = _match(_product(), Op(RELU, self=linear()), "relu")
    assert {k: s.path for k, s in m.sites.items()} == {
        "lin": "relu.self/lin",
        "b": "relu.self/lin.self",
        "x": "relu.self/lin.mat1",
        "lin_t": "relu.self/lin.mat2/lin_t",
        "w": "relu.self/lin.mat2/lin_t.self",
    }
    # with ANY users the product may be read by others, and is then kept (pruned, not erased)
    m = _match(_product(reads=2), Op(RELU, self=linear(users=ANY)), "relu")
    assert m.erase == ("relu",) and m.prune == ("lin", "lin_t")
    m = _match(_product(), Op(RELU, self=linear()), "relu")
    assert m.erase == ("relu", "lin") and m.prune == ("lin_t",)  # (the transpose: another reader may keep it)


@pytest.mark.parametrize("bias", [True, False])
def test_a_reshaped_linear_operand_binds_its_reshapes(bias: bool) -> None:
    m = _match(_product(rank=3, bias=bias), Op(RELU, self=linear()), "relu")
    x = "relu.self/lin_out.self/lin" + (".mat1" if bias else ".self")
    assert {k: s.path for k, s in m.sites.items()} == {
        "lin_out": "relu.self/lin_out",
        "lin": "relu.self/lin_out.self/lin",
        **({"b": "relu.self/lin_out.self/lin.self"} if bias else {}),
        "lin_in": f"{x}/lin_in",
        "x": f"{x}/lin_in.self",
        "lin_t": "relu.self/lin_out.self/lin.mat2/lin_t",
        "w": "relu.self/lin_out.self/lin.mat2/lin_t.self",
    }
    assert (m.erase, m.prune) == (("relu", "lin_out", "lin"), ("lin_in", "lin_t"))
    assert linear_of(m).outer.name == "lin_out"
    # a linear others read too is kept whole: its reshapes, product and transpose are pruned
    m = _match(_product(rank=3, bias=bias, reads=2), Op(RELU, self=linear(users=ANY)), "relu")
    assert (m.erase, m.prune) == (("relu",), ("lin_out", "lin", "lin_in", "lin_t"))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("new_bias", [True, False])
def test_emit_linear_respells_the_product_with_new_weights(bias: bool, new_bias: bool) -> None:
    # anchored at the relu: the new product's metadata still comes from the linear it replaces
    snap = _product(bias=bias)
    m = _match(snap, Op(RELU, name="relu", self=linear()), "relu")
    p = Planner("t", m)
    w, b = NodeRef("w2"), NodeRef("b2") if new_bias else None
    out = emit_linear(p, linear_of(m), w, b, out_features=4)
    t, product = p.finish([]).nodes
    assert out.name == "lin_new" == product.name and t.name == "lin_t_new"
    assert (t.target, t.args, t.spec) == ("aten.permute_copy.default", (w, (1, 0)), spec(8, 4))
    target = "aten.addmm.default" if new_bias else "aten.mm.default"
    args = (b, NodeRef("x"), NodeRef("lin_t_new")) if new_bias else (NodeRef("x"), NodeRef("lin_t_new"))
    assert (product.target, product.args, product.spec, product.provenance) == (target, args, spec(2, 4), "lin")
    # the same number of features: the transpose keeps the weight's own spec
    p = Planner("t", m)
    emit_linear(p, linear_of(m), w, b, suffix="v2")
    t, product = p.finish([]).nodes
    assert (t.name, t.spec, product.name, product.spec) == ("lin_t_v2", spec(8, 6), "lin_v2", spec(2, 6))


def _ops(p: Pattern | None) -> list[Op]:
    """Every Op of a pattern, depth first."""
    if isinstance(p, OneOf):
        return [o for a in p.alternatives for o in _ops(a)]
    if not isinstance(p, Op):
        return []
    return [p, *(o for _, sub in p.args for o in _ops(sub)), *_ops(p.user)]


def _leaves(p: Pattern) -> set[Pattern]:
    return {sub for o in _ops(p) for _, sub in o.args if not isinstance(sub, Op | OneOf)}


@pytest.mark.parametrize("root", [True, False])
def test_every_op_of_a_linear_carries_the_callers_codes_and_operands(root: bool) -> None:
    """Built structurally, alternative by alternative: every spelling (not only those a graph in
    these tests reaches) takes the caller's codes, operands and users."""
    x, w, b = Var("inp"), Const("ww"), Const("bb")
    p = (
        linear_root("q", input=x, weight=w, bias=b, code="C", shared="S")
        if root
        else linear("q", input=x, weight=w, bias=b, code="C", shared="S", users=ANY, bias_add=True)
    )
    ops = _ops(p)
    # every Op of the spellings, the weight's transpose (ten) in each but linear: five (addmm, mm, matmul
    # and the two reshaped products) and bmm (product, weight expand and view, reshape after), once as
    # the root and twice as an operand (with the add of its bias, and without)
    assert len(ops) == 10 + 5 * 10 + (14 if root else 15 + 14)
    assert {o.code for o in ops} == {"C"}
    assert {o.shared for o in ops if o.name != "q_in"} == {"S"}  # (the input reshape may be shared)
    swaps = {Lit(d) for d in (0, 1, -1, -2)}
    assert _leaves(p) == {x, w, b, Lit((1, 0), (-1, -2), (1, -2), (-1, 0)), Lit(1, 1.0), *swaps}
    for o in ops:
        if o.family == ADDMM:
            assert dict(o.args)["beta"] == dict(o.args)["alpha"] == Lit(1, 1.0)
        if o.name == "q_in":
            assert o.users == ANY  # the model's own flatten may feed others
    tops = [o.users for o in p.alternatives if isinstance(o, Op)]
    assert tops == ([ONE] * 7 if root else [ANY] * 8)
    inner = [o.users for o in ops if o.name == "q" and o not in p.alternatives]
    assert inner == [ONE] * (0 if root else 4)  # a reshaped product is read by its reshape only
    if root:  # the reshape after a rank > 2 product is matched as its one user
        users = [o.user for o in p.alternatives if isinstance(o, Op) and o.user is not None]
        assert len(users) == 3 and all(isinstance(u, Op) and (u.code, u.shared) == ("C", "S") for u in users)


def test_a_linear_by_default_words_the_generic_codes_and_an_optional_bias() -> None:
    for p in (linear(), linear_root()):
        assert {o.code for o in _ops(p)} == {"wrong-op"}
        assert {o.shared for o in _ops(p)} == {"output-shared"}
        assert {Var("x"), Const("w"), Const("b", optional=True)} <= _leaves(p)


def test_emit_linear_keeps_an_addmms_own_keywords() -> None:
    g = GraphBuilder(dialect="edge")
    w, b, x = g.parameter("w", (6, 8)), g.parameter("b", (6,)), g.input("x", (2, 8))
    wt = g.call("aten.permute_copy.default", name="lin_t", out=(8, 6), self=w, dims=(1, 0))
    y = g.call("aten.addmm.default", name="lin", out=(2, 6), self=b, mat1=x, mat2=wt, beta=1, alpha=1.0)
    g.output(g.call("aten.relu.default", name="relu", self=y))
    m = _match(g.build(), Op(RELU, name="relu", self=linear()), "relu")
    p = Planner("t", m)
    emit_linear(p, linear_of(m), NodeRef("w2"), NodeRef("b2"))
    product = p.finish([]).nodes[-1]
    assert product.args == (NodeRef("b2"), x, NodeRef("lin_t_new"))
    assert {k: (type(v), v) for k, v in product.kwargs.items()} == {"beta": (int, 1), "alpha": (float, 1.0)}


@pytest.mark.parametrize("read_elsewhere", [False, True])
def test_a_planner_replacing_a_dynamic_linear_leaves_no_size_computation_behind(read_elsewhere: bool) -> None:
    # an outside author's rule put one node in place of view + mm + view: the sym_size and mul that
    # computed the reshapes' sizes stayed, read by nothing, unless the planner named them in prune=
    def one_node(p: Planner, x: NodeRef) -> RewritePlan:
        lin = linear_of(p.match)
        new = p.call("aten.linear.default", name="lin_1", spec=lin.spec, input=x, weight=lin.weight)
        return p.replace(lin.outer, new)

    after = plan(with_symbolic_sizes(size_read_elsewhere=read_elsewhere), [rule("one", linear_root(), plan=one_node)])
    assert len(after.plans) == 1 and {"lin_in", "lin", "lin_out"}.isdisjoint(after.after.index)
    assert ({"sym_size", "mul"} <= set(after.after.index)) is read_elsewhere


@pytest.mark.parametrize(
    ("target", "args", "planned"),
    [
        ("aten.t.default", (), True),
        ("aten.numpy_T.default", (), True),  # W.T
        ("aten.mT.default", (), True),  # W.mT
        ("aten.permute.default", ((1, 0),), True),
        ("aten.permute.default", ((-1, -2),), True),
        ("aten.permute.default", ((0, 1),), False),  # no transpose at all
        ("aten.transpose.int", (0, 1), True),
        ("aten.transpose.int", (-1, 0), True),
        ("aten.transpose.int", (1, -1), False),  # the same dim twice: no transpose
        ("aten.transpose.int", (0, 0), False),
        # an aten program keeps W.mH, W.adjoint() and W.movedim(0, 1) as they are (no linear rule
        # saw them): of a real weight each is its transpose
        ("aten.mH.default", (), True),
        ("aten.adjoint.default", (), True),
        ("aten.movedim.int", (0, 1), True),
        ("aten.movedim.int", (-1, 0), True),
        ("aten.movedim.int", (1, 1), False),
    ],
)
def test_a_weight_transposed_in_any_spelling_is_a_linear(target: str, args: tuple[object, ...], planned: bool) -> None:
    # an outside author's mm(x, W.T) (aten.numpy_T), W.mT, W.transpose(0, 1) and permute(-1, -2)
    # were declined wrong-op or arg-mismatch
    g = GraphBuilder()
    w = g.parameter("w", (6, 8))
    t = g.node(target, (w, *args), name="t", out=(8, 6) if planned else (6, 8))  # type: ignore[arg-type]
    g.output(g.call("aten.mm.default", name="lin", out=(2, 6), self=g.input("x", (2, 8)), mat2=t))
    found = match(linear_root(), g.build(), g.build().node("lin"))
    assert isinstance(found, Success) is planned
    if planned:
        lin = linear_of(found.unwrap())
        assert lin.t is not None and lin.t.name == "t" and lin.weight == NodeRef("w")


@pytest.mark.parametrize("target", ["aten.mH.default", "aten.adjoint.default"])
def test_a_complex_weights_conjugate_transpose_is_no_linears_weight(target: str) -> None:
    # W.mH of a complex weight also conjugates it: read as its transpose, a rule would compute x @ W.T
    g = GraphBuilder()
    w = g.parameter("w", (6, 8), dtype="complex64")
    t = g.node(target, (w,), name="t", out=spec(8, 6, dtype="complex64"))
    g.output(
        g.call("aten.mm.default", name="lin", out=spec(2, 6, dtype="complex64"), self=g.input("x", (2, 8)), mat2=t)
    )
    snap = g.build()
    found = match(linear_root(), snap, snap.node("lin"))
    assert isinstance(found, Failure) and (found.failure().code, found.failure().node) == ("wrong-op", "lin")
    assert "not a permute or a transpose of a real matrix" in found.failure().message  # (an mm: a rule says why)


def test_the_sizes_an_erased_node_or_a_named_prune_read_go_each_on_its_own() -> None:
    # the size the erased reshape after the product reads is its own sym_size here (not shared
    # with the pruned one before it); and a node the planner names in prune= reads one too
    g = GraphBuilder(dialect="edge")
    w, x = g.parameter("w", (6, 8)), g.input("x", ("s0", 5, 8))
    rows = g.node("_operator.mul", (g.node("aten.sym_size.int", (x, 0), name="n_in"), 5), name="rows")
    flat = g.call("aten.view_copy.default", name="lin_in", out=("5*s0", 8), self=x, size=(rows, 8))
    t = g.call("aten.permute_copy.default", name="lin_t", out=(8, 6), self=w, dims=(1, 0))
    y = g.call("aten.mm.default", name="lin", out=("5*s0", 6), self=flat, mat2=t)
    n_out = g.node("aten.sym_size.int", (x, 0), name="n_out")
    g.output(g.call("aten.view_copy.default", name="lin_out", out=("s0", 5, 6), self=y, size=(n_out, 5, 6)))
    snap = g.build()

    def one_node(p: Planner, x: NodeRef) -> RewritePlan:
        lin = linear_of(p.match)
        new = p.call("aten.linear.default", name="lin_1", spec=lin.spec, input=x, weight=lin.weight)
        return p.replace(lin.outer, new)

    after = plan(snap, [rule("one", linear_root(), plan=one_node)]).after
    assert {"n_in", "rows", "n_out"}.isdisjoint(after.index)

    g = GraphBuilder(dialect="edge")
    x = g.input("x", ("s0", 8))
    v = g.call(
        "aten.view_copy.default",
        name="v",
        out=("s0", 8),
        self=x,
        size=(g.node("aten.sym_size.int", (x, 0), name="n"), 8),
    )
    g.output(g.call("aten.relu.default", name="r", out=("s0", 8), self=v))

    def around(p: Planner, r: Bound) -> RewritePlan:  # relu(x) instead of relu(view(x)): v is no part of the match
        return p.replace(r, p.call("aten.relu.default", name="r2", spec=r.spec, self=NodeRef("x")), prune=["v"])

    after = plan(g.build(), [rule("around", Op(RELU, name="r"), plan=around)]).after
    assert {"v", "n"}.isdisjoint(after.index) and "r2" in after.index


def test_a_union_of_families_names_each_noun_once() -> None:
    assert (PERMUTE | TRANSPOSE | MATRIX_T).noun == "a permute or a transpose"
    assert (TRANSPOSE | (PERMUTE | MATRIX_T)).noun == "a transpose or a permute"


@pytest.mark.parametrize(("target", "args"), [("aten.transpose.int", (0, 1)), ("aten.permute.default", ((1, 0),))])
def test_a_transposed_weight_the_graph_computes_is_declined_not_constant(target: str, args: tuple[object, ...]) -> None:
    g = GraphBuilder()
    t = g.node(target, (g.input("w", (6, 8)), *args), name="t", out=(8, 6))  # type: ignore[arg-type]
    g.output(g.call("aten.mm.default", name="lin", out=(2, 6), self=g.input("x", (2, 8)), mat2=t))
    snap = g.build()
    found = match(linear_root(), snap, snap.node("lin"))
    assert isinstance(found, Failure) and found.failure().code == "not-constant"


@pytest.mark.parametrize(("spelling", "rank", "bias"), sorted(EXPECTED))
def test_emit_linear_reads_another_input_where_asked(spelling: str, rank: int, bias: str) -> None:
    # found by an outside author: a rule changing what a linear reads re-implemented each spelling
    snap = graph(spelling=spelling, dialect="edge", lead=(2, 5)[: rank - 1], bias=bias)
    m = _match(snap, linear_root())
    lin = linear_of(m)
    p = Planner("t", m)
    emit_linear(p, lin, lin.weight, NodeRef("b") if bias == "param" else None, input=NodeRef("y"))
    made = {n.name: n for n in p.finish([]).nodes}
    product = made["lin_new"]
    read = product.kwargs.get("input") or product.args[1 if product.target.startswith("aten.addmm") else 0]
    assert product.spec == snap.node("lin").spec
    if rank > 2 and spelling != "linear":  # the flattening reshape, re-spelled on the new input
        assert read == NodeRef("lin_in_new") and made["lin_in_new"].args[0] == NodeRef("y")
        assert made["lin_in_new"].args[1:] == snap.node("lin_in").args[1:]
    else:
        assert read == NodeRef("y") and "lin_in_new" not in made
    assert linear_input(m, lin) == (NodeRef("x"), True)


@pytest.mark.parametrize("dialect", ["aten", "edge"])
def test_emit_linear_reads_an_input_of_another_width_where_told(dialect: str) -> None:
    # an outside author merging two linears: the new one reads the first's input, of another width;
    # emit_linear declared the transpose and the flattening reshape with the old width (on edge the
    # plan was then declined, on a real program only) and had no way to say otherwise
    g = GraphBuilder(dialect=dialect)
    x, z, w, b = g.input("x", (2, 5, 8)), g.input("z", (2, 5, 3)), g.parameter("w", (6, 8)), g.parameter("b", (6,))
    if dialect == "aten":
        y = g.call("aten.linear.default", name="lin", out=(2, 5, 6), input=x, weight=w, bias=b)
    else:
        flat = g.call("aten.view_copy.default", name="lin_in", self=x, size=(10, 8), out=(10, 8))
        t = g.call("aten.permute_copy.default", name="lin_t", self=w, dims=(1, 0), out=(8, 6))
        mm = g.call("aten.addmm.default", name="lin", self=b, mat1=flat, mat2=t, out=(10, 6))
        y = g.call("aten.view_copy.default", name="lin_out", self=mm, size=(2, 5, 6), out=(2, 5, 6))
    g.output(g.call("aten.add.Tensor", name="sum", self=y, other=z))
    snap = g.build()
    m = _match(snap, linear_root())
    said = "emit_linear of lin: input z has 3 features, and the new linear is declared with 8 (pass in_features=3)"
    refused = Planner("t", m)  # (the program's widths: the plan is declined, nothing raised)
    emit_linear(refused, linear_of(m), NodeRef("w2"), NodeRef("b"), input=NodeRef("z"))
    assert refused.refused is not None and (refused.refused.code, refused.refused.path) == ("malformed-node", "plan")
    assert refused.refused.message.endswith(said)
    # an input of the linear's own width needs no in_features
    emit_linear(Planner("t", m), linear_of(m), NodeRef("w2"), NodeRef("b"), input=NodeRef("x"))
    p = Planner("t", m)
    emit_linear(p, linear_of(m), NodeRef("w2"), NodeRef("b"), input=NodeRef("z"), in_features=3)
    made = {n.name: n for n in p.finish([]).nodes}
    if dialect == "edge":
        assert (made["lin_in_new"].args, made["lin_in_new"].spec) == ((NodeRef("z"), (10, 3)), spec(10, 3))
        assert made["lin_t_new"].spec == spec(3, 6) and made["lin_new"].spec == spec(10, 6)
    assert made["lin_out_new" if dialect == "edge" else "lin_new"].spec == spec(2, 5, 6)


def test_emit_linear_reads_another_input_through_a_models_own_flatten() -> None:
    # found by a review: the width check compared the new input with the weight, not with the value
    # it stands for, and refused an input of x's own shape behind a flatten that merges dims
    g = GraphBuilder(dialect="edge")
    x, y, w = g.input("x", (4, 2, 4)), g.input("y", (4, 2, 4)), g.parameter("w", (5, 8))
    flat = g.call("aten.view_copy.default", name="lin_in", self=x, size=(4, 8), out=(4, 8))
    t = g.call("aten.permute_copy.default", name="lin_t", self=w, dims=(1, 0), out=(8, 5))
    mm = g.call("aten.mm.default", name="lin", self=flat, mat2=t, out=(4, 5))
    g.output(g.call("aten.view_copy.default", name="lin_out", self=mm, size=(2, 2, 5), out=(2, 2, 5)))
    snap = g.build()
    m = _match(snap, linear_root())
    p = Planner("t", m)
    emit_linear(p, linear_of(m), NodeRef("w"), None, input=y)
    made = {n.name: n for n in p.finish([]).nodes}
    assert (made["lin_in_new"].args, made["lin_new"].spec) == ((y, (4, 8)), spec(4, 5))
    refused = Planner("t", m)
    emit_linear(refused, linear_of(m), NodeRef("w"), None, input=y, in_features=4)
    assert (
        refused.refused is not None and "in_features with lin_in, a reshape that merges dims" in refused.refused.message
    )


def test_a_models_own_flatten_around_a_product_is_no_linear_input() -> None:
    # the pattern binds the model's reshapes as the linear's (x is not what the product reads)
    g = GraphBuilder(dialect="edge")
    x, w = g.input("x", (4, 6, 8)), g.parameter("w", (5, 8))
    flat = g.call("aten.view_copy.default", name="flat", self=x, size=(24, 8), out=(24, 8))
    t = g.call("aten.permute_copy.default", self=w, dims=(1, 0), out=(8, 5))
    mm = g.call("aten.mm.default", name="mm", self=flat, mat2=t, out=(24, 5))
    g.output(g.call("aten.view_copy.default", self=mm, size=(12, 2, 5), out=(12, 2, 5)))
    snap = g.build()
    m = _match(snap, linear_root(), "mm")
    assert m.bindings["x"] == NodeRef("x") and linear_input(m, linear_of(m)) == (NodeRef("flat"), False)


def _matmul(
    *,
    w_shape: tuple[int, ...] = (6, 8),
    t: str = "aten.t.default",
    dims: tuple[int, ...] = (),
    weight: str = "param",
) -> GraphSnapshot:
    """relu(x @ t(w, *dims)), aten, as ``x @ W.T`` exports; ``weight="input"``: attention's
    ``q @ k.T``, ``"dq"``: an int8 weight dequantized, ``"select"``: ``W3[0]``, ``"chainN"``: ``W``
    cloned N times; ``t=""``: ``x @ W``
    (no transpose)."""
    g = GraphBuilder()
    x = g.input("x", (2, 3, 8))
    if weight == "dq":
        q = g.parameter("wq", w_shape, dtype="int8")
        w = g.call("quantized_decomposed.dequantize_per_tensor.default", out=w_shape, input=q, scale=0.1,
                   zero_point=0, quant_min=-127, quant_max=127, dtype="int8")  # fmt: skip
    elif weight == "select":
        w = g.node("aten.select.int", (g.parameter("w3", (2, *w_shape)), 0, 0), name="select", out=w_shape)
    elif weight.startswith("chain"):  # a weight computed by that many nodes
        w = g.parameter("w", w_shape)
        for _ in range(int(weight[5:])):
            w = g.call("aten.clone.default", self=w, out=w_shape)
    else:
        w = g.parameter("w", w_shape) if weight == "param" else g.input("w", w_shape)
    swapped = (*w_shape[:-2], w_shape[-1], w_shape[-2])
    other = g.node(t, (w, *dims), name="lin_t", out=swapped) if t else w
    out = (*w_shape[:-2], 2, 3, swapped[-1]) if len(w_shape) > 2 else (2, 3, swapped[-1])
    y = g.call("aten.matmul.default", name="lin", out=out, self=x, other=other)
    g.output(g.call("aten.relu.default", name="relu", out=out, self=y))
    return g.build()


@pytest.mark.parametrize("new_bias", [True, False])
def test_x_matmul_a_transposed_weight_is_a_linear_emitted_as_one(new_bias: bool) -> None:
    # x @ W.T stays aten.matmul in an aten program: no linear rule saw it
    snap = _matmul()
    for pattern in (Op(RELU, name="relu", self=linear()), linear_root()):
        m = _match(snap, pattern, "relu" if isinstance(pattern, Op) else "lin")
        lin = linear_of(m)
        assert (lin.op.name, lin.t and lin.t.name, lin.weight, m.bindings["x"]) == (
            "lin",
            "lin_t",
            NodeRef("w"),
            NodeRef("x"),
        )
        assert m.sites["w"].path.endswith("lin.other/lin_t.self") and "b" not in m.bindings
        assert linear_input(m, lin) == (NodeRef("x"), True)
    w, b = NodeRef("w2"), NodeRef("b2") if new_bias else None
    m = _match(snap, Op(RELU, name="relu", self=linear()), "relu")  # (anchored elsewhere: the provenance is lin)
    lin = linear_of(m)
    p = Planner("t", m)
    out = emit_linear(p, lin, w, b, out_features=4)
    (product,) = p.finish([]).nodes  # one aten.linear, with or without bias: no transpose, no matmul
    assert out.name == product.name == "lin_new"
    # (no bias: left out, as export writes it; a delegate may read a None as a bias)
    args = (NodeRef("x"), w, b) if b is not None else (NodeRef("x"), w)
    assert (product.target, product.args, dict(product.kwargs)) == ("aten.linear.default", args, {})
    assert (product.spec, product.provenance) == (spec(2, 3, 4), "lin")
    p = Planner("t", m)
    emit_linear(p, lin, w, b, input=NodeRef("y"))
    (product,) = p.finish([]).nodes
    assert (product.args[0], product.spec) == (NodeRef("y"), spec(2, 3, 6))


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ({}, True),
        ({"t": "aten.numpy_T.default"}, True),
        ({"t": "aten.transpose.int", "dims": (-2, -1)}, True),
        ({"t": "aten.swapaxes.default", "dims": (1, 0)}, True),
        ({"t": "aten.permute.default", "dims": ((-1, 0),)}, True),
        # a weight computed from constants alone: a rule says if it cannot take it (not-constant)
        ({"weight": "dq"}, True),
        ({"weight": "select"}, True),
        ({"weight": "chain8"}, True),
        ({"weight": "chain9"}, False),  # computed by more nodes than a weight's dequantize, slice or cast
        ({"weight": "input"}, False),  # attention's q @ k.T: two activations
        ({"w_shape": (4, 6, 8), "t": "aten.transpose.int", "dims": (-2, -1)}, False),  # a batch of matrices
        ({"w_shape": (8, 8), "t": "aten.relu.default"}, False),  # no transpose
        ({"w_shape": (8, 8), "t": "aten.permute.default", "dims": ((0, 1),)}, False),  # no transpose either
        ({"w_shape": (8, 8), "t": "aten.transpose.int", "dims": (1, -1)}, False),
        ({"w_shape": (8, 6), "t": ""}, False),  # x @ W: the weight is (in, out), no linear's
    ],
)
def test_a_matmul_is_a_linear_only_of_a_transposed_matrix_constant(kind: dict[str, Any], expected: bool) -> None:
    snap = _matmul(**kind)
    assert is_linear(snap, snap.node("lin")) is expected
    # where a rule takes a weight stored (in, out): any 2-D constant (x @ W, x @ relu(W)) too, still
    # no activation, no batch of matrices
    stored = expected or (kind.get("w_shape") in ((8, 6), (8, 8)))
    assert is_linear(snap, snap.node("lin"), in_out=True) is stored
    # every linear, addmm and mm is one (a rule says why not); no other op is
    other = graph(spelling="addmm", dialect="edge", lead=(2,))
    assert is_linear(other, other.node("lin")) and not is_linear(snap, snap.node("relu"))


@pytest.mark.parametrize("in_out", [False, True])
def test_a_transpose_of_unknown_shape_is_still_a_weights(in_out: bool) -> None:
    # (a rule taking a weight stored (in, out) too: a value of unknown rank may still be W.T, whose
    # rule then says what it does not know, malformed-node, rather than skip it unreported)
    g = GraphBuilder()
    x, w = g.input("x", (2, 3, 8)), g.parameter("w", (6, 8))
    t = g.node("aten.t.default", (w,), name="lin_t")
    g.output(g.call("aten.matmul.default", name="lin", self=x, other=t, out=(2, 3, 6)))
    snap = g.build()
    assert snap.node("lin_t").spec is None and is_linear(snap, snap.node("lin"), in_out=in_out)


def test_a_matmul_and_its_transpose_are_read_by_argument_name() -> None:
    # a pass may write arguments as keywords (other=, dim0=): they are the same linear
    g = GraphBuilder()
    x, w = g.input("x", (2, 3, 8)), g.parameter("w", (6, 8))
    t = g.node("aten.transpose.int", (), {"self": w, "dim0": 1, "dim1": 0}, name="t", out=(8, 6))
    permuted = g.node("aten.permute.default", (w,), {"dims": (-1, -2)}, name="p", out=(8, 6))
    y = g.node("aten.matmul.default", (x,), {"other": t}, name="lin", out=(2, 3, 6))
    z = g.node("aten.matmul.default", (x, permuted), name="lin2", out=(2, 3, 6))
    literal = g.node("aten.matmul.default", (x, 2.0), name="lin3", out=(2, 3, 8))  # malformed: no raise
    g.output(y, z, literal)
    snap = g.build()
    assert [is_linear(snap, snap.node(n)) for n in ("lin", "lin2", "lin3")] == [True, True, False]


@pytest.mark.parametrize(("ops", "expected"), [(8, True), (9, False)])
def test_a_weight_is_looked_for_among_constants_a_few_nodes_up(ops: int, expected: bool) -> None:
    """At most eight nodes between the weight and its constants (an activation reaches an input,
    or more nodes, soon: no walk through the whole program per matmul)."""
    g = GraphBuilder()
    x, w = g.input("x", (2, 8)), g.parameter("w", (6, 8))
    for _ in range(ops):
        w = g.call("aten.relu.default", self=w, out=(6, 8))
    t = g.call("aten.t.default", name="t", self=w, out=(8, 6))
    g.output(g.call("aten.matmul.default", name="lin", self=x, other=t, out=(2, 6)))
    snap = g.build()
    assert is_linear(snap, snap.node("lin")) is expected


def test_a_weight_computed_from_an_input_too_is_no_weight() -> None:
    g = GraphBuilder()
    x, w = g.input("x", (2, 8)), g.parameter("w", (6, 8))
    scaled = g.call("aten.mul.Tensor", self=g.input("s", (6, 8)), other=w, out=(6, 8))  # the input read first
    t = g.call("aten.t.default", name="t", self=scaled, out=(8, 6))
    g.output(g.call("aten.matmul.default", name="lin", self=x, other=t, out=(2, 6)))
    snap = g.build()
    assert not is_linear(snap, snap.node("lin"))


def _bmm_graph(
    weight: tuple[int, int] = (6, 8),
    expanded: tuple[int, int] | None = None,
    *,
    bias_alpha: float | None = 1,
    bias_dtype: str = "float32",
    read: bool = True,
) -> GraphSnapshot:
    """``lin(x.transpose(1, 2))`` as to_edge spells it: ``bmm`` of the input's expand and the
    weight's transpose broadcast over the batch (``expanded``: the matrix sizes the expand gives it),
    reshaped, the bias added (``alpha`` of the add; None: no add); ``read``: else nothing reads the bmm."""
    g = GraphBuilder(dialect="edge")
    x, w = g.input("x", (2, 8, 5)), g.parameter("w", weight)
    out, inner = expanded or weight[::-1], weight[1]
    xt = g.call("aten.permute_copy.default", name="xt", self=x, dims=(0, 2, 1), out=(2, 5, inner))
    xv = g.call(
        "aten.view_copy.default",
        name="xv",
        self=g.call("aten.expand_copy.default", name="xe", self=xt, size=(2, 5, inner), out=(2, 5, inner)),
        size=(2, 5, inner),
        out=(2, 5, inner),
    )
    t = g.call("aten.permute_copy.default", name="t", self=w, dims=(1, 0), out=weight[::-1])
    te = g.call("aten.expand_copy.default", name="te", self=t, size=(2, *out), out=(2, *out))
    tv = g.call("aten.view_copy.default", name="tv", self=te, size=(2, *out), out=(2, *out))
    y = g.call("aten.bmm.default", name="lin", self=xv, mat2=tv, out=(2, 5, out[1]))
    if not read:
        g.output(x)
        return g.build()
    y = g.call("aten.view_copy.default", name="lin_out", self=y, size=(2, 5, out[1]), out=(2, 5, out[1]))
    if bias_alpha is not None:
        b, sum_spec = g.parameter("b", (out[1],), dtype=bias_dtype), spec(2, 5, out[1], dtype=bias_dtype)
        y = g.call("aten.add.Tensor", name="add", self=y, other=b, alpha=bias_alpha, out=sum_spec)
    g.output(y)
    return g.build()


def test_a_bmm_of_a_weight_broadcast_over_the_batch_is_a_linear_and_its_add_the_bias() -> None:
    snap = _bmm_graph()
    assert is_linear(snap, snap.node("lin")) and is_bias_add(snap, snap.node("add"))
    m = _match(snap, linear(bias_add=True), "add")
    assert {k: m.sites[k].path for k in ("lin", "lin_t", "lin_te", "lin_tv", "lin_out", "lin_bias", "b", "x", "w")} == {
        "lin": "lin_bias.self/lin_out.self/lin",
        "lin_t": "lin_bias.self/lin_out.self/lin.mat2/lin_tv.self/lin_te.self/lin_t",
        "lin_te": "lin_bias.self/lin_out.self/lin.mat2/lin_tv.self/lin_te",
        "lin_tv": "lin_bias.self/lin_out.self/lin.mat2/lin_tv",
        "lin_out": "lin_bias.self/lin_out",
        "lin_bias": "lin_bias",
        "b": "lin_bias.other",
        "x": "lin_bias.self/lin_out.self/lin.self",
        "w": "lin_bias.self/lin_out.self/lin.mat2/lin_tv.self/lin_te.self/lin_t.self",
    }
    lin = linear_of(m)
    assert (lin.outer.name, lin.t_expand and lin.t_expand.name, lin.t_view and lin.t_view.name) == ("add", "te", "tv")
    assert linear_input(m, lin) == (NodeRef("xv"), True)  # a batch of matrices: the linear's own input
    assert lin.bias == NodeRef("b")
    root = _match(snap, linear_root(), "lin")
    assert "lin_bias" not in root.bindings and linear_of(root).outer.name == "lin_out"
    assert linear_of(root).bias is None  # (its add not matched: no bias of the bmm's own)


def test_a_bmm_is_no_linear_where_its_expand_broadcasts_the_matrix_or_an_add_is_not_its_bias() -> None:
    # a (1, 8) weight's transpose expanded to 6 columns: six equal outputs, no linear of that weight
    snap = _bmm_graph(weight=(1, 8), expanded=(8, 6))
    assert not is_linear(snap, snap.node("lin")) and not is_bias_add(snap, snap.node("add"))
    scaled = _bmm_graph(bias_alpha=2)  # x W.T + 2 b: a shift of twice the constant, no bias as it is
    assert is_linear(scaled, scaled.node("lin")) and not is_bias_add(scaled, scaled.node("add"))
    promoted = _bmm_graph(bias_dtype="float64")  # a float32 output plus a float64 constant: float64
    assert is_linear(promoted, promoted.node("lin")) and not is_bias_add(promoted, promoted.node("add"))
    bare = _bmm_graph(bias_alpha=None)
    emitted = linear_of(_match(bare, linear(bias_add=True), "lin_out"))
    assert emitted.bias_add is None and emitted.outer.name == "lin_out"


def test_emit_linear_of_a_bmm_broadcasts_the_new_weight_and_adds_the_bias_after() -> None:
    snap = _bmm_graph(bias_alpha=None)
    m = _match(snap, linear_root(), "lin")
    p, lin = Planner("r", m), linear_of(m)
    wide = p.const(Fill(shape=(9, 8), value=1.0, dtype="float32"), "w9")
    bias = p.const(Fill(shape=(9,), value=0.5, dtype="float32"), "b9")
    made = p.replace(lin.outer, emit_linear(p, lin, wide, bias, out_features=9))
    shapes = [
        (n.target.split(".")[1], n.args[0], n.spec.shape if isinstance(n.spec, TensorSpec) else None)
        for n in made.nodes
    ]
    assert shapes == [
        ("permute_copy", NodeRef("w9"), (8, 9)),
        ("expand_copy", NodeRef("t_new"), (2, 8, 9)),  # broadcast as the old one was, 9 columns
        ("view_copy", NodeRef("te_new"), (2, 8, 9)),
        ("bmm", NodeRef("xv"), (2, 5, 9)),  # the same input
        ("view_copy", NodeRef("lin_new"), (2, 5, 9)),
        ("add", NodeRef("lin_out_new"), (2, 5, 9)),  # the bias, after
    ]
    assert [n.args[1] for n in made.nodes[1:3]] == [(2, 8, 9)] * 2 and made.nodes[-1].args[1] == NodeRef("b9")
    assert (made.erase, made.prune) == (("lin", "lin_out"), ("tv", "te", "t"))


def test_a_bmm_nothing_reads_is_declined_saying_so() -> None:
    report = plan(_bmm_graph(read=False), [linear_to_conv2d()])
    assert [(r.node, r.reason.code, r.reason.path, r.reason.message) for r in report.rejections] == [
        ("lin", "output-shared", "lin.user", "output of lin is read by no node, where the pattern takes its one reader")
    ]


def test_a_linear_takes_a_bmm_bias_add_only_when_asked() -> None:
    # a batch norm's input may be any add: a near miss there must not read as if an add were a linear
    snap = _bmm_graph()
    assert isinstance(match(linear(), snap, snap.node("add")), Failure)
    assert "add" not in {o.family.name for o in _ops(linear())}


def test_an_operand_no_spelling_of_a_linear_takes_is_said_not_to_be_a_linear() -> None:
    # one noun where every spelling misses the same node, not the seven ops a linear may be spelled with
    g = GraphBuilder()
    g.output(g.call("aten.relu.default", name="relu", self=g.call("aten.neg.default", self=g.input("x", (2, 4)))))
    snap = g.build()
    failure = match(Op(RELU, self=linear()), snap, snap.node("relu")).failure()
    assert failure.message == "self of relu comes from neg (aten.neg.default), not a linear"


@pytest.mark.parametrize(
    ("spelling", "dialect", "rank", "transpose"),
    [
        ("io", "edge", 2, "aten.permute_copy.default"),
        ("io", "edge", 3, "aten.permute_copy.default"),
        ("io", "aten", 3, "aten.permute.default"),
        ("io-matmul", "aten", 3, ""),  # emitted as aten.linear: no transpose
    ],
)
def test_a_weight_stored_in_out_is_read_where_asked_and_emitted_through_a_new_transpose(
    spelling: str, dialect: str, rank: int, transpose: str
) -> None:
    # GPT-2's Conv1D: addmm(b, x, W), W (in, out); a matmul x @ W
    snap = graph(spelling=spelling, dialect=dialect, lead=(2, 5)[: rank - 1], bias="none")
    assert isinstance(match(linear_root(), snap, snap.node("lin")), Failure)  # only where a rule asks
    m = _match(snap, linear_root(weight_in_out=Const("w_io")))
    lin = linear_of(m)
    assert lin.in_out and lin.t is None and m.bindings["w_io"] == Source(key="w", spec=spec(8, 6))
    assert lin.stored_spec(snap) == spec(8, 6) and "w" not in m.bindings
    with pytest.raises(ValueError, match="lin reads its weight stored \\(in, out\\): no node holds it"):
        _ = lin.weight
    p = Planner("t", m)
    out = emit_linear(p, lin, NodeRef("w2"), NodeRef("b2"), out_features=4)
    made = p.finish([]).nodes
    product = next(n for n in made if n.name == "lin_new")
    if not transpose:
        assert [n.name for n in made] == ["lin_new"] and out.name == "lin_new"
        assert (product.target, product.args) == ("aten.linear.default", (NodeRef("x"), NodeRef("w2"), NodeRef("b2")))
        return
    t = made[0]
    assert (t.name, t.target, t.args, t.spec, t.provenance) == (
        "lin_new_t",
        transpose,
        (NodeRef("w2"), (1, 0)),
        spec(8, 4),
        "lin",
    )
    x = NodeRef("x" if rank == 2 else "lin_in")  # (the flattening reshape, as it is)
    assert (product.target, product.args) == ("aten.addmm.default", (NodeRef("b2"), x, NodeRef("lin_new_t")))
    assert out.name == ("lin_new" if rank == 2 else "lin_out_new")


def test_a_product_of_constants_computes_a_weight_and_is_no_linear() -> None:
    # a hunt (forty-eighth session): a merged LoRA's B @ A, the weight of a linear, was a linear
    # itself; linear-to-conv2d made it a 1x1 conv of constants (no later fold could read the weight)
    # and fold-binary declined the W + B @ A that reads it
    from fxpure.rules.fold_binary import fold_binary

    g = GraphBuilder()
    x, w, a, b = g.input("x", (3, 8)), g.parameter("w", (5, 8)), g.parameter("a", (2, 8)), g.parameter("b", (5, 2))
    lora = g.call("aten.mm.default", name="lora", self=b, mat2=a, out=(5, 8))
    merged = g.call("aten.add.Tensor", name="merged", self=w, other=lora, out=(5, 8))
    y = g.call("aten.linear.default", name="lin", input=x, weight=merged, out=(3, 5))
    g.output(g.call("aten.mul.Tensor", name="scaled", self=y, other=2.0, out=(3, 5)))
    snap = g.build()
    assert not is_linear(snap, snap.node("lora")) and is_linear(snap, snap.node("lin"))
    for r, anchor in ((linear_to_conv2d(), "lin"), (fold_binary(), "scaled")):
        report = plan(snap, [r])
        assert [p.anchor for p in report.plans] == [anchor] and report.rejections == ()
    # its operands given by name, as a hand-made graph may (a review)
    g = GraphBuilder()
    a, b = g.parameter("a", (2, 8)), g.parameter("b", (5, 2))
    g.output(g.node("aten.mm.default", (), {"self": b, "mat2": a}, name="lora", out=(5, 8)))
    snap = g.build()
    assert not is_linear(snap, snap.node("lora"))


def test_a_linear_of_a_constant_input_is_a_linear() -> None:
    # a review: a learned query through a linear, q @ W.T, decomposed to mm(q, t(W)), was taken for a
    # weight's computation (two constants), and its scale no longer folded
    from fxpure.rules.fold_binary import fold_binary

    g = GraphBuilder(decomposed=True)
    x, q, w = g.input("x", (3, 5)), g.parameter("q", (3, 8)), g.parameter("w", (5, 8))
    wt = g.call("aten.permute.default", name="wt", self=w, dims=(1, 0), out=(8, 5))
    y = g.call("aten.mm.default", name="proj", self=q, mat2=wt, out=(3, 5))
    scaled = g.call("aten.mul.Tensor", name="scaled", self=y, other=2.0, out=(3, 5))
    g.output(g.call("aten.add.Tensor", name="out", self=x, other=scaled, out=(3, 5)))
    snap = g.build()
    assert is_linear(snap, snap.node("proj"))
    assert [p.anchor for p in plan(snap, [fold_binary()]).plans] == ["scaled"]

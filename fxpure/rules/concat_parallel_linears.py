"""concat_parallel_linears: linears reading one input  =>  one linear on the concatenated weights,
its output cut back along the last dim.

    q = x @ Wq.T + bq,  k = x @ Wk.T,  v = x @ Wv.T + bv
      =>  qkv = x @ cat(Wq, Wk, Wv).T + cat(bq, 0, bv);  q, k, v = qkv[..., :|q|], qkv[..., |q|:|q|+|k|], ...

A multi-anchor rule: a candidate is a node read as the input by two or more linears, in any
spelling ``fxpure.linear`` knows (aten ``linear``; edge ``permute_copy`` + ``addmm``/``mm``,
wrapped in ``view_copy`` for rank > 2; edge with ``linear`` preserved; a weight stored (in, out),
``x @ W``, GPT-2's ``Conv1D``, joins as its transpose). Any number of them,
of any output sizes, with or without bias, join. A linear of the group that cannot join is
rejected at its own product node with its reason, and the others still join if two or more
remain; the shared input ends as the plan or as a rejection (``too-few-linears``, say).

Linears reading equal views of one value (the same view op and sizes of it, or of equal views;
an aten program's ``flatten`` with the same dims) read one input: ``to_edge`` gives each linear its
own ``view_copy`` chain of a value the program wrote in place (``h += pos``). Unless one of them is
written: in an aten program a view shares its storage, and a write between two views changes what
the later one reads. So do linears reading equal copies of one value (decompositions and edge
copy a non-contiguous rank 4 input once per linear: expand, clone, view, ``bmm``), or equal
dequantizes of one value (PT2E gives each linear its own); a weight dequantized at run time is no
constant to join (``not-constant``: joined, int8 weights would become one float weight).
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import final

from returns.result import Failure, Result, Success

from fxpure import layout
from fxpure.families import ADDMM, BMM, CLONE, DEQUANTIZE, EXPAND, FLATTEN, LINEAR, MATMUL, MM, VIEW
from fxpure.layout import layout_reader
from fxpure.linear import Linear, emit_linear, is_linear, linear_of, linear_root
from fxpure.pattern import Const, Match, Planner, Var, match
from fxpure.plan import RUNS_EXHAUSTED, RewritePlan
from fxpure.reasons import GENERIC_CODES, Declined, Malformed, OutputShared, Reason, SymbolicShape
from fxpure.snapshot import Arg, GraphSnapshot, NodeRef, NodeSnapshot, TensorSpec, snapshot
from fxpure.weights import Concat, Fill, Permute, WeightExpr, infer_spec

NAME = "concat-parallel-linears"

PRODUCTS = LINEAR.targets | ADDMM.targets | MM.targets | MATMUL.targets | BMM.targets
MATMULS = ADDMM.targets | MM.targets

# a linear in any spelling, its weight and bias unchecked: which input it reads; or one whose weight
# is stored (in, out), x @ W, that weight a constant (a product of two activations is no linear)
FOUND = linear_root(weight=Var("w"), bias=Var("b"), weight_in_out=Const("w_io"))
# the same linear with a constant weight and bias: one that can join
JOINS = linear_root(weight_in_out=Const("w_io"))

CODES = GENERIC_CODES | {
    # a linear's own pattern declines a malformed spelling (a weight's permute of other dims: found
    # by the fuzz test of malformed graphs, whose report named a code the rule did not list)
    "arg-mismatch",
    RUNS_EXHAUSTED,
    "too-few-linears",
    "dtype-mismatch",
    "bias-not-per-channel",
    "not-constant",
    "symbolic-shape",
    "output-shared",
    layout.CODE,
}


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class _Member:
    """A linear that joins: its match and nodes, weight, bias (None: none), output spec and size."""

    match: Match
    lin: Linear
    w: WeightExpr
    b: WeightExpr | None
    spec: TensorSpec
    features: int


def _owner(snap: GraphSnapshot, node: NodeSnapshot, joins: Result[Match, Reason]) -> tuple[str, Reason | None] | None:
    """The input the linear at ``node`` (its product) reads, or None if it is no linear; with a
    reason when it cannot join whatever its weights: an edge product reading a flattening of the
    input whose flat output is read by more than the reshape back (rank > 2). ``joins``: the
    product matched as a linear that can join (the same input, when it is one)."""
    found = joins if isinstance(joins, Success) else match(FOUND, snap, node)
    if isinstance(found, Success):
        x = found.unwrap().bindings.get("x")
    else:  # a linear but for a number (addmm's alpha or beta not 1) still reads its input; else no linear
        x = _operand(snap, node) if found.failure().code == "arg-mismatch" else None
    if not isinstance(x, NodeRef):
        return None
    readers = snap.users.get(node.name, ())
    flat = snap.node(x.name)
    if node.target in MATMULS and flat.target in VIEW.targets and len(readers) > 1:
        source = VIEW.bind(snap, flat).map(lambda a: a.get("self")).value_or(None)
        back = next((r for r in readers if snap.node(r).target in VIEW.targets), None)
        if back is not None and isinstance(source, NodeRef):
            return source.name, OutputShared(node=node.name, users=tuple(r for r in readers if r != back))
    return x.name, None


def _operand(snap: GraphSnapshot, node: NodeSnapshot) -> Arg:
    """The input of a product the linear pattern matches but for a number (an ``addmm`` whose
    ``alpha`` or ``beta`` is not 1): its operand, or what that flattens where the product's one user
    reshapes it back, as the pattern would bind it. Its group says why it cannot join."""
    operand = node.arg(*_OPERAND[node.target])
    readers = snap.users.get(node.name, ())
    if type(operand) is NodeRef and len(readers) == 1 and snap.node(readers[0]).target in VIEW.targets:
        flat = snap.node(operand.name)
        if flat.target in VIEW.targets and flat.args:
            return flat.args[0]
    return operand


def _fit(
    node: str, w: TensorSpec | None, b: TensorSpec | None, out: TensorSpec | None, x: TensorSpec, bias_at: str
) -> Reason | None:
    """Static output features, a (out, in) weight and an (out,) bias (``bias_at``: its path), all
    in the input's dtype."""
    if out is None or not out.shape or w is None:
        return Malformed(node=node, detail=f"{node} has no known output or weight shape")
    if not isinstance(out.shape[-1], int):
        return SymbolicShape(node=node, role="output", shape=out.shape)
    # torch takes a bias that broadcasts to the output ((), (1,), (N, out), ...): no per-feature one
    broadcasts = b is not None and _broadcasts(b.shape, out.shape)
    if w.shape != (out.shape[-1], x.shape[-1]) or (b is not None and b.shape != w.shape[:1] and not broadcasts):
        shapes = f"weight {w.shape}, bias {b.shape if b else None}, output {out.shape}, input {x.shape}"
        return Malformed(node=node, detail=f"{node} does not compute a linear: {shapes}")
    if b is not None and b.shape != w.shape[:1]:
        detail = f"{node}: bias {b.shape} is not one value per output feature {w.shape[:1]}"
        return Declined(code="bias-not-per-channel", node=node, detail=detail, path=bias_at)
    dtypes = {w.dtype, out.dtype, *([b.dtype] if b is not None else [])}
    if dtypes != {x.dtype}:
        detail = f"{node} computes in {', '.join(sorted(dtypes))}, its input is {x.dtype}"
        return Declined(code="dtype-mismatch", node=node, detail=detail)
    return None


def _broadcasts(shape: tuple[int | str, ...], to: tuple[int | str, ...]) -> bool:
    """``shape`` broadcasts to ``to`` (each trailing dim 1 or equal)."""
    return len(shape) <= len(to) and all(a in (1, b) for a, b in zip(reversed(shape), reversed(to), strict=False))


def _join(node: NodeSnapshot, joins: Result[Match, Reason], x: TensorSpec) -> Result[_Member, Reason]:
    """The linear at ``node`` (matched as ``joins``) as a member of its group, or the typed reason it
    cannot join."""
    if isinstance(joins, Failure):
        return Failure(joins.failure())  # not-constant: a weight or bias computed at run time, say
    m = joins.unwrap()
    lin, w, b, w_spec = linear_of(m), m.bindings.get("w"), m.bindings.get("b"), m.spec("w")
    stored = m.bindings.get("w_io")
    if isinstance(stored, WeightExpr):  # (in, out): its transpose joins
        w = Permute(x=stored, dims=(1, 0))
        w_spec = infer_spec(w).value_or(None)
    assert isinstance(w, WeightExpr) and (b is None or isinstance(b, WeightExpr))  # Const binds expressions
    out = lin.spec
    # a slice of the joined output has other strides than the linear's own output
    at = m.sites["lin_out" if lin.view_out else "lin"].path
    bias_at = m.sites["b"].path if "b" in m.sites else ""
    reason = _fit(node.name, w_spec, m.spec("b"), out, x, bias_at) or layout_reader(m.snap, lin.outer.name, path=at)
    if reason is not None:
        return Failure(reason)
    assert out is not None and isinstance(out.shape[-1], int)  # checked by _fit
    return Success(_Member(match=m, lin=lin, w=w, b=b, spec=out, features=out.shape[-1]))


def _input_spec(snap: GraphSnapshot, x: str) -> Result[TensorSpec, Reason]:
    """The shared input's spec, with a static feature size."""
    spec = snap.node(x).tensor_spec
    if spec is None or not spec.shape:
        return Failure(Malformed(node=x, detail=f"{x} has no known shape"))
    if not isinstance(spec.shape[-1], int):
        return Failure(SymbolicShape(node=x, role="input features", shape=spec.shape))
    return Success(spec)


# stands in for the snapshot in a match the rule keeps (a kept match must not keep its snapshot alive)
_DETACHED = snapshot([], {})


def _on(m: Match, snap: GraphSnapshot) -> Match:
    """``m`` reading ``snap`` (built directly: ``dataclasses.replace`` costs several times more, once
    per linear)."""
    return Match(snap=snap, anchor=m.anchor, bindings=m.bindings, sites=m.sites, erase=m.erase, prune=m.prune)


def _attach(member: _Member, snap: GraphSnapshot) -> _Member:
    return _Member(
        match=_on(member.match, snap),
        lin=member.lin,
        w=member.w,
        b=member.b,
        spec=member.spec,
        features=member.features,
    )


@final
@dataclass(slots=True)
class _Found:
    """The linears of one snapshot, found once for ``anchors`` and every ``plan_at`` on it: each
    product's input (the first of equal ones, and why it cannot join whatever its weights), the
    products of each input in order, and each linear as a member of its group (found on demand,
    kept detached from the snapshot: nothing here keeps it alive)."""

    owners: dict[str, tuple[str, Reason | None]]
    groups: dict[str, list[NodeSnapshot]]
    joins: dict[str, Result[Match, Reason]]  # each product matched as a linear that can join
    members: dict[str, Result[_Member, Reason]]

    def _kept(self, snap: GraphSnapshot, node: NodeSnapshot, x: TensorSpec) -> Result[_Member, Reason]:
        kept = self.members.get(node.name)
        if kept is None:
            own = self.owners[node.name][1]
            found = (
                Failure(own) if own is not None else _join(node, self.joins[node.name].map(lambda m: _on(m, snap)), x)
            )
            kept = self.members[node.name] = found.map(lambda m: _attach(m, _DETACHED))
        return kept

    def member(self, snap: GraphSnapshot, node: NodeSnapshot, x: TensorSpec) -> Result[_Member, Reason]:
        """The linear at ``node`` as a member of its group (input ``x``), or why it cannot join."""
        return self._kept(snap, node, x).map(lambda m: _attach(m, snap))

    def why(self, snap: GraphSnapshot, node: NodeSnapshot, x: TensorSpec) -> Reason | None:
        """Why the linear at ``node`` cannot join (its own reason, else its weights'), or None
        (the member itself is not attached: only the plan reads it)."""
        return self._kept(snap, node, x).swap().value_or(None)


# the operand of each product that is the linear's input (or the flattening of it)
_OPERAND: Mapping[str, tuple[int, str]] = {
    **{t: (0, "input") for t in LINEAR.targets},
    **{t: (1, "mat1") for t in ADDMM.targets},
    **{t: (0, "self") for t in MM.targets | MATMUL.targets | BMM.targets},
}


def _inputs(snap: GraphSnapshot, node: NodeSnapshot) -> tuple[str, ...]:
    """What the input of the product at ``node`` can be: its operand, and what that reshapes."""
    operand = node.arg(*_OPERAND[node.target])
    if type(operand) is not NodeRef or operand.name not in snap.index:
        return ()
    source = snap.node(operand.name)
    inner = source.args[0] if source.target in VIEW.targets and source.args else None
    return (operand.name, inner.name) if type(inner) is NodeRef else (operand.name,)


# (an aten program's x.flatten(0, 1) is a reshape too: two of one value with the same dims are one input;
# so are two copies of one value, which decompositions and edge write in each linear's expand, clone and
# view of a rank 4 input that is not contiguous, and two dequantizes of one quantized value with the same
# parameters, one per linear in PT2E)
_VIEWS = VIEW.targets | FLATTEN.targets | EXPAND.targets | CLONE.targets | DEQUANTIZE.targets


def _viewed(snap: GraphSnapshot, node: NodeSnapshot) -> NodeRef | None:
    """What ``node`` is a view (a reshape or flatten, or an expand: a ``bmm``'s input) of, if it is a view of a
    value the program does not write in place (in an aten program a view shares its storage: a
    write between two views changes what the later one reads)."""
    source = node.args[0] if node.target in _VIEWS and node.args else None
    if type(source) is not NodeRef or node.name in snap.written or source.name in snap.written:
        return None
    return source


@final
@dataclass(slots=True)
class _Values:
    """Which nodes compute one value: a view (a copy, a dequantize) of a value is the same value as
    the first view of it with the same op and sizes (``same``: each node's first; ``first``: by
    (op, value, sizes, kwargs)), unless the program writes a tensor of its chain (``moved``: then
    each node of the chain is its own value, as a view or copy taken after the write reads another)."""

    snap: GraphSnapshot
    same: dict[str, str] = field(default_factory=dict)
    first: dict[tuple[object, ...], str] = field(default_factory=dict)
    moved: set[str] = field(default_factory=set)

    def of(self, name: str) -> str:
        """The first node computing the value of ``name`` (itself unless it is a view, copy or
        dequantize of a value). A chain of them is walked up once, without recursion."""
        known = self.same.get(name)
        if known is not None:
            return known
        chain, at, written = [], name, self.snap.written
        while at not in self.same:
            node = self.snap.node(at)
            source = _viewed(self.snap, node)
            if source is None:
                self.same[at] = at
                # the top of the chain: written, or a view or copy of a written tensor (the program
                # records a write through a view at the tensor viewed: h, not h.view(...))
                above = node.args[0] if node.target in _VIEWS and node.args else None
                if at in written or (type(above) is NodeRef and above.name in written):
                    self.moved.add(at)
                break
            chain.append((node, source.name))
            at = source.name
        moved = at in self.moved
        for node, of in reversed(chain):
            if moved:
                self.same[node.name] = node.name
                self.moved.add(node.name)
                continue
            key = (node.target, self.same[of], node.args[1:], tuple(sorted(node.kwargs.items())))
            self.same[node.name] = self.first.setdefault(key, node.name)
        return self.same[name]


def _views(snap: GraphSnapshot, name: str) -> list[str]:
    """``name`` and what it is a view of, while each is a view of a value the program does not write."""
    out, node = [], snap.node(name)
    while (source := _viewed(snap, node)) is not None:
        out.append(node.name)
        node = snap.node(source.name)
    return out


def _find(snap: GraphSnapshot) -> _Found:
    owners: dict[str, tuple[str, Reason | None]] = {}
    groups: dict[str, list[NodeSnapshot]] = {}
    joins: dict[str, Result[Match, Reason]] = {}
    values = _Values(snap)
    products = [n for n in snap.calls(PRODUCTS) if is_linear(snap, n, in_out=True)]  # not attention's q @ k.T
    # a product whose input no other product can share is matched not at all (each match costs)
    inputs = [(n, {values.of(x) for x in _inputs(snap, n)}) for n in products]
    readers = Counter(v for _, vs in inputs for v in vs)
    for n, vs in inputs:
        if all(readers[v] < 2 for v in vs):
            continue
        joined = match(JOINS, snap, n)  # one match per linear: it also says which input it reads
        owner = _owner(snap, n, joined)
        if owner is not None:
            x = values.of(owner[0])  # the group's name: the first node of its input's value
            owners[n.name] = (x, owner[1])
            groups.setdefault(x, []).append(n)
            joins[n.name] = joined.map(lambda m: _on(m, _DETACHED))
    return _Found(owners, groups, joins, {})


def _plan_group(
    snap: GraphSnapshot, found: _Found, x: str, linears: Sequence[NodeSnapshot], split: bool
) -> Result[RewritePlan, Reason]:
    """The plan joining the linears of ``x`` that can join, or why fewer than two can."""
    spec = _input_spec(snap, x)
    if isinstance(spec, Failure):
        return Failure(spec.failure())
    results = [(n.name, found.member(snap, n, spec.unwrap())) for n in linears]
    members = [r.unwrap() for _, r in results if isinstance(r, Success)]
    if len(members) >= 2:
        return Success(_plan(snap, x, members, split))
    why = "; ".join(f"{n}: {r.failure().code}" for n, r in results if isinstance(r, Failure))
    detail = f"{x} is read by {len(linears)} linears, {len(members)} of which can join ({why})"
    return Failure(Declined(code="too-few-linears", node=x, detail=detail))


def _parts(p: Planner, joined: NodeRef, members: Sequence[_Member], split: bool) -> list[NodeRef]:
    """Each linear's columns of the joined output: a slice each, or the getitems of one split."""
    dim, sizes = len(members[0].spec.shape) - 1, tuple(m.features for m in members)
    whole = None
    if split:
        specs, name = tuple(m.spec for m in members), f"{members[0].lin.op.name}_split"
        whole = p.call(
            "aten.split_with_sizes.default",
            name=name,
            spec=specs,
            source_fn="split",
            self=joined,
            split_sizes=sizes,
            dim=dim,
        )
    out = []
    for i, m in enumerate(members):
        a = sum(sizes[:i])
        target = "aten.slice.Tensor" if whole is None else "getitem"  # (slice_copy on edge)
        args: dict[str, Arg] = (
            {"self": joined, "dim": dim, "start": a, "end": a + sizes[i]}
            if whole is None
            else {"self": whole, "index": i}
        )
        # a part stands for its linear (module stack, stack trace), spelled as y[..., a:b] is
        name, of = f"{m.lin.op.name}_part", m.lin.op.name
        out.append(p.call(target, name=name, spec=m.spec, provenance=of, source_fn="getitem", **args))
    return out


def _plan(snap: GraphSnapshot, x: str, members: Sequence[_Member], split: bool) -> RewritePlan:
    # x -> linear(cat(W_i), cat(b_i or 0)) -> part_i (out_i columns, last dim) takes linear_i's uses
    members = sorted(members, key=lambda m: snap.index[m.lin.outer.name])
    first = members[0]  # the earliest output: its input and reshapes come before every replaced node
    p = Planner(NAME, first.match, also=[m.match for m in members[1:]], anchor=x)
    base = first.lin.op.name
    weight = Concat(xs=tuple(m.w for m in members), dim=0)
    zeros = [Fill(shape=(m.features,), value=0.0, dtype=m.spec.dtype) for m in members]
    bias = Concat(xs=tuple(m.b if m.b is not None else z for m, z in zip(members, zeros, strict=True)), dim=0)
    has_bias = any(m.b is not None for m in members)
    total = sum(m.features for m in members)
    w, b = p.const(weight, f"{base}_cat_weight"), p.const(bias, f"{base}_cat_bias") if has_bias else None
    parts = _parts(p, emit_linear(p, first.lin, w, b, out_features=total, suffix="cat"), members, split)
    # the joined linear reads the first's input: the others' own views of it go once nothing reads them
    own = [m.match.bindings["x"] for m in members[1:]]
    views = [v for ref in dict.fromkeys(own) if isinstance(ref, NodeRef) for v in _views(snap, ref.name)]
    return p.finish([(m.lin.outer, part) for m, part in zip(members, parts, strict=True)], prune=views)


@final
@dataclass(frozen=True, slots=True)
class ConcatParallelLinears:
    """The rule (a ``fxpure.Rule``): its anchors are the inputs read by two or more linears, and
    each of their linears that cannot join (rejected there, with its reason)."""

    split: bool = False
    name: str = NAME
    codes: frozenset[str] = CODES
    # runs again while it joins: a linear whose output is the input of another group joins its own
    # group once that group's plan has taken the reshape that read its strides (``fxpure.plan.runs``)
    repeat: bool = True
    # the linears of the last snapshot planned on (anchors, then plan_at at each of them, all read
    # it); the snapshot is weakly held, and what was found on it is dropped when it goes: a rule
    # kept for years keeps no snapshot, nor anything of one, alive
    _last: list[tuple[weakref.ref[GraphSnapshot], _Found]] = field(
        default_factory=list, init=False, compare=False, repr=False
    )

    def _found(self, snap: GraphSnapshot) -> _Found:
        last = self._last[:1]  # read once: another thread may replace it (or a snapshot's end clear it)
        if last and last[0][0]() is snap:
            return last[0][1]
        found, kept = _find(snap), self._last

        def forget(gone: weakref.ref[GraphSnapshot]) -> None:
            entry = kept[:1]
            if entry and entry[0][0] is gone:
                kept.clear()

        kept[:] = [(weakref.ref(snap, forget), found)]
        return found

    def anchors(self, snap: GraphSnapshot) -> Iterable[NodeSnapshot]:
        """Every shared input, and every linear of one that cannot join, in topological order."""
        found = self._found(snap)
        shared = {x: ns for x, ns in found.groups.items() if len(ns) >= 2}
        out = [snap.node(x) for x in shared]
        # KIT-GAP: a plan carries no rejections of some of its group's members, so a linear that
        # cannot join is an anchor of its own, where its reason is reported
        for x, ns in shared.items():
            spec = _input_spec(snap, x)
            if isinstance(spec, Failure):
                continue  # the input is rejected for the whole group
            out.extend(n for n in ns if n.name not in shared and found.why(snap, n, spec.unwrap()) is not None)
        return sorted(out, key=lambda n: snap.index[n.name])

    def plan_at(self, snap: GraphSnapshot, node: NodeSnapshot) -> Result[RewritePlan, Reason]:
        """At a shared input: the plan (or why not); at one of its linears: why it cannot join."""
        found = self._found(snap)
        linears = found.groups.get(node.name, ())
        if len(linears) >= 2:
            return _plan_group(snap, found, node.name, linears, self.split)
        owner = found.owners.get(node.name)
        if owner is None or len(found.groups[owner[0]]) < 2:
            return Failure(Malformed(node=node.name, detail=f"{node.name} is not an anchor of {NAME}"))
        x = owner[0]
        spec = _input_spec(snap, x)
        reason = found.why(snap, node, spec.unwrap()) if isinstance(spec, Success) else owner[1]
        return Failure(reason or Malformed(node=node.name, detail=f"{node.name} joins the linears of {x} there"))


def concat_parallel_linears(*, split: bool = False) -> ConcatParallelLinears:
    """The parallel-linears rule: the linears reading one input become one linear whose output is
    sliced back into theirs. ``split=True``: one ``split_with_sizes`` (edge: ``_copy``) and its
    ``getitem``s instead of a slice per linear; ExecuTorch 1.5.1's edge verifier fixes a symbolic
    leading dim of a split's outputs to its example size (so after a later ``to_edge``, or an
    ``EdgeProgramManager.transform``, the .pte refuses other batch sizes), slices have no such issue.

    >>> sorted(concat_parallel_linears().codes - GENERIC_CODES)
    ['arg-mismatch', 'bias-not-per-channel', 'dtype-mismatch', 'layout-sensitive-reader', 'not-constant', \
'output-shared', 'runs-exhausted', 'symbolic-shape', 'too-few-linears']
    """
    return ConcatParallelLinears(split=split)

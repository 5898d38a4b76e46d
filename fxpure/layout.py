"""Readers that depend on a tensor's memory layout, for rules whose replacement may have other strides.

In the aten forms (a GraphModule, an aten ExportedProgram), ``aten.view`` keeps the storage: it runs
only if the input's strides allow the new shape, which they always do when the view only splits dims
(or adds and drops 1s), and may not when it merges dims. A replacement built from permutes and
squeezes (a linear as a 1x1 conv, a slice of a merged linear) computes the same values with other
strides, so such a view of it can fail at run time where the original ran. ``as_strided`` reads the
storage by strides: on other strides it reads other values. Edge spells views as copies
(``view_copy``), which take any strides. Most ops pass their input's strides on (an elementwise op, a
permute, a split view), so such a reader counts wherever it is downstream, until an op whose result
is laid out afresh (a matrix product, a layer norm).
"""

from __future__ import annotations

import weakref
from collections import Counter

from fxpure.reasons import Declined
from fxpure.snapshot import Dim, GraphSnapshot, NodeRef, NodeSnapshot, TensorSpec, ref_list

# views of a tensor in a shape (``view_as``: another tensor's; ``view.dtype``: its elements read as
# another dtype, of another size or not; ``view_as_complex``: pairs of floats as one complex) that
# run only where the input's strides allow them, as ``aten.view`` does
VIEWS = frozenset(
    {
        "aten.view.default",
        "aten._unsafe_view.default",
        "aten.view_as.default",
        "aten.view.dtype",
        "aten.view_as_complex.default",
    }
)
STRIDED = frozenset({"aten.as_strided.default", "aten.as_strided_copy.default"})
# ops whose result is contiguous whatever their inputs' strides: what comes after depends on them only
# (``contiguous`` lays its result out in the memory format it is asked for, its input's or a copy)
FRESH = frozenset(
    {
        "aten.contiguous.default",
        "aten.linear.default",
        "aten.addmm.default",
        "aten.mm.default",
        "aten.bmm.default",
        "aten.matmul.default",
        "aten.layer_norm.default",
        "aten.native_layer_norm.default",
    }
)
CODE = "layout-sensitive-reader"
# a control-flow op or a region (``torch.cond``, ``with torch.no_grad():``) runs a graph of its own
# on its operands: it counts as a reader of their strides
HIGHER_ORDER = "higher_order."


def only_splits(src: tuple[Dim, ...], dst: tuple[Dim, ...]) -> bool:
    """True when viewing shape ``src`` as ``dst`` only splits dims, keeps them, or adds and drops
    1s: a view any strides allow. A symbolic size splits when it is a product (``4*s0`` into
    ``s0, 2, 2``).

    >>> only_splits(("s0", 8, 12), ("s0", 8, 3, 4)), only_splits((2, 3), (6,)), only_splits((4,), (1, 4, 1))
    (True, False, True)
    >>> only_splits(("4*s0", 16), ("s0", 2, 2, 4, 4)), only_splits(("s0", "s1"), ("s0*s1",))
    (True, False)

    A tensor of no elements views as any shape, whatever its strides (a KV cache of length 0):

    >>> only_splits((2, 0, 4), (0, 4))
    True
    """
    if 0 in src or 0 in dst:
        return True
    a, b = [d for d in src if d != 1], [d for d in dst if d != 1]
    j = 0
    for d in a:
        if j < len(b) and b[j] == d:
            j += 1
            continue
        want, have = _factors(d), (1, Counter[str]())
        while want is not None and j < len(b) and have != want:
            part = _factors(b[j])
            if part is None:
                return False
            have = (have[0] * part[0], have[1] + part[1])
            j += 1
            if want[0] % have[0] or have[1] - want[1]:  # more than ``d`` holds: no split of it
                return False
        if have != want:
            return False
    return j == len(b)


def _factors(d: Dim) -> tuple[int, Counter[str]] | None:
    """A size as a number times a product of symbols (``4*s0``), or None if it is not one."""
    if isinstance(d, int):
        return d, Counter()
    parts = d.split("*")
    if not all(p.isdigit() or p.isidentifier() for p in parts):
        return None
    number = 1
    for p in parts:
        number *= int(p) if p.isdigit() else 1
    return number, Counter(p for p in parts if not p.isdigit())


# the same readers as a ``symbolic_trace`` GraphModule calls them: tensor methods (``x.view(-1)``) and
# torch functions (``torch.as_strided``), by name
BY_NAME = {
    "view": "aten.view.default",
    "view_as": "aten.view_as.default",
    "as_strided": "aten.as_strided.default",
    "view_as_complex": "aten.view_as_complex.default",
}


def _aten(node: NodeSnapshot) -> str:
    """The aten op a call stands for as a reader of strides: its own target, or that of a tensor
    method or torch function of one of :data:`BY_NAME` (another spelling stands for none)."""
    if node.op == "call_function" and node.target.startswith("aten."):
        return node.target
    if node.op in ("call_method", "call_function"):
        return BY_NAME.get(node.target.rsplit(".", 1)[-1], "")
    return ""


def _sensitive(reader: NodeSnapshot, src: TensorSpec | None) -> bool:
    """True when ``reader`` needs its input's own strides: ``as_strided``, or a view (of an input of
    spec ``src``) that may merge dims."""
    target = _aten(reader)
    if target in STRIDED:
        return True
    out = reader.tensor_spec
    return target in VIEWS and (src is None or out is None or not only_splits(src.shape, out.shape))


def layout_reader(snap: GraphSnapshot, name: str, *, path: str = "", views: bool = True) -> Declined | None:
    """Why node ``name``'s uses cannot move to a value of other strides: a reader that views it
    merging dims (unless ``views=False``: for a replacement whose strides only differ where the
    original's are not the default, a view works on both), or reads it by strides, directly or
    through ops that pass its strides on (``layout-sensitive-reader``), else None."""
    found = _exposed(snap, VIEWS | STRIDED if views else STRIDED).get(name)
    if found is None:
        return None
    reader, via = snap.node(found[0]), found[1]
    shape = reader.tensor_spec.shape if reader.tensor_spec is not None else "an unknown shape"
    read = f"{name} as {shape}" if via == name else f"{via} as {shape} (which has {name}'s strides)"
    if reader.target.startswith(HIGHER_ORDER):
        read = name if via == name else f"{via} (which has {name}'s strides)"
        read = f"{read} in a graph of its own, which may read it by its strides (fxpure does not look in)"
    else:
        read = f"{read} by its strides"
    detail = f"{reader.name} ({reader.target}) reads {read}, which the replacement may change"
    return Declined(code=CODE, node=name, detail=detail, path=path)


# ops that read a tensor's sizes or strides, not its values: they pass no strides on (besides FRESH)
SIZE_QUERIES = frozenset({"aten.sym_size.int", "aten.sym_numel.default", "aten.sym_stride.int"})


def passes_strides(node: NodeSnapshot) -> bool:
    """``node``'s result has its inputs' strides (an elementwise op, a view), as far as a reader of
    its strides is concerned: every call but :data:`FRESH` ones and :data:`SIZE_QUERIES` (in a
    ``symbolic_trace`` GraphModule also a tensor method's, but ``contiguous``, and a module's: fxpure
    does not look in)."""
    if node.op in ("call_method", "call_module"):
        return node.op == "call_module" or node.target != "contiguous"
    return node.op == "call_function" and node.target not in FRESH and node.target not in SIZE_QUERIES


def _named(node: NodeSnapshot, readers: frozenset[str]) -> bool:
    """``node`` is a tensor method or a torch function standing for one of ``readers``."""
    return (
        node.op in ("call_method", "call_function") and not node.target.startswith("aten.") and _aten(node) in readers
    )


# what _exposed found on the last snapshot asked about, by the readers it looked for (the rules ask
# about each candidate of one snapshot in turn); weakly held, as a rule's cache
_LAST: list[tuple[weakref.ref[GraphSnapshot], dict[frozenset[str], dict[str, tuple[str, str]]]]] = []


def _exposed(snap: GraphSnapshot, readers: frozenset[str]) -> dict[str, tuple[str, str]]:
    """Every node a reader among ``readers`` depends on the strides of: that reader (a merging
    view, as_strided) and the node it reads, the node itself or one downstream that passed its
    strides on. Found once per snapshot, walking up from the few such readers (none on most
    programs)."""
    last = _LAST[:1]
    if last and last[0][0]() is snap:
        known = last[0][1]
    else:
        known = {}
        _LAST[:] = [(weakref.ref(snap), known)]
    if readers in known:
        return known[readers]
    out: dict[str, tuple[str, str]] = {}
    todo: list[str] = []
    # (a GraphModule may spell them as methods or torch functions: found by a look at every node)
    named = [n for n in snap.nodes if _named(n, readers)] if not snap.lifted else []
    for r in [*snap.calls(readers), *named]:
        x = r.args[0] if r.args else None
        if isinstance(x, NodeRef) and x.name not in out and _sensitive(r, snap.node(x.name).tensor_spec):
            out[x.name] = (r.name, x.name)
            todo.append(x.name)
    for r in snap.calls(t for t in snap.targets if t.startswith(HIGHER_ORDER)):
        for name in ref_list(r):
            spec = snap.node(name).tensor_spec
            if name not in out and not (spec is not None and spec.shape == ()):  # (a predicate has no strides)
                out[name] = (r.name, name)
                todo.append(name)
    while todo:
        m = snap.node(todo.pop())
        if not passes_strides(m):
            continue
        for p in ref_list(m):
            if p not in out:
                out[p] = out[m.name]
                todo.append(p)
    known[readers] = out
    return out

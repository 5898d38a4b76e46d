"""Readers that depend on a tensor's memory layout, for rules whose replacement may have other strides.

In the aten forms (a GraphModule, an aten ExportedProgram), ``aten.view`` keeps the storage: it runs
only if the input's strides allow the new shape, which they always do when the view only splits dims
(or adds and drops 1s), and may not when it merges dims. A replacement built from permutes and
squeezes (a linear as a 1x1 conv, a slice of a merged linear) computes the same values with other
strides, so such a view of it can fail at run time where the original ran. ``as_strided`` reads the
storage by strides: on other strides it reads other values. Edge spells views as copies
(``view_copy``), which take any strides.
"""

from __future__ import annotations

from fxpure.reasons import Declined
from fxpure.snapshot import Dim, GraphSnapshot, NodeSnapshot, TensorSpec

VIEWS = frozenset({"aten.view.default", "aten._unsafe_view.default"})
STRIDED = frozenset({"aten.as_strided.default"})
CODE = "layout-sensitive-reader"


def only_splits(src: tuple[Dim, ...], dst: tuple[Dim, ...]) -> bool:
    """True when viewing shape ``src`` as ``dst`` only splits dims, keeps them, or adds and drops
    1s: a view any strides allow.

    >>> only_splits(("s0", 8, 12), ("s0", 8, 3, 4)), only_splits((2, 3), (6,)), only_splits((4,), (1, 4, 1))
    (True, False, True)
    """
    a, b = [d for d in src if d != 1], [d for d in dst if d != 1]
    j = 0
    for d in a:
        if j < len(b) and b[j] == d:
            j += 1
            continue
        product = 1
        while isinstance(d, int) and j < len(b) and product < d:
            part = b[j]
            if not isinstance(part, int):
                return False
            product *= part
            j += 1
        if product != d:
            return False
    return j == len(b)


def sensitive(reader: NodeSnapshot, src: TensorSpec | None) -> bool:
    """True when ``reader`` needs its input's own strides: ``as_strided``, or a view (of an input of
    spec ``src``) that may merge dims."""
    if reader.target in STRIDED:
        return True
    out = reader.tensor_spec
    return reader.target in VIEWS and (src is None or out is None or not only_splits(src.shape, out.shape))


def layout_reader(snap: GraphSnapshot, name: str, *, path: str = "") -> Declined | None:
    """Why node ``name``'s uses cannot move to a value of other strides: a reader that views it
    merging dims, or reads it by strides (``layout-sensitive-reader``), else None."""
    src = snap.node(name).tensor_spec
    for u in snap.users_of(name):
        if sensitive(u, src):
            return declined(u, name, path=path)
    return None


def declined(reader: NodeSnapshot, name: str, *, path: str) -> Declined:
    """The reason: ``reader`` reads ``name`` by its strides."""
    shape = reader.tensor_spec.shape if reader.tensor_spec is not None else "an unknown shape"
    detail = f"{reader.name} ({reader.target}) reads {name} as {shape} by its strides, which the replacement changes"
    return Declined(code=CODE, node=name, detail=detail, path=path)

"""fxpure.testing: hand-made snapshots for planner tests, without torch.

>>> from fxpure.testing import GraphBuilder
>>> g = GraphBuilder()
>>> x = g.input("x", (1, 4, 8, 8))
>>> w = g.parameter("w", (8, 4, 3, 3))
>>> y = g.call("aten.conv2d.default", input=x, weight=w, out=(1, 8, 6, 6))
>>> g.output(y)
>>> snap = g.build()
>>> snap.node("conv2d").args, snap.outputs
((NodeRef(name='x'), NodeRef(name='w')), ('conv2d',))

Calls name their target canonically and their arguments by schema name (the schemas of
``fxpure.families``, or ``GraphBuilder(schemas=...)`` for others); constants are lifted placeholders or,
with ``lifted=False``, ``get_attr`` nodes, as in the program forms the adapters capture.

What the builder does not do for you, as capture finds it in a real program: an edge program
(``dialect="edge"``) holds no number where an op takes a tensor (``to_edge`` lifts ``y * 2.0`` as a
0-d float32 buffer, and an int through a ``_to_dim_order_copy``), so build ``g.buffer("c", ())``
there; a small integer vector (zero points), or such a 0-d number, has known values only if given
``values=``, as capture records them (without, a rule finds them unknown and may take another path).
Nor does it check a node's target against what the program form allows: an edge program takes Core
ATen ops (``aten.convolution``, not ``aten.conv2d`` or ``aten.linear``), and a plan writing another
is declined ``op-not-allowed`` by the adapter, on the real program only.

``evaluate(expr, values)`` computes a plan's new constant from values given as nested lists, as the
adapter's torch would (:mod:`fxpure.evaluate`): a planner test checks the numbers a plan derives.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias

from pyrsistent import pmap
from returns.result import Failure

from fxpure.evaluate import Nested, evaluate
from fxpure.families import SCHEMAS, Family
from fxpure.schema import Schema, arguments
from fxpure.snapshot import (
    Arg,
    ConstantInfo,
    ConstantKind,
    DTypeArg,
    GraphSnapshot,
    NodeRef,
    NodeSnapshot,
    Spec,
    TensorSpec,
    snapshot,
    verify,
)

__all__ = ["GraphBuilder", "Nested", "evaluate", "spec"]

Shape: TypeAlias = tuple[int | str, ...]
Out: TypeAlias = Shape | TensorSpec | tuple[TensorSpec | None, ...] | None
Value: TypeAlias = Arg | list["Value"] | tuple["Value", ...]
"""An argument as a test writes it: a list is held as a tuple, as a captured program holds it."""


def spec(*shape: int | str, dtype: str = "float32") -> TensorSpec:
    """A tensor spec; ``spec(8, "s0", dtype="int8")``.

    >>> spec(2, "s0")
    TensorSpec(shape=(2, 's0'), dtype='float32')
    """
    return TensorSpec(shape=shape, dtype=dtype)


def _spec(out: Out) -> Spec:
    """A shape (float32), a spec, or a spec per element of a tuple output (None: unknown, but not
    all of them); ValueError for anything else."""
    if out is None or isinstance(out, TensorSpec):
        return out
    dims = tuple(d for d in out if isinstance(d, int | str) and not isinstance(d, bool))
    if len(dims) == len(out):
        return TensorSpec(shape=dims, dtype="float32")
    if all(isinstance(o, TensorSpec | None) for o in out) and any(out):
        return tuple(o if isinstance(o, TensorSpec) else None for o in out)
    raise ValueError(f"out={out!r}: give a shape, a spec, or a spec (or None) per element of a tuple output")


class GraphBuilder:
    """Builds a ``GraphSnapshot`` node by node; each method returns a reference to the new node."""

    def __init__(
        self,
        *,
        dialect: str = "aten",
        lifted: bool = True,
        decomposed: bool = False,
        schemas: Sequence[Schema | Family] = (),
    ) -> None:
        """``decomposed``: the graph is of Core ATen ops, as an aten ExportedProgram after
        ``run_decompositions()`` is (an edge one always is: ``GraphSnapshot.decomposed``).
        ``schemas``: the schemas of other ops than ``fxpure.families``', or families of them (an
        author's own: every spelling)."""
        self.dialect, self.lifted, self.decomposed = dialect, lifted, decomposed
        own = [t for s in schemas for t in (s.schemas.values() if isinstance(s, Family) else (s,))]
        self.schemas: dict[str, Schema] = {**SCHEMAS, **{s.target: s for s in own}}
        self._consts: list[NodeSnapshot] = []
        self._inputs: list[NodeSnapshot] = []
        self._calls: list[NodeSnapshot] = []
        self._infos: dict[str, ConstantInfo] = {}
        self._output: NodeSnapshot | None = None
        self._counts: dict[str, int] = {}
        self._least: dict[str, int] = {}

    def _name(self, name: str | None, base: str) -> str:
        if name is not None:
            return name
        n = self._counts.get(base, 0)
        self._counts[base] = n + 1
        return base if n == 0 else f"{base}_{n}"

    def size(self, name: str, *, least: int) -> str:
        """A symbolic size the program declares to be ``least`` or more (as ``Dim(name, min=least)``
        does); returns its name, to use in shapes. An undeclared one may be 0."""
        self._least[name] = least
        return name

    def input(self, name: str, shape: Shape, dtype: str = "float32") -> NodeRef:
        """A user input (placeholder)."""
        self._inputs.append(NodeSnapshot(name=name, op="placeholder", target=name, spec=spec(*shape, dtype=dtype)))
        return NodeRef(name)

    def constant(
        self,
        name: str,
        shape: Shape,
        dtype: str = "float32",
        *,
        kind: ConstantKind = "constant",
        key: str | None = None,
        values: Sequence[int | float] | None = None,
        storage: str | None = None,
        lifted: bool | None = None,
    ) -> NodeRef:
        """A constant tensor of ``kind``: a lifted placeholder, or ``get_attr`` when not lifted.
        ``values``: the data of a small integer vector (zero points) or of a 0-d tensor (a number
        ``to_edge`` lifted); ``storage``: give two constants one storage to make them aliases."""
        lift = self.lifted if lifted is None else lifted
        s = spec(*shape, dtype=dtype)
        self._consts.append(NodeSnapshot(name=name, op="placeholder" if lift else "get_attr", target=name, spec=s))
        self._infos[name] = ConstantInfo(
            kind=kind,
            key=key or name,
            spec=s,
            storage=storage,
            values=tuple(values) if values is not None else None,
        )
        return NodeRef(name)

    def parameter(
        self, name: str, shape: Shape, dtype: str = "float32", *, key: str | None = None, storage: str | None = None
    ) -> NodeRef:
        """A parameter (see :meth:`constant`)."""
        return self.constant(name, shape, dtype, kind="parameter", key=key, storage=storage)

    def buffer(
        self,
        name: str,
        shape: Shape,
        dtype: str = "float32",
        *,
        key: str | None = None,
        values: Sequence[int | float] | None = None,
        storage: str | None = None,
    ) -> NodeRef:
        """A buffer (see :meth:`constant`)."""
        return self.constant(name, shape, dtype, kind="buffer", key=key, values=values, storage=storage)

    def call(
        self,
        target: str | Schema,
        /,
        *,
        name: str | None = None,
        out: Out = None,
        **values: Value,
    ) -> NodeRef:
        """A ``call_function`` node of a known target (or of the ``Schema`` given, such as
        ``MY_FAMILY.schemas[target]``); arguments by name as patterns and ``Planner.call`` give them:
        the family's (the schema's own where the family does not rename it: ``scale``, not
        ``dequantize_per_channel``'s ``scales``; ValueError for one it has not, saying what its
        family calls it, or a required one left out), ``out`` its output shape (float32), or spec, or a tuple
        of specs for a tuple-output op. A dtype argument given by name (``dtype="int8"``) is a
        ``DTypeArg``, as a captured program holds it."""
        known = target if isinstance(target, Schema) else self.schemas.get(target)
        if known is None:
            raise KeyError(f"no schema for {target}: give GraphBuilder(schemas=[parse_schema(...)]) or use node()")
        unknown = [a for a in values if a not in known.family_params]
        missing = [a for a in known.required if a not in values]
        if unknown or missing:
            said = {a: f" (its family calls it {known.rename[a]!r})" if a in known.rename else "" for a in unknown}
            wrong = [*(f"no argument {a!r}{said[a]}" for a in unknown), *(f"missing {a!r}" for a in missing)]
            has = ", ".join(sorted(known.family_params))
            raise ValueError(f"{known.target}: {', '.join(wrong)} (it has: {has}); node() takes any")
        params = known.family_params
        typed = {
            k: DTypeArg(name=v) if isinstance(v, str) and params[k].kind == "dtype" else v for k, v in values.items()
        }
        args, kwargs = arguments(known, {k: _tupled(v) for k, v in typed.items()})
        parts = known.target.split(".")
        base = parts[-2] if len(parts) >= 3 else known.target
        return self.node(known.target, args, kwargs, name=self._name(name, base), out=out)

    def node(
        self,
        target: str,
        args: tuple[Value, ...] = (),
        kwargs: Mapping[str, Value] | None = None,
        *,
        name: str,
        out: Out = None,
    ) -> NodeRef:
        """A ``call_function`` node with positional arguments as given (a list as a tuple, as a
        captured program holds it)."""
        self._calls.append(
            NodeSnapshot(
                name=name,
                op="call_function",
                target=target,
                args=tuple(_tupled(a) for a in args),
                kwargs=pmap({k: _tupled(v) for k, v in (kwargs or {}).items()}),
                spec=_spec(out),
            )
        )
        return NodeRef(name)

    def getitem(self, of: NodeRef, index: int, *, name: str | None = None, out: Out = None) -> NodeRef:
        """Element ``index`` of a tuple-output node."""
        return self.node("getitem", (of, index), name=self._name(name, "getitem"), out=out)

    def output(self, *results: Arg) -> None:
        """The graph's outputs."""
        self._output = NodeSnapshot(name="output", op="output", target="output", args=(tuple(results),))

    def build(self, *, reserved: Sequence[str] = (), written: Sequence[NodeRef | str] = ()) -> GraphSnapshot:
        """The snapshot, ordered as programs are: lifted constants before the inputs, ``get_attr``
        nodes after them, then the calls and the output; ValueError if it is no valid graph (two
        nodes of one name, a node read before it is defined or never). ``written``: the nodes whose
        tensor the program writes in place (an adapter finds them from the ops' schemas; here you
        say which: ``y.mul_(2)`` writes ``y``, ``y.view(-1).mul_(2)`` writes ``y`` through a view).
        A written constant, and any of its storage, is no constant, as capture makes it."""
        head = [*self._consts, *self._inputs] if self.lifted else [*self._inputs, *self._consts]
        nodes = [*head, *self._calls, *([self._output] if self._output else [])]
        names = {w.name if isinstance(w, NodeRef) else w for w in written}
        shared = {i.storage for k, i in self._infos.items() if k in names and i.storage is not None}
        snap = snapshot(
            nodes,
            {k: i for k, i in self._infos.items() if k not in names and (i.storage is None or i.storage not in shared)},
            dialect=self.dialect,
            lifted=self.lifted,
            decomposed=self.decomposed,
            reserved=reserved,
            least_sizes=self._least,
            written=names,
        )
        bad = verify(snap)
        if isinstance(bad, Failure):
            raise ValueError(f"not a graph: {bad.failure().message}")
        return snap


def _tupled(arg: Value) -> Arg:
    """``arg`` with every list in it a tuple."""
    return tuple(_tupled(a) for a in arg) if isinstance(arg, (list, tuple)) else arg

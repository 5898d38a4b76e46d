"""Immutable snapshot records of an FX graph, and their invariants."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import InitVar, dataclass, field, fields
from typing import TYPE_CHECKING, Literal, NamedTuple, TypeAlias, final

import pyrsistent
from pyrsistent import pmap, pvector
from pyrsistent.typing import PMap, PVector
from returns.result import Failure, Result, Success

from fxpure.frozen import FrozenDict
from fxpure.reasons import InvalidSnapshot

if TYPE_CHECKING:
    from fxpure.weights import WeightExpr

Dim: TypeAlias = int | str
"""A dimension: an int, or the name of a symbolic size such as ``"s0"``."""


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class TensorSpec:
    """Shape and dtype of a tensor, as ``meta["val"]`` says, without data.

    >>> TensorSpec(shape=(8, 3, 3, 3), dtype="float32").is_static
    True
    """

    shape: tuple[Dim, ...]
    dtype: str

    @property
    def is_static(self) -> bool:
        """True when no dimension is symbolic."""
        return all(isinstance(d, int) for d in self.shape)

    @property
    def numel(self) -> int:
        """Number of elements (symbolic dims count as 1).

        >>> TensorSpec(shape=(2, 3), dtype="int8").numel
        6
        """
        n = 1
        for d in self.shape:
            n *= d if isinstance(d, int) else 1
        return n


@final
@dataclass(frozen=True, slots=True)
class NodeRef:
    """A reference to another node of the same graph, by name."""

    name: str


@final
@dataclass(frozen=True, slots=True)
class DTypeArg:
    """A ``torch.dtype`` literal in an argument list, by canonical name."""

    name: str


@final
@dataclass(frozen=True, slots=True)
class Opaque:
    """A literal the core does not interpret (device, layout, ...), by repr."""

    text: str


Arg: TypeAlias = int | float | bool | str | NodeRef | DTypeArg | Opaque | tuple["Arg", ...] | None
"""An immutable argument tree; FX lists and tuples both become tuples."""

Spec: TypeAlias = TensorSpec | tuple[TensorSpec | None, ...] | None
"""What a node produces: one tensor, a tuple of them, or nothing known."""

ConstantKind: TypeAlias = Literal["parameter", "buffer", "constant"]


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class NodeSnapshot:
    """One FX node: op kind, canonical target, arguments, output spec."""

    name: str
    op: str
    target: str
    args: tuple[Arg, ...] = ()
    kwargs: PMap[str, Arg] = field(default_factory=lambda: pmap())
    spec: Spec = None
    provenance: str | None = None
    source_fn: str | None = None
    # the names the arguments read, in order, found once when the record is made (every rewrite
    # derives users from every node's reads: most nodes are the same records stage after stage)
    _reads: tuple[str, ...] = field(init=False, repr=False, compare=False, hash=False)
    # the arguments bound by name (``fxpure.schema.bind``) under the last schema asked: a node is
    # bound again and again (its candidate test, its match, the rules after), its record never changes
    _bound: tuple[object, object] | None = field(default=None, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        out = _collect(self.args, [])
        object.__setattr__(self, "_reads", tuple(_collect(self.kwargs.values(), out) if self.kwargs else out))

    def __getstate__(self) -> list[object]:
        """The record's fields, for a copy or a pickle: not the arguments bound (a cache of a schema's)."""
        return [None if f.name == "_bound" else getattr(self, f.name) for f in fields(self)]

    def __setstate__(self, state: list[object]) -> None:
        for f, value in zip(fields(self), state, strict=True):
            object.__setattr__(self, f.name, value)

    def arg(self, index: int, keyword: str) -> Arg:
        """Argument by position, else by keyword, else None.

        >>> NodeSnapshot(name="n", op="call_function", target="t", args=(1,)).arg(0, "a")
        1
        """
        if index < len(self.args):
            return self.args[index]
        return self.kwargs.get(keyword)

    @property
    def tensor_spec(self) -> TensorSpec | None:
        """The spec when the node produces exactly one tensor."""
        return self.spec if isinstance(self.spec, TensorSpec) else None


# integer vectors up to this size are held by value (zero points, index tables)
SMALL_VALUES = 4096


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class ConstantInfo:
    """A parameter / buffer / lifted constant / get_attr tensor behind a node.

    ``storage`` identifies the backing tensor so aliases are visible; ``source``
    is None for an existing tensor, or the expression of a derived one.
    ``values`` holds the data of a small integer vector (quantization zero
    points, say; at most :data:`SMALL_VALUES` of them), or of a 0-d tensor
    (a number an edge program lifts, ``x * 1.0``), so planners can check it;
    None for anything else.
    """

    kind: ConstantKind
    key: str
    spec: TensorSpec
    storage: str | None = None
    source: WeightExpr | None = None
    values: tuple[int | float, ...] | None = None


def refs(arg: Arg) -> Iterator[str]:
    """Names of the nodes an argument tree refers to.

    >>> list(refs((NodeRef("a"), 1, (NodeRef("b"), None))))
    ['a', 'b']
    """
    return iter(_collect((arg,), []))


def node_refs(node: NodeSnapshot) -> Iterator[str]:
    """Names of the nodes a node reads, in argument order."""
    return iter(ref_list(node))


def ref_list(node: NodeSnapshot) -> tuple[str, ...]:
    """``node_refs`` as a tuple, found when the node was made."""
    return node._reads


def _collect(args: Iterable[Arg], out: list[str]) -> list[str]:
    for a in args:
        if type(a) is NodeRef:  # exact types: cheaper than isinstance, and NodeRef is final
            out.append(a.name)
        elif type(a) is tuple:
            _collect(a, out)
    return out


@final
class KnownConstants(NamedTuple):
    """What :class:`GraphSnapshot` derives from its constants: their names, their keys, the
    derived ones by expression, and the expressions several of them may hold."""

    names: frozenset[str]
    keys: frozenset[str]
    derived: Mapping[WeightExpr, str]
    shared: frozenset[WeightExpr] = frozenset()


_SHOWN = 8
"""How many node names a snapshot's ``repr`` shows."""


@final
@dataclass(frozen=True, slots=True, kw_only=True, weakref_slot=True)
class GraphSnapshot:
    """A whole graph: nodes in topological order, users, constants, dialect.

    ``lifted`` says whether constants are placeholders (ExportedProgram) or
    ``get_attr`` nodes (GraphModule). ``decomposed`` says whether the program's ops are Core
    ATen's (an edge program, always, or an aten ExportedProgram after ``run_decompositions()``): a
    rule writes a new op there in its Core ATen spelling (``aten.convolution``, not ``aten.conv2d``).
    Build one with :func:`snapshot`.
    """

    nodes: PVector[NodeSnapshot]
    constants: PMap[str, ConstantInfo]
    dialect: str
    lifted: bool
    decomposed: bool = False
    # derived from ``nodes`` (so left out of equality and hashing); read-only views
    users: Mapping[str, tuple[str, ...]] = field(compare=False, hash=False)
    index: Mapping[str, int] = field(compare=False, hash=False)
    targets: Mapping[str, tuple[str, ...]] = field(compare=False, hash=False, repr=False)
    # names the program already uses besides its nodes (state-dict keys, module attributes), and
    # the names of nodes and constants an earlier rewrite removed: no new node or constant takes them
    reserved: frozenset[str] = field(default=frozenset(), compare=False, hash=False, repr=False)
    # the least value of each symbolic size, where the program declares it (an exported program's
    # range constraints): a size missing here may be 0
    least_sizes: Mapping[str, int] = field(
        default_factory=lambda: FrozenDict({}), compare=False, hash=False, repr=False
    )
    # the nodes whose tensor the program writes in place (directly, or through a view of it): what
    # they compute is no constant, whatever they read
    written: frozenset[str] = field(default=frozenset(), compare=False, hash=False, repr=False)
    # the parameters, buffers and constants the program holds as no plain data (a sparse, nested or
    # tensor-subclass tensor): not in ``constants``, and a rule that needs one says why
    opaque: frozenset[str] = field(default=frozenset(), compare=False, hash=False, repr=False)
    # the names of ``constants``, found once: a membership test far cheaper than the persistent
    # map's (a walk up from a node, is it computed from constants alone, asks it of each node met)
    constant_names: frozenset[str] = field(init=False, compare=False, hash=False, repr=False)
    # the keys of ``constants`` (after a rewrite, also those of the constants it dropped, which
    # ``reserved`` holds too): what a new constant's key must not be
    constant_keys: frozenset[str] = field(init=False, compare=False, hash=False, repr=False)
    # the derived constants by their expression (of several holding one, the least name): a
    # rewrite deriving one again reads that one
    derived: Mapping[WeightExpr, str] = field(init=False, compare=False, hash=False, repr=False)
    # the expressions several constants may hold (only a snapshot made by hand has such): where
    # a rewrite drops the one ``derived`` names, it looks for another
    shared_derived: frozenset[WeightExpr] = field(init=False, compare=False, hash=False, repr=False)
    # the fields above, where the caller found them (a rewrite, from the snapshot it rewrote, in
    # proportion to its changes): else one walk of ``constants`` finds them
    known: InitVar[KnownConstants | None] = None

    def __post_init__(self, known: KnownConstants | None) -> None:
        if self.dialect == "edge":  # (an edge program's ops are Core ATen's, however it was made)
            object.__setattr__(self, "decomposed", True)
        if known is None:
            names: set[str] = set()
            keys: set[str] = set()
            derived: dict[WeightExpr, str] = {}
            shared: set[WeightExpr] = set()
            for name, info in self.constants.items():  # one walk of the persistent map (a slow one)
                names.add(name)
                keys.add(info.key)
                source = info.source
                if source is not None and source in derived:
                    shared.add(source)
                    derived[source] = min(derived[source], name)
                elif source is not None:
                    derived[source] = name
            known = KnownConstants(frozenset(names), frozenset(keys), FrozenDict(derived), frozenset(shared))
        object.__setattr__(self, "constant_names", known.names)
        object.__setattr__(self, "constant_keys", known.keys)
        object.__setattr__(self, "derived", known.derived)
        object.__setattr__(self, "shared_derived", known.shared)

    def __repr__(self) -> str:
        """Short (every node and constant of a large program would be megabytes): its size, form and
        first nodes.

        >>> snapshot([NodeSnapshot(name="x", op="placeholder", target="x")], {})
        GraphSnapshot(1 node: x; 0 constants; dialect='aten', lifted=True, decomposed=False)
        """
        names = [n.name for n in self.nodes[:_SHOWN]]
        more = ", ..." if len(self.nodes) > _SHOWN else ""
        nodes, constants = len(self.nodes), len(self.constants)
        count = (
            f"{nodes} node{'s' * (nodes != 1)}: {', '.join(names)}{more}; {constants} constant{'s' * (constants != 1)}"
        )
        form = f"dialect={self.dialect!r}, lifted={self.lifted}, decomposed={self.decomposed}"
        return f"GraphSnapshot({count}; {form})"

    def least(self, dim: Dim) -> int:
        """The least value ``dim`` can take: itself when static, else what the program declares
        (0 when it declares nothing).

        >>> g = snapshot([], {}, least_sizes={"T": 1})
        >>> g.least(3), g.least("T"), g.least("B")
        (3, 1, 0)
        """
        return dim if isinstance(dim, int) else self.least_sizes.get(dim, 0)

    def node(self, name: str) -> NodeSnapshot:
        """The node called ``name`` (KeyError if there is none)."""
        return self.nodes[self.index[name]]

    def calls(self, targets: Iterable[str]) -> tuple[NodeSnapshot, ...]:
        """The nodes calling any of ``targets``, in topological order (through an index, no scan)."""
        names = [n for t in targets for n in self.targets.get(t, ())]
        if len(names) > 1:
            names.sort(key=self.index.__getitem__)
        return tuple(self.nodes[self.index[n]] for n in names)

    def users_of(self, name: str) -> tuple[NodeSnapshot, ...]:
        """Nodes that read ``name``, in topological order, each once."""
        return tuple(self.node(u) for u in self.users.get(name, ()))

    @property
    def inputs(self) -> tuple[str, ...]:
        """User inputs: placeholders that are not constants."""
        return tuple(n.name for n in self.nodes if n.op == "placeholder" and n.name not in self.constant_names)

    @property
    def outputs(self) -> tuple[str, ...]:
        """Names the output node returns."""
        return tuple(r for n in self.nodes if n.op == "output" for r in node_refs(n))


def snapshot(
    nodes: Iterable[NodeSnapshot],
    constants: Mapping[str, ConstantInfo],
    *,
    dialect: str = "aten",
    lifted: bool = True,
    decomposed: bool = False,
    reserved: Iterable[str] = (),
    least_sizes: Mapping[str, int] | None = None,
    written: Iterable[str] = (),
    opaque: Iterable[str] = (),
) -> GraphSnapshot:
    """Build a snapshot, deriving users and the name index in one pass.

    ``decomposed``: the ops are Core ATen's (:attr:`GraphSnapshot.decomposed`; always where
    ``dialect`` is ``"edge"``). ``reserved``: names a new constant must not take (the program's
    state-dict keys, say).
    ``least_sizes``: the least value of each symbolic size, where known. ``written``: the nodes
    whose tensor the program writes in place. ``opaque``: the constants held as no plain data
    (:attr:`GraphSnapshot.opaque`).

    >>> g = snapshot([NodeSnapshot(name="x", op="placeholder", target="x"),
    ...               NodeSnapshot(name="out", op="output", target="output",
    ...                            args=((NodeRef("x"),),))], {})
    >>> g.users["x"], g.outputs
    (('out',), ('x',))
    """
    vec = pvector(nodes)
    users, index, targets, _ = derive(vec)
    return GraphSnapshot(
        nodes=vec,
        constants=constants if isinstance(constants, pyrsistent.PMap) else pmap(constants),
        dialect=dialect,
        lifted=lifted,
        decomposed=decomposed,
        users=FrozenDict(users),
        index=FrozenDict(index),
        targets=FrozenDict(targets),
        reserved=frozenset(reserved),
        least_sizes=FrozenDict(least_sizes or {}),
        written=frozenset(written),
        opaque=frozenset(opaque),
    )


def derive(
    nodes: Iterable[NodeSnapshot],
) -> tuple[dict[str, tuple[str, ...]], dict[str, int], dict[str, tuple[str, ...]], InvalidSnapshot | None]:
    """Users, the name index, the calls by target, and the first order violation (if any), in one
    pass over the nodes.

    >>> users, index, targets, bad = derive([NodeSnapshot(name="y", op="call_function", target="t",
    ...                                                   args=(NodeRef("x"),))])
    >>> users, index, targets, bad.message
    ({'y': (), 'x': ('y',)}, {'y': 0}, {'t': ('y',)}, "y: reads 'x' before it is defined")
    """
    # readers are kept as tuples, made anew at each read (cheaper than a list per node turned into a
    # tuple at the end: most nodes have one or two readers); past a few, in a list (``many``)
    users: dict[str, tuple[str, ...]] = {}
    many: dict[str, list[str]] = {}
    index: dict[str, int] = {}
    targets: dict[str, list[str]] = {}
    bad: InvalidSnapshot | None = None
    for i, n in enumerate(nodes):
        name = n.name
        if n.op == "call_function":
            calls = targets.get(n.target)
            if calls is None:
                targets[n.target] = [name]
            else:
                calls.append(name)
        if bad is None and name in index:
            bad = InvalidSnapshot(node=name, detail="duplicate node name")
        if name not in users:
            users[name] = ()
        reads = n._reads
        for r in dict.fromkeys(reads) if len(reads) > 1 else reads:
            # a node defined earlier has its entry, and so has one read earlier before it is defined,
            # which that read reported: only a name never seen, or the node itself, is read too soon
            readers = users.get(r)
            if readers is None:
                readers = ()
                if bad is None:
                    bad = InvalidSnapshot(node=name, detail=f"reads {r!r} before it is defined")
            elif bad is None and r == name:
                bad = InvalidSnapshot(node=name, detail=f"reads {r!r} before it is defined")
            if len(readers) < _FEW_READERS:
                users[r] = (*readers, name)
            else:
                listed = many.get(r)
                if listed is None:
                    many[r] = [*readers, name]
                else:
                    listed.append(name)
        index[name] = i
    for r, listed in many.items():
        users[r] = tuple(listed)
    return users, index, {k: tuple(v) for k, v in targets.items()}, bad


_FEW_READERS = 16
"""How many readers ``derive`` holds in a tuple (copied at each new one) before it lists them."""


def verify(snap: GraphSnapshot) -> Result[GraphSnapshot, InvalidSnapshot]:
    """Check every invariant: unique names, topological order, constants, users, index.

    >>> bad = snapshot([NodeSnapshot(name="y", op="call_function", target="t",
    ...                              args=(NodeRef("x"),))], {})
    >>> verify(bad).failure().message
    "y: reads 'x' before it is defined"
    """
    users, index, targets, bad = derive(snap.nodes)
    missing = [k for k in snap.constants if k not in index]
    if bad is not None:
        return Failure(bad)
    if missing:
        return Failure(InvalidSnapshot(node=missing[0], detail="constant without a node"))
    if users != dict(snap.users):
        return Failure(InvalidSnapshot(node="<graph>", detail="users disagree with arguments"))
    if index != dict(snap.index):
        return Failure(InvalidSnapshot(node="<graph>", detail="name index disagrees with node order"))
    if targets != dict(snap.targets):
        return Failure(InvalidSnapshot(node="<graph>", detail="target index disagrees with the nodes"))
    infos = dict(snap.constants.items())
    if snap.constant_names != infos.keys() or not {i.key for i in infos.values()} <= snap.constant_keys:
        return Failure(InvalidSnapshot(node="<graph>", detail="constant names or keys disagree with the constants"))
    derived = snap.derived
    if any(k not in infos or infos[k].source != e for e, k in derived.items()) or any(
        i.source is not None and i.source not in derived for i in infos.values()
    ):
        return Failure(InvalidSnapshot(node="<graph>", detail="derived constants disagree with the constants"))
    return Success(snap)

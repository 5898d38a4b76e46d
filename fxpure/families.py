"""Op families: every spelling of one op across the GraphModule, aten and edge forms, with
argument names from torch's own schemas.

A pattern names a family (``CONV``), never a target, and reads arguments by schema name,
never by position. A backend author adds a family with :func:`family` from schema text
copied from ``native_functions.yaml``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import final

from returns.result import Failure, Result, Success

from fxpure.frozen import FrozenDict
from fxpure.reasons import Malformed
from fxpure.schema import Kind, Schema, bind, parse_schema
from fxpure.snapshot import Arg, GraphSnapshot, NodeRef, NodeSnapshot

Normalizer = Callable[[GraphSnapshot, NodeSnapshot, Mapping[str, Arg]], Result[Mapping[str, Arg], Malformed]]
"""Turns bound arguments into a family's normal form (e.g. ``stride=1`` -> ``(1, 1)``)."""


@final
@dataclass(frozen=True, slots=True)
class Family:
    """Every spelling of one op: canonical target -> schema, a noun for messages, an optional
    normaliser, and the pair of arguments that commute (``("self", "other")`` for mul/add) where
    the node's other arguments hold their defaults (``add`` with ``alpha=2`` does not)."""

    name: str
    noun: str
    schemas: Mapping[str, Schema]
    normalize: Normalizer | None = None
    commutes: tuple[str, str] | None = None
    # arguments that change what the op computes (``add``'s ``alpha``, ``div``'s ``rounding_mode``): a
    # pattern that does not name one matches only a call where it holds its default (or None)
    strict: frozenset[str] = frozenset()
    # ``targets``, found once (rules ask ``node.target in VIEW.targets`` of node after node)
    _targets: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "schemas", FrozenDict(self.schemas))
        object.__setattr__(self, "_targets", frozenset(self.schemas))

    def __repr__(self) -> str:
        """Its name and spellings: every schema whole would fill a near miss's bindings (``explain``)."""
        return f"Family({self.name!r}: {', '.join(sorted(self.schemas))})"

    @property
    def targets(self) -> frozenset[str]:
        """The canonical targets of every spelling."""
        return self._targets

    @property
    def params(self) -> frozenset[str]:
        """Every argument name a pattern may use with this family."""
        return frozenset().union(*(s.names for s in self.schemas.values()))

    def kinds(self, name: str) -> frozenset[Kind]:
        """The kinds argument ``name`` has across the spellings (empty: fixed by the spelling)."""
        return frozenset(p.kind for s in self.schemas.values() if (p := s.param(name)) is not None)

    def bind(self, snap: GraphSnapshot, node: NodeSnapshot) -> Result[Mapping[str, Arg], Malformed]:
        """The node's arguments by name in the family's normal form, or why they do not fit."""
        schema = self.schemas.get(node.target)
        if schema is None or node.op != "call_function":
            return Failure(Malformed(node=node.name, detail=f"{node.target} is not {self.noun}"))
        bound = bind(node, schema)
        normalize = self.normalize
        if normalize is None or not isinstance(bound, Success):
            return bound
        return normalize(snap, node, bound.unwrap())

    def __or__(self, other: Family) -> Family:
        """Both families as one (e.g. ``ADD | SUB``)."""
        commutes = self.commutes if self.commutes == other.commutes else None
        return Family(
            f"{self.name}|{other.name}",
            " or ".join(dict.fromkeys((*self.noun.split(" or "), *other.noun.split(" or ")))),
            {**self.schemas, **other.schemas},
            self.normalize if self.normalize is other.normalize else _both(self, other),
            commutes,
            self.strict | other.strict,
        )


def _both(a: Family, b: Family) -> Normalizer | None:
    if a.normalize is None and b.normalize is None:
        return None

    def go(snap: GraphSnapshot, node: NodeSnapshot, args: Mapping[str, Arg]) -> Result[Mapping[str, Arg], Malformed]:
        own = a if node.target in a.schemas else b
        return own.normalize(snap, node, args) if own.normalize is not None else Success(args)

    return go


def family(
    name: str,
    noun: str,
    schemas: Iterable[str | Schema],
    *,
    normalize: Normalizer | None = None,
    commutes: tuple[str, str] | None = None,
    strict: Iterable[str] | None = None,
) -> Family:
    """A family from schema text (or parsed schemas), one per spelling. ``strict``: the arguments
    that change what the op computes (``alpha`` of ``add``): a pattern that does not name one
    matches only a call where it holds its default, or None where it has none (``arg-mismatch`` at
    it otherwise), so a rule written without it in mind is not applied to ``add(y, c, alpha=2)``.
    Left out, they are every float, scalar or string that has a default in each spelling that has it
    (a pad's ``value``, a gelu's ``approximate``; not an int, a dim or size a rule reads, nor a bool
    or dtype); ``strict=()`` for none.

    >>> mm = family("mm", "a matrix product", ["aten.mm.default(Tensor self, Tensor mat2) -> Tensor"])
    >>> sorted(mm.params), sorted(mm.targets), sorted(mm.strict)
    (['mat2', 'self'], ['aten.mm.default'], [])
    >>> pad = "aten.constant_pad_nd.default(Tensor self, SymInt[] pad, Scalar value=0) -> Tensor"
    >>> sorted(family("pad", "a pad", [pad]).strict)
    ['value']
    """
    parsed = [s if isinstance(s, Schema) else parse_schema(s) for s in schemas]
    chosen = _modifiers(parsed) if strict is None else frozenset(strict)
    made = Family(name, noun, {s.target: s for s in parsed}, normalize, commutes, chosen)
    unknown = sorted(made.strict - made.params)
    if unknown:
        raise ValueError(f"family {name}: strict names {unknown[0]!r}, which no spelling has")
    return made


# the kinds of argument that modify what an op computes (a pad's value, a gelu's approximation); an
# int (a dim, a size, an index) is the op's structure, which a rule reads, and a bool or a dtype is
# as often a setting export writes out that changes no value (``cudnn_enable``, ``pin_memory``)
_MODIFIER_KINDS: frozenset[Kind] = frozenset({"float", "scalar", "str"})


def _modifiers(schemas: Iterable[Schema]) -> frozenset[str]:
    """The arguments of a modifier's kind that have a default in every spelling that has them."""
    found: dict[str, bool] = {}
    for schema in schemas:
        for k, param in schema.family_params.items():
            found[k] = found.get(k, True) and param.has_default and param.kind in _MODIFIER_KINDS
    return frozenset(k for k, ok in found.items() if ok)


def _ints(node: str, name: str, value: Arg, rank: int) -> Result[tuple[int, ...], Malformed]:
    items = value if isinstance(value, tuple) else (value,)
    ints = tuple(v for v in items if isinstance(v, int) and not isinstance(v, bool))
    if len(ints) != len(items):
        return Failure(Malformed(node=node, detail=f"{name}={value!r} is not a list of ints"))
    if len(ints) == 1:
        return Success(ints * rank)
    if len(ints) != rank:
        return Failure(Malformed(node=node, detail=f"{name}={value!r} does not fit {rank} spatial dims"))
    return Success(ints)


def _conv_rank(snap: GraphSnapshot, node: NodeSnapshot, w: Arg) -> int | None:
    digit = node.target.removeprefix("aten.conv_transpose").removeprefix("aten.conv")[:1]
    if digit in ("1", "2", "3"):
        return int(digit)
    spec = snap.node(w.name).tensor_spec if isinstance(w, NodeRef) and w.name in snap.index else None
    return len(spec.shape) - 2 if spec is not None and len(spec.shape) >= 3 else None


def _batched(snap: GraphSnapshot, node: NodeSnapshot, x: NodeRef, rank: int) -> str | None:
    """Why the conv is not known to run on a batch ``(N, C, *spatial)``, or None. The conv1d/2d/3d
    spellings also take an unbatched ``(C, *spatial)`` input, whose channels are dim 0: a rule that
    takes dim 1 for the channels would fold, normalise or slice along a spatial dim."""
    x_spec = snap.node(x.name).tensor_spec if x.name in snap.index else None
    for role, spec in (("input", x_spec), ("output", node.tensor_spec)):
        if spec is not None and len(spec.shape) != rank + 2:
            return (
                f"{role} has shape {spec.shape}, not (N, C) and {rank} spatial dims: an unbatched conv is not rewritten"
            )
    if x_spec is None and node.tensor_spec is None and node.target != "aten.convolution.default":
        return "no shape tells whether the input is a batch: an unbatched conv is not rewritten"
    return None


def _normalize_conv(
    snap: GraphSnapshot, node: NodeSnapshot, a: Mapping[str, Arg]
) -> Result[Mapping[str, Arg], Malformed]:
    """Rank from the spelling (or the weight), int lists of that rank, a bool ``transposed``."""
    n = node.name
    rank, transposed, groups = _conv_rank(snap, node, a["weight"]), a["transposed"], a["groups"]
    if rank is None or not isinstance(transposed, bool) or not isinstance(groups, int) or groups < 1:
        return Failure(Malformed(node=n, detail="cannot tell rank, transposed or groups"))
    if not isinstance(a["input"], NodeRef) or not isinstance(a["weight"], NodeRef):
        bad = "input" if not isinstance(a["input"], NodeRef) else "weight"
        return Failure(Malformed(node=n, detail=f"{bad} is {a[bad]!r}, expected a tensor"))
    w = snap.node(a["weight"].name).tensor_spec if a["weight"].name in snap.index else None
    if w is not None and len(w.shape) != rank + 2:
        return Failure(Malformed(node=n, detail=f"weight of shape {w.shape} does not fit a {rank}-d convolution"))
    batched = _batched(snap, node, a["input"], rank)
    if batched is not None:
        return Failure(Malformed(node=n, detail=batched))
    out = dict(a)
    for key in ("stride", "dilation", "output_padding", *(() if isinstance(a["padding"], str) else ("padding",))):
        ints = _ints(n, key, a[key], rank)
        if not isinstance(ints, Success):
            return Failure(ints.failure())
        out[key] = ints.unwrap()
    out["rank"] = rank
    return Success(FrozenDict(out))


_CONV_ARGS = "Tensor input, Tensor weight, Tensor? bias=None, SymInt[{r}] stride=1"
_CONV_N = _CONV_ARGS + ", SymInt[{r}] padding=0, SymInt[{r}] dilation=1, SymInt groups=1) -> Tensor"
_CONV_PAD = _CONV_ARGS + ', str padding="valid", SymInt[{r}] dilation=1, SymInt groups=1) -> Tensor'
_CONV_T = (
    _CONV_ARGS + ", SymInt[{r}] padding=0, SymInt[{r}] output_padding=0, SymInt groups=1, SymInt[{r}] dilation=1)"
    " -> Tensor"
)
_REGULAR = {"transposed": False, "output_padding": 0}

CONV = family(
    "conv",
    "a convolution",
    [
        *(parse_schema(f"aten.conv{r}d.default({_CONV_N.format(r=r)}", fixed=_REGULAR) for r in (1, 2, 3)),
        *(parse_schema(f"aten.conv{r}d.padding({_CONV_PAD.format(r=r)}", fixed=_REGULAR) for r in (1, 2, 3)),
        *(
            parse_schema(f"aten.conv_transpose{r}d.{ov}({_CONV_T.format(r=r)}", fixed={"transposed": True})
            for r, ov in ((1, "default"), (2, "input"), (3, "input"))  # torch's overload names
        ),
        "aten.convolution.default(Tensor input, Tensor weight, Tensor? bias, SymInt[] stride, SymInt[] padding,"
        " SymInt[] dilation, bool transposed, SymInt[] output_padding, SymInt groups) -> Tensor",
    ],
    normalize=_normalize_conv,
)
"""Every convolution: ``conv{1,2,3}d`` (``.default``, ``.padding``), ``conv_transpose{1,2,3}d``,
``convolution`` (aten and edge). Normal form: int tuples of the conv's rank for stride, padding
(unless a string), dilation and output_padding; ``transposed``; ``rank`` (spatial dims)."""

_BN = "Tensor input, Tensor? weight, Tensor? bias, Tensor? running_mean, Tensor? running_var, bool training"
_BN_STATS = "Tensor input, Tensor? weight, Tensor? bias, Tensor running_mean, Tensor running_var, bool training"
BATCH_NORM = family(
    "batch_norm",
    "a batch norm",
    [
        parse_schema(f"aten.batch_norm.default({_BN}, float momentum, float eps, bool cudnn_enabled) -> Tensor"),
        f"aten.native_batch_norm.default({_BN}, float momentum, float eps) -> (Tensor, Tensor, Tensor)",
        *(
            f"aten.{op}.default({_BN_STATS}, float momentum, float eps) -> ({out})"
            for op, out in (
                ("_native_batch_norm_legit", "Tensor, Tensor, Tensor"),
                ("_native_batch_norm_legit_functional", "Tensor, Tensor, Tensor, Tensor, Tensor"),
            )
        ),
        parse_schema(
            "aten._native_batch_norm_legit.no_stats(Tensor input, Tensor? weight, Tensor? bias, bool training,"
            " float momentum, float eps) -> (Tensor, Tensor, Tensor)",
            fixed={"running_mean": None, "running_var": None},
        ),
        parse_schema(
            "aten._native_batch_norm_legit_no_training.default(Tensor input, Tensor? weight, Tensor? bias,"
            " Tensor running_mean, Tensor running_var, float momentum, float eps) -> (Tensor, Tensor, Tensor)",
            fixed={"training": False},
        ),
    ],
)
"""Every batch norm: ``batch_norm``, ``native_batch_norm``, the ``_legit`` forms (training,
functional, no stats, no training). Tuple-output spellings are read through ``getitem``."""

LINEAR = family("linear", "a linear", ["aten.linear.default(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor"])
ADDMM = family(
    "addmm",
    "a matrix product plus bias",
    ["aten.addmm.default(Tensor self, Tensor mat1, Tensor mat2, *, Scalar beta=1, Scalar alpha=1) -> Tensor"],
    strict=("beta", "alpha"),
)
MM = family("mm", "a matrix product", ["aten.mm.default(Tensor self, Tensor mat2) -> Tensor"])
BMM = family("bmm", "a batched matrix product", ["aten.bmm.default(Tensor self, Tensor mat2) -> Tensor"])
"""``x @ W.T`` on an input of rank 3 or more that is not contiguous, as decompositions and ``to_edge``
spell it: ``bmm`` of the input's expand and the weight's (:func:`fxpure.linear.linear`)."""
MATMUL = family("matmul", "a matmul", ["aten.matmul.default(Tensor self, Tensor other) -> Tensor"])
"""``x @ y`` as an aten program keeps it (decompositions and ``to_edge`` spell it ``mm``, ``bmm``
and views); ``x @ W.T`` is a linear (:func:`fxpure.linear.linear`)."""
PERMUTE = family(
    "permute",
    "a permute",
    [f"aten.{op}.default(Tensor self, int[] dims) -> Tensor" for op in ("permute", "permute_copy")],
)
TRANSPOSE = family("t", "a transpose", [f"aten.{op}.default(Tensor self) -> Tensor" for op in ("t", "t_copy")])
TRANSPOSE_DIMS = family(
    "transpose",
    "a transpose",
    [
        *(f"aten.{op}.int(Tensor self, int dim0, int dim1) -> Tensor" for op in ("transpose", "transpose_copy")),
        "aten.swapdims.default(Tensor self, int dim0, int dim1) -> Tensor",
        parse_schema(
            "aten.swapaxes.default(Tensor self, int axis0, int axis1) -> Tensor",
            rename={"axis0": "dim0", "axis1": "dim1"},
        ),
    ],
)
"""Two dims swapped: ``transpose``, ``swapdims``, ``swapaxes`` (an aten program keeps the latter two)."""
VIEW = family(
    "view",
    "a view",
    [
        *(f"aten.{op}.default(Tensor self, SymInt[] size) -> Tensor" for op in ("view", "view_copy", "_unsafe_view")),
        parse_schema("aten.reshape.default(Tensor self, SymInt[] shape) -> Tensor", rename={"shape": "size"}),
    ],
)
FLATTEN = family(
    "flatten",
    "a flatten",
    ["aten.flatten.using_ints(Tensor self, int start_dim=0, int end_dim=-1) -> Tensor"],
)
"""``x.flatten(start_dim, end_dim)``: dims ``start_dim..end_dim`` (either may be negative) merged
into one, as an aten program and its GraphModule keep it (decompositions and ``to_edge`` spell it
``view``/``view_copy``). Not a :data:`VIEW`: it has no ``size``, so a rule that reads or re-sizes a
view's sizes (:func:`fxpure.linear.emit_linear`'s reshapes) could not take it; a pattern that reads
a model's reshape of a value joins the two (``VIEW | FLATTEN``), reading the shape off its output."""
UNSQUEEZE = family(
    "unsqueeze",
    "an unsqueeze",
    [f"aten.{op}.default(Tensor self, int dim) -> Tensor" for op in ("unsqueeze", "unsqueeze_copy")],
)
SQUEEZE = family(
    "squeeze",
    "a squeeze",
    [
        f"aten.{op}.{ov}(Tensor self, {t} dim) -> Tensor"
        for op in ("squeeze", "squeeze_copy")
        for ov, t in (("dim", "int"), ("dims", "int[]"))
    ],
)
SLICE = family(
    "slice",
    "a slice",
    [
        f"aten.{op}.Tensor(Tensor self, int dim=0, SymInt? start=None, SymInt? end=None, SymInt step=1) -> Tensor"
        for op in ("slice", "slice_copy")
    ],
)
SELECT = family(
    "select",
    "an index along a dim",
    [f"aten.{op}.int(Tensor self, int dim, SymInt index) -> Tensor" for op in ("select", "select_copy")],
)
CAT = family("cat", "a concatenation", ["aten.cat.default(Tensor[] tensors, int dim=0) -> Tensor"])


def _normalize_split(
    snap: GraphSnapshot, node: NodeSnapshot, a: Mapping[str, Arg]
) -> Result[Mapping[str, Arg], Malformed]:
    """``split_sizes`` the sizes of the parts, read off the outputs where a spelling gives a part's
    size (``split.Tensor``) or their number (``chunk``)."""
    if node.target.startswith("aten.split_with_sizes"):
        return Success(a)
    parts, dim = node.spec if isinstance(node.spec, tuple) else (), a["dim"]
    rank = len(parts[0].shape) if parts and parts[0] is not None else 0
    if not isinstance(dim, int) or not -rank <= dim < rank:
        return Failure(Malformed(node=node.name, detail="no output shapes tell the sizes of the parts"))
    sizes = tuple(p.shape[dim] if p is not None else None for p in parts)
    ints = tuple(n for n in sizes if isinstance(n, int))
    if len(ints) != len(sizes):
        return Failure(Malformed(node=node.name, detail=f"the parts have sizes {sizes} along dim {dim}: not all known"))
    return Success(FrozenDict({**a, "split_sizes": ints}))


SPLIT = family(
    "split",
    "a split",
    [
        *(
            f"aten.{op}.default(Tensor self, SymInt[] split_sizes, int dim=0) -> Tensor[]"
            for op in ("split_with_sizes", "split_with_sizes_copy")
        ),
        # an aten program's x.split(2) and x.chunk(2): normalised to the sizes of the parts
        parse_schema(
            "aten.split.Tensor(Tensor self, SymInt split_size, int dim=0) -> Tensor[]",
            rename={"split_size": "split_sizes"},
        ),
        parse_schema(
            "aten.chunk.default(Tensor self, int chunks, int dim=0) -> Tensor[]", rename={"chunks": "split_sizes"}
        ),
    ],
    normalize=_normalize_split,
)
"""Every split: ``split_with_sizes`` (and edge's ``_copy``), ``split.Tensor``, ``chunk``. Normal
form: ``split_sizes``, the sizes of the parts (of an aten program's ``split.Tensor`` and ``chunk``,
from their outputs' shapes)."""
RELU = family("relu", "a relu", ["aten.relu.default(Tensor self) -> Tensor"])
UNARY = family(
    "unary",
    "an elementwise function",
    [f"aten.{op}.default(Tensor self) -> Tensor" for op in ("sqrt", "rsqrt", "neg", "reciprocal", "abs", "sign")],
)
GETITEM = family("getitem", "a tuple projection", ["getitem(Any self, int index) -> Any"])
SIGMOID = family("sigmoid", "a sigmoid", ["aten.sigmoid.default(Tensor self) -> Tensor"])
# ops that may return their input unchanged; every spelling names its tensor ``self`` (a dropout's
# ``input`` too), so that ``DROPOUT | CLONE | CAST`` reads it by one name
# nn.Dropout, Dropout1d/2d/3d (channels), AlphaDropout, FeatureAlphaDropout
_DROPPED = ("dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout")
_DROPOUTS = family(
    "dropout",
    "a dropout",
    [
        parse_schema(f"aten.{op}.default(Tensor input, float p, bool train) -> Tensor", rename={"input": "self"})
        for op in _DROPPED
    ],
)
# what a spelling implies of an argument another spelling of its family has (a pattern may require a
# value of it: see fxpure.pattern's lint); a memory format or dim order it does not have is unknown
_BLOCKS: Mapping[str, Arg] = {"non_blocking": False}
_COPIES: Mapping[str, Arg] = {"copy": True}
CLONE = family(
    "clone",
    "a clone",
    [
        parse_schema("aten.clone.default(Tensor self, *, MemoryFormat? memory_format=None) -> Tensor", fixed=_BLOCKS),
        # (``x.contiguous()`` as an aten program may keep it: a copy, or ``x`` where it is contiguous already)
        parse_schema(
            "aten.contiguous.default(Tensor(a) self, *, MemoryFormat memory_format=contiguous_format) -> Tensor(a)",
            fixed=_BLOCKS,
        ),
        "dim_order_ops._clone_dim_order.default(Tensor self, *, bool non_blocking=False, int[]? dim_order=None)"
        " -> Tensor",
        # (``y.detach()``, which an aten program keeps, and ``aten.alias``, which decompositions
        # make of it: the tensor as it is; edge copies it)
        *(parse_schema(f"aten.{op}.default(Tensor(a) self) -> Tensor(a)", fixed=_BLOCKS) for op in ("detach", "alias")),
        *(parse_schema(f"aten.{op}_copy.default(Tensor self) -> Tensor", fixed=_BLOCKS) for op in ("detach", "alias")),
    ],
)
_COPY = "ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None"
CAST = family(
    "cast",
    "a cast",
    [
        parse_schema(
            "aten.to.dtype(Tensor self, ScalarType dtype, bool non_blocking=False, bool copy=False,"
            " MemoryFormat? memory_format=None) -> Tensor",
            fixed={"layout": None, "device": None, "pin_memory": None},  # (kept as they are)
        ),
        parse_schema(
            f"aten._to_copy.default(Tensor self, *, {_COPY}, bool non_blocking=False,"
            " MemoryFormat? memory_format=None) -> Tensor",
            fixed=_COPIES,
        ),
        parse_schema(
            f"dim_order_ops._to_dim_order_copy.default(Tensor self, *, {_COPY}, bool non_blocking=False,"
            " int[]? dim_order=None) -> Tensor",
            fixed=_COPIES,
        ),
    ],
)
"""A copy to another dtype (or layout, device, memory format, dim order): ``dtype`` None keeps it."""
EXPAND = family(
    "expand",
    "an expand",
    [
        f"aten.{op}.default(Tensor self, SymInt[] size, *, bool implicit=False) -> Tensor"
        for op in ("expand", "expand_copy")
    ],
)

_BINARY = "(Tensor self, {other} other{alpha}) -> Tensor"
MUL = family(
    "mul",
    "a multiplication",
    [f"aten.mul.{ov}{_BINARY.format(other=t, alpha='')}" for ov, t in (("Tensor", "Tensor"), ("Scalar", "Scalar"))],
    commutes=("self", "other"),
)
# true division in each spelling (``torch.true_divide``, ``torch.div(..., rounding_mode=None)``); a
# rounding mode, where a spelling has none, is None
DIV = family(
    "div",
    "a division",
    [
        *(
            parse_schema(f"aten.{op}.{ov}{_BINARY.format(other=t, alpha='')}", fixed={"rounding_mode": None})
            for op, ov, t in (
                ("div", "Tensor", "Tensor"),
                ("div", "Scalar", "Scalar"),
                ("true_divide", "Tensor", "Tensor"),
            )
        ),
        "aten.div.Tensor_mode(Tensor self, Tensor other, *, str? rounding_mode) -> Tensor",
    ],
    strict=("rounding_mode",),
)
ADD = family(
    "add",
    "an addition",
    [
        f"aten.add.Tensor{_BINARY.format(other='Tensor', alpha=', *, Scalar alpha=1')}",
        f"aten.add.Scalar{_BINARY.format(other='Scalar', alpha=', Scalar alpha=1')}",
    ],
    commutes=("self", "other"),
    strict=("alpha",),
)
SUB = family(
    "sub",
    "a subtraction",
    [
        f"aten.sub.Tensor{_BINARY.format(other='Tensor', alpha=', *, Scalar alpha=1')}",
        f"aten.sub.Scalar{_BINARY.format(other='Scalar', alpha=', Scalar alpha=1')}",
    ],
    strict=("alpha",),
)


def in_place(f: Family) -> Family:
    """The in-place spellings of a functional family (``aten.mul_.Tensor`` for ``aten.mul.Tensor``):
    the same arguments, ``self`` written and returned. An aten program may hold them (``y.mul_(c)``);
    an edge program does not. Their operands never commute (``self`` is the one written).

    >>> sorted(in_place(MUL).targets), in_place(MUL).commutes, in_place(MUL).name, in_place(MUL).noun
    (['aten.mul_.Scalar', 'aten.mul_.Tensor'], None, 'mul_', 'a multiplication in place')
    >>> in_place(CONV).normalize is CONV.normalize  # a normal form stays
    True
    """

    def spelling(s: Schema) -> Schema:
        ns, op, overload = s.target.split(".")
        return replace(s, target=f"{ns}.{op}_.{overload}")

    schemas = [spelling(s) for s in f.schemas.values()]
    return Family(f"{f.name}_", f"{f.noun} in place", {s.target: s for s in schemas}, f.normalize, strict=f.strict)


MUL_, DIV_, ADD_, SUB_, RELU_ = in_place(MUL), in_place(DIV), in_place(ADD), in_place(SUB), in_place(RELU)
# and in place (``inplace=True``), which in eval mode writes nothing (capture counts no write)
_IN_PLACE = [f"aten.{op}_.default(Tensor(a!) self, float p, bool train) -> Tensor(a!)" for op in _DROPPED]
DROPOUT = replace(_DROPOUTS | family("dropout_", "a dropout in place", _IN_PLACE), name="dropout", noun="a dropout")


RSUB = family(
    "rsub",
    "a reversed subtraction",
    [
        "aten.rsub.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor",
        "aten.rsub.Scalar(Tensor self, Scalar other, Scalar alpha=1) -> Tensor",
    ],
    strict=("alpha",),
)

_QD = "quantized_decomposed"
_QARGS = "int quant_min, int quant_max, ScalarType dtype"
# per tensor: the parameters as numbers (``.default``) or as 0-d tensors (``.tensor``)
DEQUANTIZE_PER_TENSOR = family(
    "dequantize_per_tensor",
    "a dequantize",
    [
        parse_schema(
            f"{_QD}.dequantize_per_tensor.{overload}(Tensor input, {scale} scale, {zero_point} zero_point, {_QARGS},"
            " *, ScalarType? out_dtype=None) -> Tensor",
            fixed={"axis": None},
        )
        for overload, scale, zero_point in (("default", "float", "int"), ("tensor", "Tensor", "Tensor"))
    ],
)
DEQUANTIZE_PER_CHANNEL = family(
    "dequantize_per_channel",
    "a dequantize",
    [
        parse_schema(
            f"{_QD}.dequantize_per_channel.default(Tensor input, Tensor scales, Tensor? zero_points, int axis,"
            f" {_QARGS}, *, ScalarType? out_dtype=None) -> Tensor",
            rename={"scales": "scale", "zero_points": "zero_point"},
        )
    ],
)
DEQUANTIZE = replace(DEQUANTIZE_PER_TENSOR | DEQUANTIZE_PER_CHANNEL, name="dequantize")
"""Per-tensor and per-channel dequantize, with common names: ``input``, ``scale`` (a float, or a
tensor per channel), ``zero_point``, ``axis`` (None per tensor), ``quant_min``, ``quant_max``, ``dtype``."""
QUANTIZE_PER_TENSOR = family(
    "quantize_per_tensor",
    "a quantize",
    [
        f"{_QD}.quantize_per_tensor.{overload}(Tensor input, {scale} scale, {zero_point} zero_point, {_QARGS})"
        " -> Tensor"
        for overload, scale, zero_point in (("default", "float", "int"), ("tensor", "Tensor", "Tensor"))
    ],
)

STANDARD: tuple[Family, ...] = (
    CONV,
    BATCH_NORM,
    LINEAR,
    ADDMM,
    MM,
    MATMUL,
    BMM,
    PERMUTE,
    TRANSPOSE,
    TRANSPOSE_DIMS,
    VIEW,
    FLATTEN,
    UNSQUEEZE,
    SQUEEZE,
    SLICE,
    SELECT,
    CAT,
    SPLIT,
    RELU,
    UNARY,
    GETITEM,
    SIGMOID,
    DROPOUT,
    CLONE,
    CAST,
    EXPAND,
    MUL,
    DIV,
    ADD,
    SUB,
    RSUB,
    MUL_,
    DIV_,
    ADD_,
    SUB_,
    RELU_,
    DEQUANTIZE,
    QUANTIZE_PER_TENSOR,
)
"""The families fxpure ships."""

SCHEMAS: Mapping[str, Schema] = FrozenDict({t: s for f in STANDARD for t, s in f.schemas.items()})
"""Every known spelling's schema by canonical target (what ``fxpure.testing`` builds calls with)."""

_COPY_OPS: Mapping[str, str] = FrozenDict(
    {t: copy for t in SCHEMAS if "." in t and (copy := "{}_copy.{}".format(*t.rsplit(".", 1))) in SCHEMAS}
)


def spelled(target: str, dialect: str) -> str:
    """How a program of ``dialect`` writes the op ``target``: an edge program has no view ops, and
    writes each as its ``_copy`` op (same arguments, same values); anything else as it is.
    :class:`fxpure.pattern.Planner` writes its new nodes so.

    >>> spelled("aten.permute.default", "edge"), spelled("aten.permute.default", "aten")
    ('aten.permute_copy.default', 'aten.permute.default')
    """
    return _COPY_OPS.get(target, target) if dialect == "edge" else target

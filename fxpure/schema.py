"""Op schemas in torch's own notation, and binding a node's arguments to them by name.

A schema is written as in ``native_functions.yaml``, so a backend author can copy it from
torch's own table: ``"aten.mm.default(Tensor self, Tensor mat2) -> Tensor"``. Binding checks
each argument against its declared kind; a node that does not fit is ``malformed-node``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeAlias, cast, final

from pyrsistent import pmap
from pyrsistent.typing import PMap
from returns.result import Failure, Result, Success

from fxpure.frozen import FrozenDict
from fxpure.reasons import Malformed
from fxpure.snapshot import Arg, DTypeArg, NodeRef, NodeSnapshot, Opaque

Kind: TypeAlias = Literal["tensor", "tensors", "int", "ints", "float", "bool", "scalar", "dtype", "str", "any"]

# torch type (without '?', alias annotations and sizes) -> kind
_KINDS: Mapping[str, Kind] = {
    "Tensor": "tensor",
    "Tensor[]": "tensors",
    "Tensor?[]": "tensors",
    "int": "int",
    "SymInt": "int",
    "int[]": "ints",
    "SymInt[]": "ints",
    "float": "float",
    "bool": "bool",
    "Scalar": "scalar",
    "ScalarType": "dtype",
    "str": "str",
}
TENSOR_KINDS = frozenset({"tensor", "tensors"})


@final
@dataclass(frozen=True, slots=True)
class Param:
    """One parameter: its name, kind, whether it may be None, and its default if it has one."""

    name: str
    kind: Kind
    optional: bool
    keyword_only: bool
    has_default: bool
    default: Arg = None


@final
@dataclass(frozen=True, slots=True)
class Schema:
    """Parameters of one op overload, values its spelling implies (``fixed``), and renames of
    parameters to the names its family uses (``rename``: schema name -> family name)."""

    target: str
    params: tuple[Param, ...]
    outputs: int
    fixed: Mapping[str, Arg]
    rename: Mapping[str, str]
    # derived once (binding is on every match's path)
    positional: tuple[str, ...] = field(init=False, compare=False, repr=False)
    """Names of the parameters that may be passed by position."""
    names: frozenset[str] = field(init=False, compare=False, repr=False)
    """Every name a bound node has: parameters (as renamed) and fixed values."""
    family_params: Mapping[str, Param] = field(init=False, compare=False, repr=False)
    """The parameters by the names its family (and a planner) calls them, in order."""
    required: tuple[str, ...] = field(init=False, compare=False, repr=False)
    """The family's names of the parameters without a default."""
    _by_name: Mapping[str, Param] = field(init=False, compare=False, repr=False)
    _order: Mapping[str, int] = field(init=False, compare=False, repr=False)  # parameter -> position
    _back: Mapping[str, str] = field(init=False, compare=False, repr=False)  # family name -> parameter
    # per parameter, what binding needs: name, family name, default, may be None, the value types
    # that fit outright, the kind check for the rest
    _binding: tuple[tuple[str, str, bool, Arg, bool, frozenset[type], Callable[[Arg], bool]], ...] = field(
        init=False, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "fixed", FrozenDict(self.fixed))
        object.__setattr__(self, "rename", FrozenDict(self.rename))
        object.__setattr__(self, "positional", tuple(p.name for p in self.params if not p.keyword_only))
        object.__setattr__(
            self, "names", frozenset({self.rename.get(p.name, p.name) for p in self.params} | set(self.fixed))
        )
        by_family = {self.rename.get(p.name, p.name): p for p in self.params}
        object.__setattr__(self, "family_params", FrozenDict(by_family))
        object.__setattr__(self, "required", tuple(n for n, p in by_family.items() if not p.has_default))
        object.__setattr__(self, "_by_name", FrozenDict({p.name: p for p in self.params}))
        object.__setattr__(self, "_order", FrozenDict({p.name: i for i, p in enumerate(self.params)}))
        object.__setattr__(self, "_back", FrozenDict({v: k for k, v in self.rename.items()}))
        object.__setattr__(
            self,
            "_binding",
            tuple(
                (
                    p.name,
                    self.rename.get(p.name, p.name),
                    p.has_default,
                    p.default,
                    p.optional or p.kind == "any",
                    _EXACT.get(p.kind, frozenset()),
                    _FITS[p.kind],
                )
                for p in self.params
            ),
        )

    def param(self, name: str) -> Param | None:
        """The parameter a family name refers to, or None (e.g. a fixed value)."""
        return self._by_name.get(self._back.get(name, name))

    @property
    def tuple_output(self) -> bool:
        """True when the op returns a tuple (users read it through ``getitem``)."""
        return self.outputs > 1


_SCHEMA = re.compile(r"^\s*(?P<target>[\w.]+)\((?P<params>.*)\)\s*->\s*(?P<ret>.+?)\s*$")
_ALIAS = re.compile(r"\([a-z!* >-]*\)")


def _split(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
            continue
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        cur += ch
    return [p for p in [*parts, cur.strip()] if p]


def _literal(text: str) -> Arg:
    if text == "None":
        return None
    if text in ("True", "False"):
        return text == "True"
    if text.startswith("[") and text.endswith("]"):
        return tuple(_literal(t) for t in _split(text[1:-1]))
    if text.startswith('"') and text.endswith('"'):
        return text[1:-1]
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return Opaque(text)


# torch prints a ScalarType default as its number in c10's enum (``ScalarType output_dtype=6``, as
# torchao's ``dequantize_affine`` says float32): the dtypes by that number, as torch names them
SCALAR_TYPES: tuple[str, ...] = (
    *("uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"),
    *("complex32", "complex64", "complex128", "bool", "qint8", "quint8", "qint32", "bfloat16"),
    *("quint4x2", "quint2x4", "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16"),
    *("float8_e5m2", "float8_e4m3fn", "float8_e5m2fnuz", "float8_e4m3fnuz", "uint16", "uint32", "uint64"),
    *(f"uint{i}" for i in range(1, 8)),
    *(f"int{i}" for i in range(1, 8)),
    *("float8_e8m0fnu", "float4_e2m1fn_x2"),
)


def _param(text: str, keyword_only: bool) -> Param:
    declared, _, default = text.partition("=")
    type_text, name = _ALIAS.sub("", declared).split()
    optional = "?" in type_text.replace("?[]", "[]")
    base = re.sub(r"\[\d+\]", "[]", type_text.replace("?", "", 1) if optional else type_text)
    kind: Kind = _KINDS.get(base, "any")
    value = _literal(default.strip()) if default else None
    size = re.search(r"\[(\d+)\]", type_text)
    if kind == "ints" and size is not None and isinstance(value, int) and not isinstance(value, bool):
        value = (value,) * int(size[1])  # torch's 'SymInt[2] stride=1' means [1, 1]: a list is what it takes
    if kind == "dtype" and isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(SCALAR_TYPES):
        value = DTypeArg(SCALAR_TYPES[value])  # (a number past the table stays one: refused where it is bound)
    return Param(name, kind, optional, keyword_only, bool(default), value)


def parse_schema(
    text: str, *, fixed: Mapping[str, Arg] | None = None, rename: Mapping[str, str] | None = None
) -> Schema:
    """A schema from torch's notation; raises ValueError on text it cannot read (a bug in a table).

    >>> s = parse_schema("aten.addmm.default(Tensor self, Tensor mat1, Tensor mat2, *, Scalar beta=1, Scalar alpha=1)"
    ...                  " -> Tensor")
    >>> s.positional, s.param("alpha").default, s.outputs
    (('self', 'mat1', 'mat2'), 1, 1)
    """
    m = _SCHEMA.match(text)
    if m is None:
        raise ValueError(f"not a schema: {text!r}")
    params: list[Param] = []
    keyword_only = False
    for part in _split(m["params"]):
        if part == "*":
            keyword_only = True
            continue
        params.append(_param(part, keyword_only))
    ret = m["ret"].strip()
    outputs = len(_split(ret[1:-1])) if ret.startswith("(") else 1
    return Schema(m["target"], tuple(params), outputs, fixed or {}, rename or {})


def _number(value: Arg) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int(value: Arg) -> bool:
    return isinstance(value, NodeRef) or (isinstance(value, int) and not isinstance(value, bool))


def _tensor(v: Arg) -> bool:  # a Python number is wrapped into a tensor by torch (``x * 2.0`` -> mul.Tensor)
    return isinstance(v, NodeRef) or _number(v)


def _tensors(v: Arg) -> bool:
    return isinstance(v, tuple) and all(x is None or isinstance(x, NodeRef) for x in v)


def _ints(v: Arg) -> bool:
    return all(_int(x) for x in v) if isinstance(v, tuple) else _int(v)


def _bool(v: Arg) -> bool:
    return isinstance(v, bool)


def _scalar(v: Arg) -> bool:
    return isinstance(v, (int, float, NodeRef))


def _dtype(v: Arg) -> bool:
    return isinstance(v, DTypeArg)


def _str(v: Arg) -> bool:
    return isinstance(v, str)


def _any(v: Arg) -> bool:
    return True


# named functions, not lambdas: a schema holds them, and a family, pattern or rule pickles only so
_FITS: Mapping[Kind, Callable[[Arg], bool]] = {
    "tensor": _tensor,
    "tensors": _tensors,
    "int": _int,
    "ints": _ints,
    "float": _tensor,
    "bool": _bool,
    "scalar": _scalar,
    "dtype": _dtype,
    "str": _str,
    "any": _any,
}


def fits(kind: Kind, value: Arg) -> bool:
    """True when ``value`` may be an argument of ``kind`` (a node, for the kinds a node may give).

    >>> fits("bool", 0), fits("int", 0), fits("float", 1)
    (False, True, True)
    """
    return _FITS[kind](value)


# value types that fit a kind outright (a shortcut of _FITS for the common values)
_EXACT: Mapping[Kind, frozenset[type]] = {
    "tensor": frozenset({NodeRef, int, float}),
    "int": frozenset({NodeRef, int}),
    "ints": frozenset({NodeRef, int}),
    "float": frozenset({NodeRef, int, float}),
    "bool": frozenset({bool}),
    "scalar": frozenset({NodeRef, int, float, bool}),
    "dtype": frozenset({DTypeArg}),
    "str": frozenset({str}),
}


def bind(node: NodeSnapshot, schema: Schema) -> Result[Mapping[str, Arg], Malformed]:
    """The node's arguments by (family) name, defaults and fixed values filled in, each checked
    against its declared kind; a read-only mapping.

    >>> s = parse_schema("aten.mm.default(Tensor self, Tensor mat2) -> Tensor")
    >>> n = NodeSnapshot(name="mm", op="call_function", target="aten.mm.default", args=(NodeRef("a"), 2))
    >>> sorted(bind(n, s).unwrap().items())
    [('mat2', 2), ('self', NodeRef(name='a'))]
    >>> bind(NodeSnapshot(name="mm", op="call_function", target="t", args=(NodeRef("a"),)), s).failure().message
    "mm: missing argument 'mat2'"
    """
    memo = node._bound
    if memo is not None and memo[0] is schema:
        return cast(Result[Mapping[str, Arg], Malformed], memo[1])
    bound = _bind(node, schema)
    object.__setattr__(node, "_bound", (schema, bound))  # (a cache of the record's own fields)
    return bound


def _bind(node: NodeSnapshot, schema: Schema) -> Result[Mapping[str, Arg], Malformed]:
    positional, args = schema.positional, node.args
    if len(args) > len(positional):
        return Failure(Malformed(node=node.name, detail=f"{len(args)} positional arguments"))
    given: dict[str, Arg] = dict(zip(positional, args, strict=False))
    for name, value in node.kwargs.items():
        if name in given or name not in schema._by_name:
            return Failure(Malformed(node=node.name, detail=f"unexpected keyword {name!r}"))
        given[name] = value
    bound: dict[str, Arg] = dict(schema.fixed)
    for name, key, has_default, default, none_fits, exact, fits in schema._binding:
        if name in given:
            value = given[name]
        elif has_default:
            value = default
        else:
            return Failure(Malformed(node=node.name, detail=f"missing argument {name!r}"))
        if not (none_fits if value is None else type(value) in exact or fits(value)):
            kind = schema._by_name[name].kind
            return Failure(Malformed(node=node.name, detail=f"{name}={value!r} is not a {kind}"))
        bound[key] = value
    return Success(FrozenDict(bound))


def respell(node: NodeSnapshot, schema: Schema, updates: Mapping[str, Arg]) -> tuple[tuple[Arg, ...], PMap[str, Arg]]:
    """The node's arguments with some replaced by (family) name, in the node's own spelling:
    a value given by position stays positional, one given by keyword stays a keyword.

    >>> s = parse_schema("aten.linear.default(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor")
    >>> n = NodeSnapshot(name="l", op="call_function", target="aten.linear.default", args=(NodeRef("x"), NodeRef("w")))
    >>> respell(n, s, {"bias": NodeRef("b")})[0]
    (NodeRef(name='x'), NodeRef(name='w'), NodeRef(name='b'))

    A None the argument takes when left out is left out, as export writes it:

    >>> respell(n, s, {"bias": None})[0], arguments(s, {"input": NodeRef("x"), "weight": NodeRef("w"), "bias": None})[0]
    ((NodeRef(name='x'), NodeRef(name='w')), (NodeRef(name='x'), NodeRef(name='w')))
    """
    back = schema._back
    positional = schema.positional
    args, kwargs = list(node.args), dict(node.kwargs)
    params = {name: back.get(name, name) for name in updates}
    order, last = schema._order, len(schema.params)
    for name in sorted(updates, key=lambda n: order.get(params[n], last)):
        param = params[name]
        i = positional.index(param) if param in positional else len(positional)
        if i < len(args):
            args[i] = updates[name]
        elif param not in kwargs and _none_by_default(schema, param, updates[name]):
            continue  # left out, as export writes it (``linear(x, w)``; a delegate may read a None as a bias)
        elif i == len(args) and param not in kwargs and param in positional:
            args.append(updates[name])
        else:
            kwargs[param] = updates[name]
    return tuple(args), pmap(kwargs)


def _none_by_default(schema: Schema, name: str, value: Arg) -> bool:
    """``value`` is None, which parameter ``name`` takes when left out."""
    p = schema.param(name)
    return value is None and p is not None and p.has_default and p.default is None


def arguments(schema: Schema, values: Mapping[str, Arg]) -> tuple[tuple[Arg, ...], PMap[str, Arg]]:
    """Positional and keyword arguments for a new call from values by (family) name: positional
    up to the last one given, keyword-only ones as keywords; omitted ones take their defaults.

    >>> s = parse_schema("aten.cat.default(Tensor[] tensors, int dim=0) -> Tensor")
    >>> arguments(s, {"tensors": (NodeRef("a"), NodeRef("b")), "dim": 1})[0]
    ((NodeRef(name='a'), NodeRef(name='b')), 1)
    """
    back = schema._back
    # a None an argument takes when left out is left out (``linear(x, w)``, as export writes it)
    given = {n: v for k, v in values.items() if not _none_by_default(schema, n := back.get(k, k), v)}
    positional = schema.positional
    last = max((i for i, n in enumerate(positional) if n in given), default=-1)
    args = tuple(given[n] if n in given else _default(schema, n) for n in positional[: last + 1])
    kwargs = {n: v for n, v in given.items() if n not in positional[: last + 1]}
    return args, pmap(kwargs)


def _default(schema: Schema, name: str) -> Arg:
    p = schema.param(name)
    return p.default if p is not None else None

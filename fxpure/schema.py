"""Op schemas in torch's own notation, and binding a node's arguments to them by name.

A schema is written as in ``native_functions.yaml``, so a backend author can copy it
from torch: ``"aten.mm.default(Tensor self, Tensor mat2) -> Tensor"``. Binding checks
each argument against its declared kind; a node that does not fit is ``malformed-node``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, TypeAlias, final

from pyrsistent import pmap
from pyrsistent.typing import PMap
from returns.result import Failure, Result, Success

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

    def __post_init__(self) -> None:
        object.__setattr__(self, "fixed", MappingProxyType(dict(self.fixed)))
        object.__setattr__(self, "rename", MappingProxyType(dict(self.rename)))

    @property
    def positional(self) -> tuple[str, ...]:
        """Names of the parameters that may be passed by position."""
        return tuple(p.name for p in self.params if not p.keyword_only)

    @property
    def names(self) -> frozenset[str]:
        """Every name a bound node has: parameters (as renamed) and fixed values."""
        return frozenset({self.rename.get(p.name, p.name) for p in self.params} | set(self.fixed))

    def param(self, name: str) -> Param | None:
        """The parameter a family name refers to, or None (e.g. a fixed value)."""
        back = {v: k for k, v in self.rename.items()}.get(name, name)
        return next((p for p in self.params if p.name == back), None)

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


def _param(text: str, keyword_only: bool) -> Param:
    declared, _, default = text.partition("=")
    type_text, name = _ALIAS.sub("", declared).split()
    optional = "?" in type_text.replace("?[]", "[]")
    base = re.sub(r"\[\d+\]", "[]", type_text.replace("?", "", 1) if optional else type_text)
    kind: Kind = _KINDS.get(base, "any")
    return Param(name, kind, optional, keyword_only, bool(default), _literal(default.strip()) if default else None)


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


def _fits(p: Param, value: Arg) -> bool:
    if value is None:
        return p.optional or p.kind == "any"
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    match p.kind:
        case "tensor":  # a Python number is wrapped into a tensor by torch (``x * 2.0`` -> mul.Tensor)
            return isinstance(value, NodeRef) or number
        case "tensors":
            return isinstance(value, tuple) and all(v is None or isinstance(v, NodeRef) for v in value)
        case "int":
            return isinstance(value, NodeRef) or (isinstance(value, int) and not isinstance(value, bool))
        case "ints":
            items = value if isinstance(value, tuple) else (value,)
            return all(isinstance(v, NodeRef) or (isinstance(v, int) and not isinstance(v, bool)) for v in items)
        case "float":
            return number or isinstance(value, NodeRef)
        case "bool":
            return isinstance(value, bool)
        case "scalar":
            return isinstance(value, (int, float, NodeRef))
        case "dtype":
            return isinstance(value, DTypeArg)
        case "str":
            return isinstance(value, str)
        case "any":
            return True


def bind(node: NodeSnapshot, schema: Schema) -> Result[PMap[str, Arg], Malformed]:
    """The node's arguments by (family) name, defaults and fixed values filled in, each checked
    against its declared kind.

    >>> s = parse_schema("aten.mm.default(Tensor self, Tensor mat2) -> Tensor")
    >>> n = NodeSnapshot(name="mm", op="call_function", target="aten.mm.default", args=(NodeRef("a"), 2))
    >>> sorted(bind(n, s).unwrap().items())
    [('mat2', 2), ('self', NodeRef(name='a'))]
    >>> bind(NodeSnapshot(name="mm", op="call_function", target="t", args=(NodeRef("a"),)), s).failure().message
    "mm: missing argument 'mat2'"
    """
    positional = schema.positional
    if len(node.args) > len(positional):
        return Failure(Malformed(node=node.name, detail=f"{len(node.args)} positional arguments"))
    given: dict[str, Arg] = dict(zip(positional, node.args, strict=False))
    for name, value in node.kwargs.items():
        if name in given or all(p.name != name for p in schema.params):
            return Failure(Malformed(node=node.name, detail=f"unexpected keyword {name!r}"))
        given[name] = value
    bound: dict[str, Arg] = dict(schema.fixed)
    for p in schema.params:
        if p.name not in given and not p.has_default:
            return Failure(Malformed(node=node.name, detail=f"missing argument {p.name!r}"))
        value = given.get(p.name, p.default)
        if not _fits(p, value):
            return Failure(Malformed(node=node.name, detail=f"{p.name}={value!r} is not a {p.kind}"))
        bound[schema.rename.get(p.name, p.name)] = value
    return Success(pmap(bound))


def respell(node: NodeSnapshot, schema: Schema, updates: Mapping[str, Arg]) -> tuple[tuple[Arg, ...], PMap[str, Arg]]:
    """The node's arguments with some replaced by (family) name, in the node's own spelling:
    a value given by position stays positional, one given by keyword stays a keyword.

    >>> s = parse_schema("aten.linear.default(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor")
    >>> n = NodeSnapshot(name="l", op="call_function", target="aten.linear.default", args=(NodeRef("x"), NodeRef("w")))
    >>> respell(n, s, {"bias": NodeRef("b")})[0]
    (NodeRef(name='x'), NodeRef(name='w'), NodeRef(name='b'))
    """
    back: dict[str, str] = {v: k for k, v in schema.rename.items()}
    positional = schema.positional
    args, kwargs = list(node.args), dict(node.kwargs)
    params = {name: back.get(name, name) for name in updates}
    for name in sorted(updates, key=lambda n: _order(schema, params[n])):
        param = params[name]
        i = positional.index(param) if param in positional else len(positional)
        if i < len(args):
            args[i] = updates[name]
        elif i == len(args) and param not in kwargs and param in positional:
            args.append(updates[name])
        else:
            kwargs[param] = updates[name]
    return tuple(args), pmap(kwargs)


def _order(schema: Schema, param: str) -> int:
    return next((i for i, p in enumerate(schema.params) if p.name == param), len(schema.params))


def arguments(schema: Schema, values: Mapping[str, Arg]) -> tuple[tuple[Arg, ...], PMap[str, Arg]]:
    """Positional and keyword arguments for a new call from values by (family) name: positional
    up to the last one given, keyword-only ones as keywords; omitted ones take their defaults.

    >>> s = parse_schema("aten.cat.default(Tensor[] tensors, int dim=0) -> Tensor")
    >>> arguments(s, {"tensors": (NodeRef("a"), NodeRef("b")), "dim": 1})[0]
    ((NodeRef(name='a'), NodeRef(name='b')), 1)
    """
    back = {v: k for k, v in schema.rename.items()}
    given = {back.get(k, k): v for k, v in values.items()}
    positional = schema.positional
    last = max((i for i, n in enumerate(positional) if n in given), default=-1)
    args = tuple(given[n] if n in given else _default(schema, n) for n in positional[: last + 1])
    kwargs = {n: v for n, v in given.items() if n not in positional[: last + 1]}
    return args, pmap(kwargs)


def _default(schema: Schema, name: str) -> Arg:
    p = schema.param(name)
    return p.default if p is not None else None

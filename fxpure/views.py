"""Views: one normalised record for the many spellings of an op."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import final

from pyrsistent import pmap
from pyrsistent.typing import PMap
from returns.result import Failure, Result, Success

from fxpure.reasons import Malformed, first_failure
from fxpure.snapshot import Arg, GraphSnapshot, NodeRef, NodeSnapshot


@final
@dataclass(frozen=True, slots=True)
class _Schema:
    """Positional parameter names, defaults, and values the spelling itself implies."""

    params: tuple[str, ...]
    defaults: Mapping[str, Arg]
    fixed: Mapping[str, Arg]

    def __post_init__(self) -> None:
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))
        object.__setattr__(self, "fixed", MappingProxyType(dict(self.fixed)))


_CONV_DEFAULTS: Mapping[str, Arg] = {
    "bias": None,
    "stride": 1,
    "padding": 0,
    "dilation": 1,
    "groups": 1,
    "output_padding": 0,
}
_CONV_N = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_T = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation")
_CONVOLUTION = (
    "input",
    "weight",
    "bias",
    "stride",
    "padding",
    "dilation",
    "transposed",
    "output_padding",
    "groups",
)

# canonical target -> argument schema; rank is read from the weight when absent
CONV_SCHEMAS: Mapping[str, _Schema] = {
    **{
        f"aten.conv{r}d.{ov}": _Schema(_CONV_N, _CONV_DEFAULTS, {"transposed": False})
        for r in (1, 2, 3)
        for ov in ("default", "padding")
    },
    **{
        f"aten.conv_transpose{r}d.{ov}": _Schema(_CONV_T, _CONV_DEFAULTS, {"transposed": True})
        for r in (1, 2, 3)
        for ov in ("default", "input")
    },
    "aten.convolution.default": _Schema(_CONVOLUTION, _CONV_DEFAULTS, {}),
}

_BN_NATIVE = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps")
BATCH_NORM_SCHEMAS: Mapping[str, _Schema] = {
    "aten.batch_norm.default": _Schema(
        (*_BN_NATIVE, "cudnn_enabled"), {"weight": None, "bias": None}, {"tuple_output": False}
    ),
    "aten.native_batch_norm.default": _Schema(_BN_NATIVE, {}, {"tuple_output": True}),
    "aten._native_batch_norm_legit.default": _Schema(_BN_NATIVE, {}, {"tuple_output": True}),
    "aten._native_batch_norm_legit_no_training.default": _Schema(
        ("input", "weight", "bias", "running_mean", "running_var", "momentum", "eps"),
        {},
        {"tuple_output": True, "training": False},
    ),
}


def respell(node: NodeSnapshot, updates: Mapping[str, Arg]) -> tuple[tuple[Arg, ...], PMap[str, Arg]]:
    """The node's arguments with some replaced by name, in the node's own spelling.

    >>> n = NodeSnapshot(name="c", op="call_function", target="aten.conv2d.default",
    ...                  args=(NodeRef("x"), NodeRef("w")))
    >>> respell(n, {"weight": NodeRef("w2"), "bias": NodeRef("b2")})[0]
    (NodeRef(name='x'), NodeRef(name='w2'), NodeRef(name='b2'))
    """
    params = CONV_SCHEMAS[node.target].params
    args, kwargs = list(node.args), dict(node.kwargs)
    for name in sorted(updates, key=params.index):
        i = params.index(name)
        if i < len(args):
            args[i] = updates[name]
        elif i == len(args) and name not in kwargs:
            args.append(updates[name])
        else:
            kwargs[name] = updates[name]
    return tuple(args), pmap(kwargs)


def bind(node: NodeSnapshot, schema: _Schema) -> Result[dict[str, Arg], Malformed]:
    """Arguments of ``node`` by parameter name, with defaults and fixed values."""
    if len(node.args) > len(schema.params):
        return Failure(Malformed(node=node.name, detail=f"{len(node.args)} positional arguments"))
    bound: dict[str, Arg] = dict(schema.fixed)
    for name, value in zip(schema.params, node.args, strict=False):
        bound[name] = value
    for name, value in node.kwargs.items():
        if name not in schema.params:
            return Failure(Malformed(node=node.name, detail=f"unexpected keyword {name!r}"))
        bound[name] = value
    for name in schema.params:
        if name not in bound:
            if name not in schema.defaults:
                return Failure(Malformed(node=node.name, detail=f"missing argument {name!r}"))
            bound[name] = schema.defaults[name]
    return Success({**schema.defaults, **bound})


def _ref(node: str, name: str, value: Arg, *, optional: bool) -> Result[NodeRef | None, Malformed]:
    if isinstance(value, NodeRef) or (optional and value is None):
        return Success(value)
    return Failure(Malformed(node=node, detail=f"{name} is {value!r}, expected a tensor"))


def _tensor(node: str, name: str, value: Arg) -> Result[NodeRef, Malformed]:
    if isinstance(value, NodeRef):
        return Success(value)
    return Failure(Malformed(node=node, detail=f"{name} is {value!r}, expected a tensor"))


def _ints(node: str, name: str, value: Arg, rank: int) -> Result[tuple[int, ...], Malformed]:
    items = value if isinstance(value, tuple) else (value,)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
        return Failure(Malformed(node=node, detail=f"{name}={value!r} is not a list of ints"))
    ints = tuple(v for v in items if isinstance(v, int))
    if len(ints) == 1:
        return Success(ints * rank)
    if len(ints) != rank:
        return Failure(Malformed(node=node, detail=f"{name}={value!r} does not fit {rank} spatial dims"))
    return Success(ints)


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class ConvView:
    """A convolution in any spelling: operands and normalised hyper-parameters."""

    node: str
    x: NodeRef
    w: NodeRef
    b: NodeRef | None
    stride: tuple[int, ...]
    padding: tuple[int, ...] | str
    dilation: tuple[int, ...]
    transposed: bool
    output_padding: tuple[int, ...]
    groups: int

    @property
    def rank(self) -> int:
        """Number of spatial dims."""
        return len(self.stride)


def _conv_rank(snap: GraphSnapshot, node: NodeSnapshot, w: Arg) -> int | None:
    digit = node.target.removeprefix("aten.conv_transpose").removeprefix("aten.conv")[:1]
    if digit in ("1", "2", "3"):
        return int(digit)
    spec = snap.node(w.name).tensor_spec if isinstance(w, NodeRef) and w.name in snap.index else None
    return len(spec.shape) - 2 if spec is not None and len(spec.shape) >= 3 else None


def conv_view(snap: GraphSnapshot, node: NodeSnapshot) -> Result[ConvView, Malformed]:
    """Normalise ``aten.conv{1,2,3}d``, ``conv_transpose*`` and ``convolution``.

    >>> from fxpure.snapshot import snapshot
    >>> n = NodeSnapshot(name="c", op="call_function", target="aten.conv2d.default",
    ...                  args=(NodeRef("x"), NodeRef("w"), None, (2, 2)))
    >>> v = conv_view(snapshot([], {}), n).unwrap()
    >>> v.stride, v.padding, v.groups, v.transposed
    ((2, 2), (0, 0), 1, False)
    """
    schema = CONV_SCHEMAS.get(node.target)
    if schema is None or node.op != "call_function":
        return Failure(Malformed(node=node.name, detail=f"{node.target} is not a convolution"))
    return bind(node, schema).bind(lambda a: _conv_from(snap, node, a))


def _conv_from(snap: GraphSnapshot, node: NodeSnapshot, a: dict[str, Arg]) -> Result[ConvView, Malformed]:
    n = node.name
    rank = _conv_rank(snap, node, a["weight"])
    transposed, groups, padding = a["transposed"], a["groups"], a["padding"]
    if rank is None or not isinstance(transposed, bool) or not isinstance(groups, int) or groups < 1:
        return Failure(Malformed(node=n, detail="cannot tell rank, transposed or groups"))
    x, w = _tensor(n, "input", a["input"]), _tensor(n, "weight", a["weight"])
    b = _ref(n, "bias", a["bias"], optional=True)
    stride, dilation = _ints(n, "stride", a["stride"], rank), _ints(n, "dilation", a["dilation"], rank)
    out_pad = _ints(n, "output_padding", a["output_padding"], rank)
    pad: Result[tuple[int, ...] | str, Malformed] = (
        Success(padding) if isinstance(padding, str) else _ints(n, "padding", padding, rank)
    )
    if (err := first_failure((x, w, b, stride, dilation, out_pad, pad))) is not None:
        return Failure(err)
    return Success(
        ConvView(
            node=n,
            x=x.unwrap(),
            w=w.unwrap(),
            b=b.unwrap(),
            stride=stride.unwrap(),
            padding=pad.unwrap(),
            dilation=dilation.unwrap(),
            transposed=transposed,
            output_padding=out_pad.unwrap(),
            groups=groups,
        )
    )


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class BatchNormView:
    """A batch norm in any spelling; ``tuple_output`` when users go through getitem."""

    node: str
    x: NodeRef
    weight: NodeRef | None
    bias: NodeRef | None
    mean: NodeRef | None
    var: NodeRef | None
    training: bool
    eps: float
    tuple_output: bool


def batch_norm_view(snap: GraphSnapshot, node: NodeSnapshot) -> Result[BatchNormView, Malformed]:
    """Normalise ``batch_norm``, ``native_batch_norm`` and the ``_legit`` forms.

    >>> from fxpure.snapshot import snapshot
    >>> n = NodeSnapshot(name="bn", op="call_function",
    ...     target="aten._native_batch_norm_legit_no_training.default",
    ...     args=(NodeRef("c"), None, None, NodeRef("m"), NodeRef("v"), 0.1, 1e-5))
    >>> v = batch_norm_view(snapshot([], {}), n).unwrap()
    >>> v.training, v.eps, v.tuple_output, v.weight
    (False, 1e-05, True, None)
    """
    schema = BATCH_NORM_SCHEMAS.get(node.target)
    if schema is None or node.op != "call_function":
        return Failure(Malformed(node=node.name, detail=f"{node.target} is not a batch norm"))
    return bind(node, schema).bind(lambda a: _bn_from(node.name, a))


def _bn_from(n: str, a: dict[str, Arg]) -> Result[BatchNormView, Malformed]:
    training, eps, tuple_output = a["training"], a["eps"], a["tuple_output"]
    if not isinstance(training, bool) or not isinstance(tuple_output, bool):
        return Failure(Malformed(node=n, detail=f"training={training!r} is not a bool"))
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        return Failure(Malformed(node=n, detail=f"eps={eps!r} is not a number"))
    refs = {k: _ref(n, k, a[k], optional=True) for k in ("input", "weight", "bias", "running_mean", "running_var")}
    if (err := first_failure(refs.values())) is not None:
        return Failure(err)
    got = {k: r.unwrap() for k, r in refs.items()}
    x = got["input"]
    if x is None:
        return Failure(Malformed(node=n, detail="input is None"))
    return Success(
        BatchNormView(
            node=n,
            x=x,
            weight=got["weight"],
            bias=got["bias"],
            mean=got["running_mean"],
            var=got["running_var"],
            training=training,
            eps=float(eps),
            tuple_output=tuple_output,
        )
    )

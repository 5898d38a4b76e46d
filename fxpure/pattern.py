"""fxpure.pattern: rules as declarative patterns with typed reasons, located in the graph and
in the pattern.

A pattern is frozen data built from a few primitives; each owns one failure mode and one
reason record, so a rule made only of primitives cannot decline without a typed reason:

=================  =======================================  ===================================
primitive          matches                                   fails with
=================  =======================================  ===================================
``Op(FAMILY, …)``  a node of an op family, arguments by      ``WrongOp`` (another op),
                   schema name; inner nodes single-use       ``OutputShared`` (another reader),
                   (``users=ANY`` to share); ``out=i``       ``TupleUsed`` (another element read),
                   projects a tuple output; ``user=`` its    ``Malformed`` (arguments do not fit)
                   one consumer; ``commute=True``; ``when=``
                   only the calls a ``When`` takes
``Const(name)``    a constant (or an earlier rule's          ``NotConstant``
                   derived one); ``optional=True``: or None
``Scalar(name)``   a Python number                           ``NotScalar``
``Lit(*values)``   a non-tensor argument with one of values  ``ArgMismatch``
``Var(name)``      anything; a repeated name, the same one   ``BindingConflict``
                   (``code=`` names its reason)
``OneOf(*alts)``   the first alternative that matches        the reason of the one that got furthest
``need.*``         typed checks on bound values              ``SymbolicShape``, ``UnsupportedDtype``,
                                                             ``UnsupportedRank``, ``ChannelMismatch``,
                                                             or a rule's own (``need.check``)
``need.compute``   a value computed once per match, read     a rule's own
                   by the checks after it and the planner
=================  =======================================  ===================================

Matching is pure, deterministic and depth-first in declaration order, from a root found
through the snapshot's index by target. Every reason carries ``path``: ``bn.input/conv.weight``
is the ``weight`` argument of the op called ``conv``, itself the ``input`` of ``bn``. A pattern
that names an argument its family does not have, or a planner or check that reads a name the
pattern never binds, raises :class:`PatternError` when the rule is built (at import).
"""

from __future__ import annotations

import builtins
import inspect
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Literal, TypeAlias, cast, final

from pyrsistent import pmap
from returns.result import Failure, Result, Success

from fxpure.families import BATCH_NORM, CLONE, CONV, DEQUANTIZE, DROPOUT, RELU, RELU_, SCHEMAS, Family, spelled
from fxpure.frozen import FrozenDict
from fxpure.layout import SIZE_QUERIES
from fxpure.plan import (
    RUNS_EXHAUSTED,
    NewConstant,
    NewNode,
    RewritePlan,
    RewriteReport,
    Rule,
    computed_by,
    constant_expr,
    held,
    ill_fitting,
    not_constant,
    rewrite,
    runs,
)
from fxpure.reasons import (
    GENERIC_CODES,
    ArgMismatch,
    BindingConflict,
    ChannelMismatch,
    Malformed,
    NotScalar,
    OutputShared,
    Reason,
    SymbolicShape,
    TupleUsed,
    UnsupportedDtype,
    UnsupportedRank,
    WrongOp,
)
from fxpure.schema import TENSOR_KINDS, Schema, arguments, fits, respell
from fxpure.snapshot import (
    Arg,
    ConstantKind,
    DTypeArg,
    GraphSnapshot,
    NodeRef,
    NodeSnapshot,
    Spec,
    TensorSpec,
    ref_list,
    refs,
)
from fxpure.weights import EXPR_NODE, Cast, Fill, Source, WeightExpr, infer_spec, known_values, out_channels, sources

ONE: Literal["one"] = "one"
ANY: Literal["any"] = "any"
Users: TypeAlias = Literal["one", "any"]


class PatternError(TypeError):
    """A pattern or rule that cannot work, found when it is built (not on some later model)."""


@final
@dataclass(frozen=True, slots=True)
class Const:
    """A constant operand (parameter, buffer, lifted or derived constant), bound as a ``WeightExpr``.
    ``optional=True``: an absent operand (None) binds None; a computed one still fails."""

    name: str
    optional: bool = False


@final
@dataclass(frozen=True, slots=True)
class Scalar:
    """A Python number in an operand slot (``x * 2.0``), bound as the number."""

    name: str


@final
@dataclass(frozen=True, slots=True, init=False)
class Lit:
    """A non-tensor argument that must equal one of ``values`` (``0`` and ``0.0`` are equal, but
    ``False`` is not ``0``). ``code`` and ``text`` (a message with ``{node}``, ``{role}``, ``{value}``, ``{expected}``)
    name the reason; ``name`` binds the value."""

    values: tuple[Arg, ...]
    name: str | None
    code: str
    text: str

    def __init__(self, *values: Arg, name: str | None = None, code: str = "arg-mismatch", text: str = "") -> None:
        if not values:
            raise PatternError("Lit needs at least one allowed value")
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "code", code)
        object.__setattr__(self, "text", text)


CONFLICT = "binding-conflict"  # a name bound to two values, unless its Var names another code


@final
@dataclass(frozen=True, slots=True)
class Var:
    """Any argument (a node reference, usually), bound as it is; a name used twice must bind the
    same value, else the match fails with ``code`` (``Var("x", code="not-tied")``)."""

    name: str
    code: str = CONFLICT


@final
@dataclass(frozen=True, slots=True, init=False)
class OneOf:
    """Alternatives, tried in order; on failure, the reason of the one that got furthest. Where
    every alternative finds another op at the same node, ``wrong-op`` lists what each expected
    ("not a linear or a matrix product or ..."), or says ``noun`` ("a linear") where one is given.

    >>> from fxpure.families import ADD, MM, RELU
    >>> from fxpure.testing import GraphBuilder
    >>> g = GraphBuilder()
    >>> x = g.input("x", (2, 2))
    >>> g.output(g.call("aten.relu.default", name="relu", self=g.call("aten.neg.default", name="neg", self=x)))
    >>> snap = g.build()
    >>> def why(p: OneOf) -> str:
    ...     return match(Op(RELU, self=p), snap, snap.node("relu")).failure().message
    >>> why(OneOf(Op(MM), Op(ADD)))
    'self of relu comes from neg (aten.neg.default), not a matrix product or an addition'
    >>> why(OneOf(Op(MM), Op(ADD), noun="a sum or product"))
    'self of relu comes from neg (aten.neg.default), not a sum or product'
    """

    alternatives: tuple[Pattern, ...]
    tops: tuple[Op, ...] = field(repr=False, compare=False)  # the Ops it may be anchored at: see roots
    noun: str = ""

    def __init__(self, *alternatives: Pattern, noun: str = "") -> None:
        if len(alternatives) < 2:
            raise PatternError("OneOf needs two or more alternatives")
        object.__setattr__(self, "alternatives", alternatives)
        object.__setattr__(self, "noun", noun)
        tops = (op for a in alternatives if isinstance(a, Op | OneOf) for op in roots(a))
        object.__setattr__(self, "tops", tuple(tops))


@final
@dataclass(frozen=True, slots=True)
class When:
    """Which calls of an op's family the op matches: those where ``test(snap, node)`` holds;
    ``text`` completes the family's noun in the reason for another (``When(is_linear, "of a
    weight")``: "comes from bmm (aten.bmm.default), not a batched matrix product of a weight")."""

    test: Callable[[GraphSnapshot, NodeSnapshot], bool]
    text: str


@final
@dataclass(frozen=True, slots=True, init=False)
class Op:
    """A node of ``family`` whose arguments (by schema name) match sub-patterns; a plain value is
    ``Lit(value)``. An inner node must be read by its parent only (``users=ONE``) unless
    ``users=ANY`` (and then not written in place: its parent would read the write); ``user=``
    matches the node's one consumer; ``out=i`` reads a tuple-output op through ``getitem(·, i)``
    (all its users must: checked after its arguments); ``commute=True`` tries the family's two
    commuting arguments both ways. ``code``/``shared``/``out_code`` name the three reasons.
    ``transparent=True``: reasons about its value (its first operand, in the schema) name the node and argument
    that read it (a dequantized weight that is not a constant is "weight of conv", not "input of
    dq"); those about its other operands name it (its scale is "scale of dq").
    ``when``: which calls of the family an operand's op matches (:class:`When`); another is a
    wrong op, with ``code``, as a call of another family is (a rule's ``candidate`` chooses its
    root's calls)."""

    family: Family
    name: str | None
    args: tuple[tuple[str, Pattern], ...]
    users: Users
    user: Pattern | None
    out: int | None
    commute: bool
    code: str
    shared: str
    out_code: str
    transparent: bool
    when: When | None

    def __init__(
        self,
        family: Family,
        /,
        *,
        name: str | None = None,
        users: Users = ONE,
        user: Pattern | None = None,
        out: int | None = None,
        commute: bool = False,
        code: str = "wrong-op",
        shared: str = "output-shared",
        out_code: str = "tuple-output-used",
        transparent: bool = False,
        when: When | None = None,
        **args: Pattern | Arg,
    ) -> None:
        for key, value in (
            ("family", family),
            ("name", name),
            (
                "args",
                tuple(
                    (k, v if isinstance(v, Op | Const | Scalar | Lit | Var | OneOf) else Lit(v))
                    for k, v in args.items()
                ),
            ),
            ("users", users),
            ("user", user),
            ("out", out),
            ("commute", commute),
            ("code", code),
            ("shared", shared),
            ("out_code", out_code),
            ("transparent", transparent),
            ("when", when),
        ):
            object.__setattr__(self, key, value)

    @property
    def label(self) -> str:
        """The op's name in paths: its binding name, else its family's."""
        return self.name or self.family.name

    @staticmethod
    def of(
        family: Family,
        arguments: Mapping[str, Pattern | Arg],
        /,
        *,
        name: str | None = None,
        users: Users = ONE,
        user: Pattern | None = None,
        out: int | None = None,
        commute: bool = False,
        code: str = "wrong-op",
        shared: str = "output-shared",
        out_code: str = "tuple-output-used",
        transparent: bool = False,
        when: When | None = None,
    ) -> Op:
        """An Op whose argument patterns come in a mapping (for helpers that build patterns)."""
        op = Op(
            family,
            name=name,
            users=users,
            user=user,
            out=out,
            commute=commute,
            code=code,
            shared=shared,
            out_code=out_code,
            transparent=transparent,
            when=when,
        )
        object.__setattr__(op, "args", _wrap(arguments))
        return op


Pattern: TypeAlias = Op | Const | Scalar | Lit | Var | OneOf


def _wrap(args: Mapping[str, Pattern | Arg]) -> tuple[tuple[str, Pattern], ...]:
    return tuple((k, v if isinstance(v, Op | Const | Scalar | Lit | Var | OneOf) else Lit(v)) for k, v in args.items())


def dequantized(
    value: Pattern,
    *,
    name: str | None = None,
    family: Family = DEQUANTIZE,
    users: Users = ANY,
    code: str = "wrong-op",
    **qparams: Pattern | Arg,
) -> Op:
    """A constant behind a dequantize: ``dequantized(Const("w"), name="dq")`` binds the integer
    weight as ``w`` and the dequantize as ``dq`` (its ``scale``, ``zero_point``, ``axis``, ...);
    ``qparams`` match those too. Shared by default: two convs may read one dequantized weight.
    Transparent: a reason about the integer value names the op that reads the dequantized value
    (one about a scale or zero point, the dequantize)."""
    return Op.of(family, {"input": value, **qparams}, name=name, users=users, code=code, transparent=True)


def eval_batch_norm(input: Pattern, *, name: str = "bn") -> Op:
    """A batch norm in eval mode of ``input``, read by its first output in every spelling (edge's
    ``_native_batch_norm_legit_no_training`` through ``getitem(·, 0)``; another read:
    ``bn-stats-used``), its running statistics constants bound as ``mean`` and ``var``, its affine
    ones as ``gamma`` and ``beta`` (None where it has none); one in training mode is declined
    ``bn-training-mode``. Its ``eps``: ``bn.float("eps")`` in the planner."""
    return Op(
        BATCH_NORM,
        name=name,
        out=0,
        out_code="bn-stats-used",
        training=Lit(False, code="bn-training-mode", text="{node} runs in training mode (batch statistics)"),
        input=input,
        weight=Const("gamma", optional=True),
        bias=Const("beta", optional=True),
        running_mean=Const("mean"),
        running_var=Const("var"),
    )


def idle(value: Pattern, *, code: str = "wrong-op", shared: str = "output-shared") -> tuple[Op, Op]:
    """``value`` read through an op that returns it as it is, bound as ``idle``: a dropout in eval
    mode (``train=False``, in place too; it goes with the match) or a copy (``clone``, ``contiguous``,
    and edge's ``_clone_dim_order``, as ``to_edge`` spells an eval dropout), which :meth:`Planner.copied` keeps,
    of the new value, in its layout. ``OneOf(value, *idle(value))`` takes all three."""
    return (
        Op(DROPOUT, name="idle", code=code, shared=shared, self=value, train=Lit(False)),
        Op(CLONE, name="idle", code=code, shared=shared, self=value),
    )


# --- what a match binds ----------------------------------------------------------------------------


class NotLiteral(TypeError):
    """A :class:`Bound` accessor read an argument that the node gives by another node (a value
    computed at run time, such as a symbolic ``eps``) where the rule needs a literal, or
    :meth:`Match.shape` a shape that is not static. A
    :class:`PatternRule` declines with ``reason`` (``malformed-node``, located at ``plan``); any
    other accessor misuse (an argument of another kind, or one the family does not have) stays a
    ``TypeError``: a bug in the rule."""

    def __init__(self, reason: Malformed) -> None:
        super().__init__(reason.message)
        self.reason = reason


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class Bound:
    """An op node the pattern matched: its arguments by name in the family's normal form, and
    ``uses``, the nodes whose uses a replacement takes (the node, or its ``getitem(·, i)``)."""

    node: NodeSnapshot
    family: Family = field(compare=False)
    args: Mapping[str, Arg] = field(hash=False)
    uses: tuple[str, ...]
    out: int | None = None  # the element of a tuple output the pattern reads (``Op(..., out=i)``)

    @property
    def name(self) -> str:
        """The node's name."""
        return self.node.name

    @property
    def spec(self) -> TensorSpec | None:
        """The node's output spec when it is one tensor, or the spec of the element it is read as."""
        spec = self.node.spec
        if isinstance(spec, tuple) and self.out is not None and 0 <= self.out < len(spec):
            return spec[self.out]
        return self.node.tensor_spec

    def _wrong(self, arg: str, v: Arg, what: str) -> TypeError:
        """:class:`NotLiteral` when the node gives ``arg`` (or an element of it) by a node, else a
        ``TypeError`` (a bug in the rule)."""
        by = (
            v
            if isinstance(v, NodeRef)
            else next((x for x in v if isinstance(x, NodeRef)), None)
            if isinstance(v, tuple)
            else None
        )
        if by is None:
            return TypeError(f"{self.name}.{arg} is {v!r}, not {what}")
        detail = f"{self.name}.{arg} is computed by {by.name!r} at run time; the rule needs it as {what}"
        return NotLiteral(Malformed(node=self.name, detail=detail))

    def int(self, arg: str) -> int:
        """An int argument (:class:`NotLiteral` if the node gives it by a node; TypeError if it is
        no int: a bug in the rule). The accessors below do the same."""
        v = self.args.get(arg)
        if not isinstance(v, int) or isinstance(v, bool):
            raise self._wrong(arg, v, "an int")
        return v

    def ints(self, arg: str) -> tuple[builtins.int, ...]:
        """An int-list argument."""
        v = self.args.get(arg)
        if not isinstance(v, tuple) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
            raise self._wrong(arg, v, "a tuple of ints")
        return tuple(i for i in v if isinstance(i, int))

    def float(self, arg: str) -> builtins.float:
        """A float argument (an int is accepted)."""
        v = self.args.get(arg)
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise self._wrong(arg, v, "a number")
        return float(v)

    def bool(self, arg: str) -> builtins.bool:
        """A bool argument."""
        v = self.args.get(arg)
        if not isinstance(v, bool):
            raise self._wrong(arg, v, "a bool")
        return v

    def ref(self, arg: str) -> NodeRef:
        """A tensor argument given by a node."""
        v = self.args.get(arg)
        if not isinstance(v, NodeRef):
            raise TypeError(f"{self.name}.{arg} is {v!r}, not a node")
        return v


Binding: TypeAlias = Bound | WeightExpr | Arg


Values: TypeAlias = Mapping[str, object]
"""What a rule's ``need.compute`` steps computed for one match, by name."""

_NOTHING: Values = FrozenDict({})


@final
@dataclass(frozen=True, slots=True)
class Site:
    """Where a name was bound: the node that reads it, the argument, the pattern path."""

    node: str
    role: str
    path: str


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class Match:
    """A successful match at ``anchor``: bindings by name, where each was bound, the matched nodes
    a replacement erases (``erase``) and the shared ones it drops once unused (``prune``)."""

    snap: GraphSnapshot
    anchor: str
    bindings: Mapping[str, Binding] = field(hash=False)
    sites: Mapping[str, Site] = field(hash=False)
    erase: tuple[str, ...]
    prune: tuple[str, ...]
    sized: Mapping[str, OutputShared] = field(default_factory=dict, hash=False)
    """Inner nodes read otherwise only for their sizes (``sym_size``: a dynamic program's
    ``x.shape``), with the reason to decline if no replacement of their shape can answer them."""

    def spec(self, name: str) -> TensorSpec | None:
        """Shape and dtype of a bound value (a constant expression, an op's output, a node)."""
        value = self.bindings.get(name)
        if isinstance(value, Bound):
            return value.spec
        if isinstance(value, NodeRef):
            return self.snap.node(value.name).tensor_spec if value.name in self.snap.index else None
        if isinstance(value, WeightExpr):
            spec = infer_spec(value)
            return spec.unwrap() if isinstance(spec, Success) else None
        return None

    def values(self, name: str) -> tuple[int | float, ...] | None:
        """The data of a bound constant when it is a small integer vector (zero points, say) or a
        number held as a 0-d tensor (an edge program lifts the ``1.0`` of ``x * 1.0`` so): the
        program's, or an earlier rule's fill of one integer (``Fill(shape=(oc,), value=0)``), or such
        a number cast to a float dtype (a float16 edge program's ``x * 1.0`` casts a float32 ``1.0``;
        the value as the cast rounds it, None for bfloat16); a bound number as itself, ``(1.0,)``, so
        that one check reads ``x * 1.0`` in every form; a ``Var`` bound to a constant's node reads
        its data too."""
        value = self.bindings.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return (value,)
        if isinstance(value, Source | NodeRef):  # the program's own: captured when small
            info = self.snap.constants.get(value.key if isinstance(value, Source) else value.name)
            return info.values if info is not None else None
        if isinstance(value, Cast) and isinstance(value.x, Source):  # a number cast to the op's dtype (edge's)
            info = self.snap.constants.get(value.x.key)
            held = info.values if info is not None else None
            if held is None or len(held) != 1 or value.dtype not in ("float64", "float32", "float16"):
                return None
            return known_values(Fill(shape=(), value=float(held[0]), dtype=value.dtype))  # (as the cast rounds it)
        return known_values(value) if isinstance(value, WeightExpr) else None

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of a bound value, each size an int: what a planner or check reads after
        ``need.static(name)`` (no ``assert`` to narrow it). Unknown, or with a symbolic size (no such
        check before it), it is :class:`NotLiteral`: the rule declines ``malformed-node`` at
        ``plan``, saying which value."""
        dims = self._spec_of(name).shape
        sizes = tuple(d for d in dims if isinstance(d, int))
        if len(sizes) != len(dims):
            detail = f"{name} has the symbolic shape {dims}; the rule reads it as static (need.static({name!r}))"
            raise NotLiteral(Malformed(node=self._node_of(name), detail=detail))
        return sizes

    def dtype(self, name: str) -> str:
        """The dtype of a bound value (:class:`NotLiteral` where it is unknown, as :meth:`shape`); a
        Python number's is ``int64`` or ``float64``, as :meth:`need.dtype <_Need.dtype>` reads it
        (its shape is ``()``)."""
        return self._spec_of(name).dtype

    def _spec_of(self, name: str) -> TensorSpec:
        value, spec = self.bindings.get(name), self.spec(name)
        if value is None:  # a bug in the rule, whatever the graph
            raise TypeError(
                f"{name} is not bound at {self.anchor} (an optional operand absent, or no name of the pattern)"
            )
        if spec is None and isinstance(value, int | float) and not isinstance(value, bool):
            # a Python number (``Scalar``): no dims, and the dtype ``need.dtype`` gives it
            return TensorSpec(shape=(), dtype="int64" if isinstance(value, int) else "float64")
        if spec is None:
            raise NotLiteral(Malformed(node=self._node_of(name), detail=f"{name} has no known shape and dtype"))
        return spec

    def _node_of(self, name: str) -> str:
        site = self.sites.get(name)
        return site.node if site is not None else self.anchor


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class Attempt:
    """How far a rule got at one node: the reason it declined (None: it would rewrite), the
    bindings made before that, and how many primitives matched (``depth``)."""

    rule: str
    anchor: str
    reason: Reason | None
    bindings: Mapping[str, Binding] = field(hash=False)
    depth: int


# --- matching --------------------------------------------------------------------------------------


@dataclass(slots=True)
class _State:
    """Working state of one match (local, never escapes); ``fork`` for alternatives."""

    snap: GraphSnapshot
    bindings: dict[str, Binding] = field(default_factory=dict)
    sites: dict[str, Site] = field(default_factory=dict)
    erase: list[str] = field(default_factory=list)
    prune: list[str] = field(default_factory=list)
    depth: int = 0
    kept: bool = False  # below a node others read too: what matches here is pruned, never erased
    sized: dict[str, OutputShared] = field(default_factory=dict)  # see Match.sized
    coded: dict[str, str] = field(default_factory=dict)  # name -> a Var's own code for a conflict of it
    # a candidate filter's match (a rule's ``candidate=`` pattern): a strict argument the pattern
    # leaves unnamed keeps no node from being a candidate, which the rule then declines, saying why
    loose: bool = False

    def fork(self) -> _State:
        return _State(
            self.snap,
            dict(self.bindings),
            dict(self.sites),
            list(self.erase),
            list(self.prune),
            self.depth,
            self.kept,
            dict(self.sized),
            dict(self.coded),
            self.loose,
        )

    def bind(
        self,
        name: str | None,
        value: Binding,
        node: str,
        role: str,
        path: str,
        *,
        count: bool = True,
        code: str = CONFLICT,
    ) -> Reason | None:
        """Bind ``name`` (None: nothing to bind) to ``value``, read as ``role`` of ``node`` at ``path``;
        ``code``: a ``Var``'s own, which names a conflict of ``name`` wherever it is found."""
        self.depth += count
        if name is None:
            return None
        if code != CONFLICT:
            self.coded.setdefault(name, code)
        if name in self.bindings:
            first = self.bindings[name]
            if first != value and not self._same_node(first, value):
                shown = _show(first), _show(value)
                code = self.coded.get(name, CONFLICT)
                return BindingConflict(code=code, node=node, name=name, first=shown[0], second=shown[1], path=path)
            return None
        self.bindings[name] = value
        self.sites[name] = Site(node, role, path)
        return None

    def _same_node(self, a: Binding, b: Binding) -> bool:
        """An op (or a constant) and a node reference that name one node: an ``Op`` and a ``Var``
        (or a ``Const`` and a ``Var``) of one name bound at one node."""
        if isinstance(b, NodeRef):
            a, b = b, a
        if not isinstance(a, NodeRef):
            return False
        if isinstance(b, Bound):
            return a.name == b.name or a.name in b.uses
        return constant_expr(self.snap, a.name) == b if isinstance(b, WeightExpr) else False


def _show(value: Binding) -> str:
    if isinstance(value, Bound):
        return value.name
    if isinstance(value, NodeRef):
        return value.name
    return repr(value)


_NUMBERS = (int, float)


def _strict_equal(a: Arg, b: Arg) -> bool:
    """Equal in type and value, except that an int and a float of one value are equal (export
    writes ``hardtanh``'s 0.0 as 0 once ``to_edge`` ran); a bool equals only a bool."""
    if type(a) is not type(b):
        return type(a) in _NUMBERS and type(b) in _NUMBERS and a == b
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_strict_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _best(st: _State, tries: Iterable[Callable[[_State], Reason | None]], noun: str = "") -> Reason | None:
    """Run alternatives on forks of ``st``; adopt the first that succeeds, else the furthest failure
    (said as ``noun`` where every alternative expected another op at one node)."""
    options = list(tries)
    if len(options) == 1:  # no alternative: no fork (the state a fork would leave is the same)
        return options[0](st)
    best: tuple[_State, Reason] | None = None
    also: list[str] = []  # what alternatives that missed the same node as best expected instead
    for attempt in options:
        fork = st.fork()
        err = attempt(fork)
        if err is None:
            _adopt(st, fork)
            return None
        if best is None or fork.depth > best[0].depth:
            best, also = (fork, err), []
        elif fork.depth == best[0].depth and isinstance(err, WrongOp) and _same_miss(best[1], err):
            also.append(err.expected)  # not this op nor that one
    assert best is not None
    _adopt(st, best[0])
    if also and isinstance(best[1], WrongOp):
        if noun and len(also) == len(options) - 1:
            return replace(best[1], expected=noun)
        nouns = dict.fromkeys(n for e in (best[1].expected, *also) for n in e.split(" or "))
        return replace(best[1], expected=" or ".join(nouns))
    return best[1]


def _same_miss(a: Reason, b: Reason) -> bool:
    """Both say one node is another op than expected (two alternatives' roots missed it)."""
    return (
        isinstance(a, WrongOp)
        and isinstance(b, WrongOp)
        and (a.code, a.node, a.role, a.producer, a.consumer) == (b.code, b.node, b.role, b.producer, b.consumer)
    )


def _adopt(st: _State, fork: _State) -> None:
    st.bindings, st.sites, st.erase, st.prune, st.depth = fork.bindings, fork.sites, fork.erase, fork.prune, fork.depth
    st.sized = fork.sized


def _match(p: Pattern, value: Arg, parent: str, role: str, path: str, st: _State) -> Reason | None:
    """Match ``p`` against ``value``, argument ``role`` of node ``parent``."""
    match p:
        case Op():
            return _producer(p, value, parent, role, path, st)
        case OneOf():
            return _best(st, (_alt(a, value, parent, role, path) for a in p.alternatives), p.noun)
        case Const():
            if value is None and p.optional:
                return st.bind(p.name, None, parent, role, path)
            expr = constant_expr(st.snap, value.name) if isinstance(value, NodeRef) else None
            if expr is None:
                return not_constant(parent, role, value, path, how=held(st.snap, value))
            if isinstance(value, NodeRef) and value.name not in st.snap.constant_names:  # computed: dropped once unused
                st.prune.extend(computed_by(st.snap, value.name))
            return st.bind(p.name, expr, parent, role, path)
        case Scalar():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return st.bind(p.name, value, parent, role, path)
            shown = f"computed by {value.name!r}" if isinstance(value, NodeRef) else repr(value)
            return NotScalar(node=parent, role=role, value=shown, path=path)
        case Lit():
            if any(_strict_equal(value, v) for v in p.values):
                return st.bind(p.name, value, parent, role, path)
            return ArgMismatch(
                code=p.code, node=parent, role=role, value=value, expected=p.values, text=p.text, path=path
            )
        case Var():
            return st.bind(p.name, value, parent, role, path, code=p.code)


def _alt(p: Pattern, value: Arg, parent: str, role: str, path: str) -> Callable[[_State], Reason | None]:
    return lambda st: _match(p, value, parent, role, path, st)


def _producer(p: Op, value: Arg, parent: str, role: str, path: str, st: _State) -> Reason | None:
    here = f"{path}/{p.label}"
    node = st.snap.node(value.name) if isinstance(value, NodeRef) and value.name in st.snap.index else None
    if p.out is not None and node is not None and node.target == "getitem" and node.args[1:2] == (p.out,):
        # element ``out`` of a tuple-output op, read through getitem: the op is matched
        source = node.args[0]
        op = st.snap.node(source.name) if type(source) is NodeRef and source.name in st.snap.index else None
        if op is not None and op.target in p.family.schemas and p.family.schemas[op.target].tuple_output:
            node = op
    if (
        node is None
        or node.op != "call_function"
        or node.target not in p.family.schemas
        or (p.when is not None and not p.when.test(st.snap, node))
    ):
        producer, target = (node.name, _op_of(st.snap, node)) if node is not None else (repr(value), "a literal")
        of = f" {p.when.text}" if p.when is not None and node is not None and node.target in p.family.schemas else ""
        return WrongOp(
            code=p.code,
            node=parent,
            role=role,
            producer=producer,
            target=target,
            expected=p.family.noun + of,
            path=here,
        )
    return _op(p, node, here, st, reader=parent, seen_as=(parent, role) if p.transparent else None)


def _op_of(snap: GraphSnapshot, node: NodeSnapshot) -> str:
    """What computes ``node``: its target, or for a ``getitem`` of a tuple-output op, which output
    of which op (``output 0 of aten.max_pool2d_with_indices.default``)."""
    source = node.args[0] if node.target == "getitem" and len(node.args) == 2 else None
    if type(source) is NodeRef and source.name in snap.index and isinstance(node.args[1], int):
        return f"output {node.args[1]} of {snap.node(source.name).target}"
    return node.target


def _op(
    p: Op, node: NodeSnapshot, path: str, st: _State, reader: str | None, seen_as: tuple[str, str] | None = None
) -> Reason | None:
    """Match the op itself (``reader``: the node that reads it, None for the root and a consumer;
    ``seen_as``: the node and argument its operands' reasons name, for a transparent op)."""
    bound = p.family.bind(st.snap, node)
    if not isinstance(bound, Success):  # (the positive test: a negative isinstance on an ABC is slow)
        bad: Malformed = bound.failure()
        return replace(bad, path=path)
    args = bound.unwrap()
    st.depth += 1  # the op itself matched: an alternative that gets here got further than a wrong op
    uses: tuple[str, ...] = (node.name,)
    stray: NodeSnapshot | None = None  # a user reading another tuple element (reported after the arguments)
    dead: tuple[str, ...] = ()
    through = p.out is not None and p.family.schemas[node.target].tuple_output  # read through getitems
    if through:
        items = st.snap.users_of(node.name)
        # another element read by nothing (export writes max_pool2d's unused indices so): no use
        dead = tuple(
            u.name for u in items if u.target == "getitem" and u.args[1:2] != (p.out,) and not st.snap.users[u.name]
        )
        stray = next(
            (u for u in items if u.name not in dead and (u.target != "getitem" or u.args[1:2] != (p.out,))), None
        )
        uses = tuple(u.name for u in items if u is not stray and u.name not in dead)
    if reader is not None and p.users == ONE:
        # an operand read through getitems (``out=``): the element's readers besides the reader (one
        # of another element is ``stray``, below)
        read = [(u, g) for g in (uses if through else (node.name,)) for u in st.snap.users[g] if u != reader]
        others = tuple(u for u, _ in read)
        if others:
            sizes = tuple(u for u, g in read if reads_sizes(st.snap.node(u), g))
            if len(sizes) < len(others):
                return OutputShared(code=p.shared, node=node.name, users=others, path=path)
            # read for its sizes only (a dynamic program's x.shape): a replacement of its shape answers
            st.sized[node.name] = OutputShared(code=p.shared, node=node.name, users=sizes, path=path)
    elif reader is not None and node.name in st.snap.written:
        # shared, and written in place (directly or through a view) by another node: the reader may
        # not read what the op computes, which a plan reading the op's operands instead would (the
        # reader's own write, as a relu_'s, comes after its read)
        others = tuple(u for u in st.snap.users[node.name] if u != reader)
        if others:
            return OutputShared(code=p.shared, node=node.name, users=others, path=path)
    bound_op = Bound(node=node, family=p.family, args=args, uses=uses, out=p.out)
    err = st.bind(p.name, bound_op, node.name, "output", path, count=False)  # counted on matching
    if err is not None:
        return err
    outer = st.kept
    st.kept = outer or (reader is not None and p.users != ONE)
    (st.prune if st.kept else st.erase).extend((node.name, *uses, *dead))  # (repeats dropped in _matched)
    err = _arguments(p, args, node, path, st, seen_as)
    st.kept = outer
    if err is None and stray is not None and p.out is not None:
        return TupleUsed(code=p.out_code, node=node.name, user=stray.name, index=p.out, path=f"{path}.out")
    if err is None and p.user is not None:
        err = _consumer(p, node, uses, path, st)
    return err


def _arguments(
    p: Op, args: Mapping[str, Arg], node: NodeSnapshot, path: str, st: _State, seen_as: tuple[str, str] | None
) -> Reason | None:
    schema = p.family.schemas[node.target]
    names = schema.names
    # (a transparent op's value, its first operand, is what its reader reads: its scale is its own)
    seen = (next(iter(schema.family_params), ""), *seen_as) if seen_as is not None else None
    pairs = [(k, sub) for k, sub in p.args if k in names]  # an argument a spelling lacks: not checked
    if p.family.strict and not st.loose:
        err = _neutral(p, schema, args, node, path)
        if err is not None:
            return err
    pair = p.family.commutes
    if not p.commute or pair is None or not _commutes(p.family.schemas[node.target], args, pair):
        return _in_order(pairs, args, node, path, seen, st)
    a, b = pair
    swap = {a: b, b: a}
    swapped = [(swap.get(k, k), sub) for k, sub in pairs]
    return _commuted((pairs, swapped), args, node, path, seen, st)


def _commuted(
    orders: tuple[list[tuple[str, Pattern]], list[tuple[str, Pattern]]],
    args: Mapping[str, Arg],
    node: NodeSnapshot,
    path: str,
    seen: tuple[str, str, str] | None,
    st: _State,
) -> Reason | None:
    """A commutative op's operands in either order: the first that matches, else the order that got
    further; where both missed as deep, the one whose other operands match further, each matched
    in full (``gamma * y`` of a y no pattern takes: y is said, not gamma)."""

    def run(order: Sequence[tuple[str, Pattern]], *, every: bool = False) -> tuple[_State, Reason | None]:
        fork = st.fork()
        return fork, _in_order(order, args, node, path, seen, fork, every=every)

    tried: list[tuple[_State, Reason]] = []
    for order in orders:
        fork, err = run(order)
        if err is None:
            _adopt(st, fork)
            return None
        tried.append((fork, err))
    (one, _), (other, _) = tried
    if one.depth == other.depth:  # how deep every operand matches, each tried whatever the others do
        reach = [run(order, every=True)[0].depth for order in orders]
        later = reach[1] > reach[0]
    else:
        later = other.depth > one.depth
    fork, reason = tried[later]
    _adopt(st, fork)
    return reason


def _neutral(p: Op, schema: Schema, args: Mapping[str, Arg], node: NodeSnapshot, path: str) -> ArgMismatch | None:
    """Why the node does not match where ``p`` leaves one of its family's ``strict`` arguments
    unnamed: it holds another value than its default (None where it has none), ``add(y, c, alpha=2)``."""
    named = {k for k, _ in p.args}
    for k in sorted(p.family.strict - named):
        param = schema.param(k)
        if param is None:  # fixed by the spelling (``div.Tensor``'s rounding mode)
            continue
        neutral = param.default if param.has_default else None
        if not _strict_equal(args.get(k), neutral):
            return ArgMismatch(node=node.name, role=k, value=args.get(k), expected=(neutral,), path=f"{path}.{k}")
    return None


def _commutes(schema: Schema, args: Mapping[str, Arg], pair: tuple[str, str]) -> bool:
    """The node's two operands of ``pair`` may be swapped: each of its other parameters holds its
    default (``add(x, y, alpha=2)`` is ``x + 2 * y``, which is not ``y + 2 * x``).

    >>> from fxpure.families import ADD
    >>> add = ADD.schemas["aten.add.Tensor"]
    >>> _commutes(add, {"self": 1, "other": 2, "alpha": 1}, ("self", "other"))
    True
    >>> _commutes(add, {"self": 1, "other": 2, "alpha": 2}, ("self", "other"))
    False
    """
    return all(q.has_default and args.get(k) == q.default for k, q in schema.family_params.items() if k not in pair)


def _in_order(
    order: Sequence[tuple[str, Pattern]],
    args: Mapping[str, Arg],
    node: NodeSnapshot,
    path: str,
    seen: tuple[str, str, str] | None,
    st: _State,
    *,
    every: bool = False,
) -> Reason | None:
    """Match each argument's pattern in turn; the first reason ends it (or, ``every``, is returned
    once the others are matched too: what they match counts in the depth). ``seen``: the argument
    whose reasons name another node and argument (a transparent op's value), and those."""
    first: Reason | None = None
    for arg, sub in order:
        parent, role = (seen[1], seen[2]) if seen is not None and seen[0] == arg else (node.name, arg)
        err = _match(sub, args.get(arg), parent, role, f"{path}.{arg}", st)
        if err is not None and not every:
            return err
        first = first or err
    return first


def _consumer(p: Op, node: NodeSnapshot, uses: tuple[str, ...], path: str, st: _State) -> Reason | None:
    readers = tuple(dict.fromkeys(u for n in uses for u in st.snap.users.get(n, ())))
    if len(readers) != 1:
        return OutputShared(code=p.shared, node=node.name, users=readers, path=f"{path}.user")
    user = st.snap.node(readers[0])
    return _user_pattern(p.user, user, node.name, f"{path}.user", st)


def _user_pattern(p: Pattern | None, user: NodeSnapshot, of: str, path: str, st: _State) -> Reason | None:
    if isinstance(p, OneOf):
        return _best(st, (_user_alt(a, user, of, path) for a in p.alternatives), p.noun)
    assert isinstance(p, Op)  # checked when the rule is built
    here = f"{path}/{p.label}"
    if user.op != "call_function" or user.target not in p.family.schemas:
        return WrongOp(
            code=p.code,
            node=of,
            role="output",
            producer=user.name,
            target=user.target,
            expected=p.family.noun,
            consumer=True,
            path=here,
        )
    return _op(p, user, here, st, reader=None)


def _user_alt(p: Pattern, user: NodeSnapshot, of: str, path: str) -> Callable[[_State], Reason | None]:
    return lambda st: _user_pattern(p, user, of, path, st)


Root: TypeAlias = Op | OneOf
"""A rule's pattern: an Op, or alternatives that are all Ops (the anchor is one of their roots)."""


def roots(pattern: Root) -> tuple[Op, ...]:
    """The Ops a pattern may be anchored at."""
    return (pattern,) if isinstance(pattern, Op) else pattern.tops  # computed once, when built


def match(pattern: Root, snap: GraphSnapshot, node: NodeSnapshot) -> Result[Match, Reason]:
    """Match ``pattern`` rooted at ``node`` (for rules that find their own anchors, such as one per
    group of parallel linears): the match, or the typed, located reason it fails."""
    m, err, _ = _matched(pattern, snap, node)
    if m is None:
        assert err is not None  # _matched returns a match or a reason
        return Failure(err)
    return Success(m)


def _matched(
    pattern: Root, snap: GraphSnapshot, node: NodeSnapshot, *, loose: bool = False
) -> tuple[Match | None, Reason | None, _State]:
    """The match, or the reason and the partial state (``loose``: see ``_State``)."""
    st = _State(snap, loose=loose)
    tops = [op for op in roots(pattern) if node.target in op.family.schemas]
    if node.op != "call_function" or not tops:
        return None, Malformed(node=node.name, detail=f"{node.target} is not an anchor of this pattern"), st
    err = _best(st, (_root_alt(op, node) for op in tops))
    if err is not None:
        return None, err, st
    m = Match(
        snap=snap,
        anchor=node.name,
        bindings=FrozenDict(st.bindings),
        sites=FrozenDict(st.sites),
        erase=tuple(dict.fromkeys(st.erase)),
        prune=tuple(dict.fromkeys(n for n in st.prune if n not in st.erase)),
        sized=FrozenDict(st.sized) if st.sized else _NO_SIZES,
    )
    return m, None, st


def _root_alt(op: Op, node: NodeSnapshot) -> Callable[[_State], Reason | None]:
    return lambda st: _op(op, node, op.label, st, reader=None)


# --- typed checks on bound values ------------------------------------------------------------------


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class Check:
    """A typed check on bound values: runs on a match, returns a Reason or None. ``reads`` are the
    names it needs (checked against the pattern when the rule is built); ``codes`` the reasons it
    may return."""

    label: str
    reads: tuple[str, ...]
    codes: frozenset[str]
    run: Callable[[Match, Values], Reason | None] = field(compare=False)
    computed: bool = False  # it may read need.compute values (need.check); need.static & co read bindings
    needs: frozenset[str] = frozenset()  # parameters of need.check's function without a default
    ops: tuple[str, ...] = ()  # what it reads as a matched op (need.spatial_rank, need.channels' conv)
    weights: tuple[str, ...] = ()  # what it reads as a constant's layout (need.channels' weight)

    def __call__(self, m: Match, values: Values = _NOTHING) -> Reason | None:
        """The reason (located, see ``_locate``) or None; ``values``: what earlier ``need.compute``
        steps computed, by name. A reason with a code it does not declare is a TypeError."""
        reason = self.run(m, values)
        if reason is None:
            return None
        return _locate(_declared(reason, self.codes, "check", self.label), m, self.reads, self.label)


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class Compute:
    """A value computed once from bound values, for the checks after it and the planner, which
    read it as ``binds``; or the typed reason there is none. Build one with ``need.compute``."""

    label: str
    binds: str
    reads: tuple[str, ...]
    codes: frozenset[str]
    run: Callable[[Match, Values], Result[object, Reason]] = field(compare=False)
    needs: frozenset[str] = frozenset()  # parameters of its function without a default

    def __call__(self, m: Match, values: Values = _NOTHING) -> Result[object, Reason]:
        """The value, or the reason (located as a check's) there is none."""
        out = self.run(m, values)
        if isinstance(out, Success):
            return out
        reason = _declared(out.failure(), self.codes, "compute", self.label)
        return Failure(_locate(reason, m, self.reads, self.label))


def _declared(reason: Reason, codes: frozenset[str], kind: str, label: str) -> Reason:
    """``reason``, if its code is one the check declares (or one every rule may end with); else
    the check is wrong, whatever the graph: a TypeError (``rule.codes`` lists every code)."""
    if reason.code in codes or reason.code in GENERIC_CODES:
        return reason
    listed = ", ".join(sorted(codes))
    raise TypeError(f"{kind} {label} declined with {reason.code!r}, which it does not declare (codes: {listed})")


def _locate(reason: Reason, m: Match, reads: tuple[str, ...], label: str) -> Reason:
    """A check's reason without a path is located at the first binding it reads at the node the
    reason names (the node itself, or one of its operands), else at the first binding it reads."""
    if reason.path:
        return reason
    sites = [m.sites[r] for r in reads if r in m.sites]
    site = next((s for s in sites if s.node == reason.node), sites[0] if sites else None)
    return replace(reason, path=site.path if site is not None else f"need.{label}")


def _absent(m: Match, name: str) -> bool:
    """``name`` binds nothing on this match: an absent optional operand (bound to None), or a name
    only other alternatives bind (a linear's bias, which ``mm`` has not). Nothing to check."""
    return m.bindings.get(name) is None


def _site(m: Match, name: str) -> Site:
    return m.sites.get(name, Site(m.anchor, name, ""))


def _named(m: Match, values: Values, names: Iterable[str]) -> dict[str, object]:
    """The computed (else bound) value of each of ``names`` that has one, by name."""
    bound = m.bindings
    return {n: values[n] if n in values else bound[n] for n in names if n in values or n in bound}


@final
@dataclass(frozen=True, slots=True)
class _Fn:
    """A rule's own function, as a check or compute calls it."""

    run: Callable[[Match, Values], object]
    reads: tuple[str, ...]
    codes: frozenset[str]
    needs: frozenset[str]


def _keywords(what: str, params: Iterable[inspect.Parameter]) -> None:
    """Bound values are given by keyword: refuse a parameter that cannot take one."""
    for q in params:
        if q.kind not in (q.POSITIONAL_OR_KEYWORD, q.KEYWORD_ONLY):
            shown = ("*" if q.kind == q.VAR_POSITIONAL else "**" if q.kind == q.VAR_KEYWORD else "") + q.name
            raise PatternError(f"{what} takes {shown!r} by position: it is given by keyword")


def _call(fn: Callable[..., object], codes: Iterable[str], kind: str, returns: str, instead: str) -> _Fn:
    """``fn`` as a function of the match (bound and computed values by parameter name, ``match``
    for the whole match), the names it reads (those with a default may be unbound) and the codes
    it declares; refused here if it declares no codes or no return type, or a bare bool (a check:
    any bool), or takes a parameter by position only."""
    sig = inspect.signature(fn)
    ret = sig.return_annotation
    if ret is inspect.Signature.empty:
        raise PatternError(f"{kind} {_name(fn)} must declare its return type ({returns})")
    if ret is bool or ret == "bool":
        raise PatternError(f"{kind} {_name(fn)} returns a bare bool: return {instead}")
    text = ret if isinstance(ret, str) else str(ret)
    if kind == "check" and "bool" in re.findall(r"\w+", text):
        raise PatternError(f"{kind} {_name(fn)} may return a bool ({text}): return {instead}")
    declared = frozenset(codes)
    if not declared and kind == "check":  # (a compute that cannot fail lists none: codes=())
        raise PatternError(f"{kind} {_name(fn)} must list the reason codes it may return")
    _keywords(f"{kind} {_name(fn)}", sig.parameters.values())
    reads = tuple(n for n in sig.parameters if n != "match")
    needs = frozenset(n for n, q in sig.parameters.items() if q.default is q.empty and n != "match")
    return _Fn(partial(_by_name, fn, reads, "match" in sig.parameters), reads, declared, needs)


# (module-level, each bound with partial: a rule holding them pickles where its own functions do)
def _by_name(fn: Callable[..., object], reads: tuple[str, ...], wants_match: bool, m: Match, values: Values) -> object:
    kwargs = _named(m, values, reads)
    if wants_match:
        kwargs["match"] = m
    return fn(**kwargs)


def _check_fn(fn: Callable[..., object], codes: Iterable[str]) -> Check:
    call = _call(fn, codes, "check", "a Reason or None", "a Reason (with a code) or None")
    run = partial(_checked, fn, call.run)
    return Check(label=_name(fn), reads=call.reads, codes=call.codes, run=run, computed=True, needs=call.needs)


def _checked(
    fn: Callable[..., object], call: Callable[[Match, Values], object], m: Match, values: Values
) -> Reason | None:
    out = call(m, values)
    if out is not None and not isinstance(out, Reason):
        raise TypeError(f"check {_name(fn)} returned {out!r}, not a Reason or None")
    return out


def _name(fn: Callable[..., object]) -> str:
    return str(getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", repr(fn)))


def _listed(check: str, name: str, allowed: object, kind: type, example: str) -> tuple[Any, ...]:
    """``allowed`` as a tuple of ``kind``, or a PatternError: a string or a number given for the list
    (``need.dtype("x", "float32")``, ``need.rank("x", 4)``) would check nothing it says."""
    values = tuple(allowed) if isinstance(allowed, Iterable) and not isinstance(allowed, str) else None
    if values is None or not all(type(v) is kind for v in values):
        raise PatternError(f"need.{check}({name!r}, ...) takes {example}, got {allowed!r}")
    return values


def _ints(check: str, name: str, allowed: object) -> tuple[int, ...]:
    return _listed(check, name, allowed, int, "numbers such as (2, 3)")


# the checks of ``need``, module-level (a rule holding them pickles): each takes its parameters,
# then the match and the values computed so far


def _static(name: str, dims: tuple[int, ...] | None, m: Match, _: Values) -> Reason | None:
    spec, site = m.spec(name), _site(m, name)
    if spec is None and isinstance(m.bindings.get(name), (int, float)) and dims is None:
        return None
    if spec is None:
        return None if _absent(m, name) else Malformed(node=site.node, detail=f"{site.role} has no known shape")
    rank = len(spec.shape)
    picked = spec.shape if dims is None else tuple(spec.shape[d] for d in dims if -rank <= d < rank)
    if dims is not None and len(picked) != len(dims):
        return Malformed(node=site.node, detail=f"{site.role} has no dims {tuple(dims)}: {spec.shape}")
    if all(isinstance(d, int) for d in picked):
        return None
    return SymbolicShape(node=site.node, role=site.role, shape=spec.shape)


def _dtype(name: str, ok: frozenset[str], m: Match, _: Values) -> Reason | None:
    spec, site = m.spec(name), _site(m, name)
    number = m.bindings.get(name)
    if spec is None and isinstance(number, (int, float)) and not isinstance(number, bool):
        dtype = "int64" if isinstance(number, int) else "float64"
        return None if dtype in ok else UnsupportedDtype(node=site.node, role=site.role, dtype=dtype)
    if spec is None:
        return None if _absent(m, name) else Malformed(node=site.node, detail=f"{site.role} has no known dtype")
    if spec.dtype in ok:
        return None
    return UnsupportedDtype(node=site.node, role=site.role, dtype=spec.dtype)


def _rank(name: str, ok: tuple[int, ...], m: Match, _: Values) -> Reason | None:
    spec, site = m.spec(name), _site(m, name)
    if spec is None:
        return None if _absent(m, name) else Malformed(node=site.node, detail=f"{site.role} has no known shape")
    if len(spec.shape) in ok:
        return None
    return UnsupportedRank(node=site.node, rank=len(spec.shape), allowed=ok, of="dims")


def _spatial_rank(conv: str, ok: tuple[int, ...], m: Match, _: Values) -> Reason | None:
    op = m.bindings.get(conv)
    rank = op.args.get("rank") if isinstance(op, Bound) else None
    if not isinstance(rank, int) or rank in ok:
        return None
    return UnsupportedRank(node=_site(m, conv).node, rank=rank, allowed=ok)


def _channels(name: str, of: str, conv: str | None, m: Match, _: Values) -> Reason | None:
    vec, w, site = m.spec(name), m.spec(of), _site(m, name)
    op = m.bindings.get(conv) if conv is not None else None
    transposed = isinstance(op, Bound) and op.args.get("transposed") is True
    groups = op.args.get("groups", 1) if isinstance(op, Bound) else 1
    if vec is None or w is None or not w.shape or not isinstance(groups, int):
        return None
    oc = out_channels(w, transposed=transposed, groups=groups)
    lead = w.shape[0]
    if vec.shape == (oc,) and isinstance(oc, int) and isinstance(lead, int) and lead % groups == 0:
        return None
    return ChannelMismatch(node=site.node, expected=oc if isinstance(oc, int) else -1, found=vec.numel)


@final
class _Need:
    """Typed checks on bound values; each returns one reason record or nothing."""

    @staticmethod
    def static(name: str, *, dims: Sequence[int] | None = None) -> Check:
        """The bound value's shape (or just ``dims`` of it) is known and has no symbolic size. A
        Python number (bound by ``Scalar``) is static: it has no dims."""
        codes = frozenset({"symbolic-shape", "malformed-node"})
        run = partial(_static, name, None if dims is None else tuple(dims))
        return Check(label=f"static({name})", reads=(name,), codes=codes, run=run)

    @staticmethod
    def dtype(name: str, allowed: Iterable[str]) -> Check:
        """The bound value's dtype is one of ``allowed``. A Python number (bound by ``Scalar``) has
        the dtype torch gives it: ``int64`` or ``float64`` (a wrapped number, which does not change
        the dtype of a tensor of its kind it meets)."""
        ok = frozenset(_listed("dtype", name, allowed, str, "dtype names such as ('float32',)"))
        codes = frozenset({"unsupported-dtype"})  # and malformed-node, which every rule may end with
        return Check(label=f"dtype({name})", reads=(name,), codes=codes, run=partial(_dtype, name, ok))

    @staticmethod
    def rank(name: str, allowed: Iterable[int]) -> Check:
        """The bound value's rank (number of dims) is one of ``allowed``."""
        ok = tuple(sorted(_ints("rank", name, allowed)))
        codes = frozenset({"unsupported-rank"})  # and malformed-node, which every rule may end with
        return Check(label=f"rank({name})", reads=(name,), codes=codes, run=partial(_rank, name, ok))

    @staticmethod
    def spatial_rank(conv: str, allowed: Iterable[int]) -> Check:
        """A bound convolution's number of spatial dims is one of ``allowed``."""
        ok = tuple(sorted(_ints("spatial_rank", conv, allowed)))
        codes = frozenset({"unsupported-rank"})
        run = partial(_spatial_rank, conv, ok)
        return Check(label=f"spatial_rank({conv})", reads=(conv,), codes=codes, run=run, ops=(conv,))

    @staticmethod
    def channels(name: str, *, of: str, conv: str | None = None) -> Check:
        """Bound vector ``name`` has one entry per output channel of weight ``of`` (laid out as the
        bound convolution ``conv`` says: transposed, grouped; else output channels lead)."""
        reads = (name, of) if conv is None else (name, of, conv)
        codes = frozenset({"channel-mismatch"})
        ops = () if conv is None else (conv,)
        run = partial(_channels, name, of, conv)
        return Check(label=f"channels({name})", reads=reads, codes=codes, run=run, ops=ops, weights=(of,))

    @staticmethod
    def check(fn: Callable[..., Reason | None], *, codes: Iterable[str], at: str | None = None) -> Check:
        """A rule's own check: ``fn`` takes bound values by name (and ``match`` for the whole match)
        and returns a Reason or None; ``codes`` are the codes it may return; its reasons are located
        at the binding ``at`` (default: the first it reads) unless they carry a path. A function
        annotated to return ``bool`` (or not annotated) is refused here."""
        check = _check_fn(fn, codes)
        if at is None:
            return check
        return replace(check, reads=(at, *(r for r in check.reads if r != at)))

    @staticmethod
    def compute(
        name: str, fn: Callable[..., Result[Any, Reason]], *, codes: Iterable[str], at: str | None = None
    ) -> Compute:
        """A value the checks after it and the planner read as ``name``, computed once per match:
        ``fn`` takes bound (and earlier computed) values by name, and ``match`` for the whole
        match, and returns ``Success(value)``, or ``Failure(reason)`` with one of ``codes`` to
        decline (``codes=()``: it never does), located like a check's (``at``, as for
        :meth:`check`)."""
        call = _call(fn, codes, "compute", "a Result", "Success(value) or Failure(Reason)")
        if at is not None:
            call = replace(call, reads=(at, *(r for r in call.reads if r != at)))
        run = partial(_computed, fn, call.run)
        return Compute(label=_name(fn), binds=name, reads=call.reads, codes=call.codes, run=run, needs=call.needs)


need = _Need()


def _computed(
    fn: Callable[..., object], call: Callable[[Match, Values], object], m: Match, values: Values
) -> Result[object, Reason]:
    out = call(m, values)
    if not isinstance(out, Success | Failure) or (isinstance(out, Failure) and not isinstance(out.failure(), Reason)):
        raise TypeError(f"compute {_name(fn)} returned {out!r}, not Success(value) or Failure(Reason)")
    return out


# --- planning --------------------------------------------------------------------------------------


_NO_SIZES: Mapping[str, OutputShared] = FrozenDict({})
# ops that read only a value's sizes: such a reader of a matched inner node is no reason to keep it
SIZE_READERS = frozenset({"aten.sym_size.int", "aten.sym_numel.default"})
# ops that read their ``other`` for its sizes only (``y.reshape_as(h)``)
SHAPED_AS = frozenset({"aten.reshape_as.default", "aten.view_as.default", "aten.expand_as.default"})


def reads_sizes(node: NodeSnapshot, name: str) -> bool:
    """Whether ``node`` reads the value ``name`` for its sizes only: a size query (a dynamic
    program's ``x.shape``), or the ``other`` of a ``reshape_as``, ``view_as`` or ``expand_as`` of
    another value (LeViT's ``bn(h.flatten(0, 1)).reshape_as(h)``).

    >>> n = NodeSnapshot(name="r", op="call_function", target="aten.reshape_as.default",
    ...                  args=(NodeRef("bn"), NodeRef("h")))
    >>> reads_sizes(n, "h"), reads_sizes(n, "bn")
    (True, False)
    """
    if node.target in SIZE_READERS:
        return True
    return node.target in SHAPED_AS and node.arg(1, "other") == NodeRef(name) and node.arg(0, "self") != NodeRef(name)


# ops that compute a size (an int of a dynamic program): pure, so dropped once nothing reads them
_SIZE_OPS = SIZE_QUERIES | {
    f"_operator.{op}" for op in ("add", "sub", "mul", "floordiv", "truediv", "mod", "neg", "pow")
}
_QD = "quantized_decomposed"
_PLAIN = frozenset({int, float, bool, tuple, type(None)})  # values of a non-tensor argument taken as they are
_PER_TENSOR = frozenset(
    f"{_QD}.{op}_per_tensor.{overload}" for op in ("quantize", "dequantize") for overload in ("default", "tensor")
)
_RELUS = RELU.targets | RELU_.targets  # (in place, it writes a value nothing else reads)


def quantized_as(snap: GraphSnapshot, name: str) -> NodeSnapshot | None:
    """Whose parameters :meth:`Planner.requantize` copies for node ``name``: the per-tensor
    dequantize it is, else the per-tensor quantize that is its only reader, or its relu's (or
    ``relu_``'s) only reader (a relu of a value rounded to those parameters' grid is on it: zero
    is). None if none."""
    node = snap.node(name)
    if _per_tensor(node) and "dequantize" in node.target:
        return node
    users = snap.users_of(name)
    if len(users) == 1 and users[0].target in _RELUS:
        users = snap.users_of(users[0].name)
    if len(users) == 1 and _per_tensor(users[0]) and "dequantize" not in users[0].target:
        return users[0]
    return None


def _per_tensor(n: NodeSnapshot) -> bool:
    """A per-tensor quantize or dequantize with its parameters in place: (scale, ..., dtype)."""
    return n.target in _PER_TENSOR and len(n.args) == 6 and isinstance(n.args[5], DTypeArg)


_CONVOLUTION = "aten.convolution.default"


def _as_convolution(schema: Schema, values: Mapping[str, Arg]) -> dict[str, Arg] | None:
    """The arguments of a new ``conv{1,2,3}d`` or ``conv_transpose{1,2,3}d`` as those of Core ATen's
    one conv, ``aten.convolution``: every argument given, int lists of the conv's rank; None for
    any other op, or for a padding given as a string.

    >>> conv = _as_convolution(SCHEMAS["aten.conv2d.default"], {"input": NodeRef("x"), "weight": NodeRef("w")})
    >>> [conv[k] for k in ("bias", "stride", "padding", "dilation", "transposed", "output_padding", "groups")]
    [None, (1, 1), (0, 0), (1, 1), False, (0, 0), 1]
    """
    if schema.target not in CONV.targets or schema.target == _CONVOLUTION:
        return None
    rank = int(schema.target.removeprefix("aten.conv_transpose").removeprefix("aten.conv")[0])

    def given(name: str) -> Arg:
        param = schema.param(name)
        return values[name] if name in values else param.default if param is not None else schema.fixed[name]

    out = {k: given(k) for k in ("input", "weight", "bias", "transposed", "groups")}
    for k in ("stride", "padding", "dilation", "output_padding"):
        value = given(k)
        if isinstance(value, str):
            return None
        items = value if isinstance(value, tuple) else (value,)
        out[k] = items * rank if len(items) == 1 else items
    return out


def _floating(expr: WeightExpr) -> bool:
    """The expression's dtype is a floating one (or cannot be told: the plan is declined for it)."""
    spec = infer_spec(expr)
    return not isinstance(spec, Success) or spec.unwrap().dtype.startswith(("float", "bfloat", "complex"))


@final
class Planner:
    """Builds the plan for one match: new constants and nodes by name, then ``replace``.

    Names are local to the plan (``rewrite`` makes them unique); new nodes inherit metadata
    from ``provenance`` (by default the matched node they re-spell, else the anchor)."""

    def __init__(self, rule: str, m: Match, *, also: Sequence[Match] = (), anchor: str | None = None) -> None:
        """A planner for match ``m``; ``also``: more matches the same plan rewrites (one plan for a
        group, such as parallel linears), whose matched nodes it erases or prunes too; ``anchor``:
        the candidate the plan is reported at (default: ``m``'s)."""
        self.rule = rule
        self.match = m
        self.also = tuple(also)
        self.anchor = anchor or m.anchor
        self._constants: list[NewConstant] = []
        self._nodes: list[NewNode] = []
        self._names: set[str] = set()  # of the new values: one name, one value
        self.refused: Reason | None = None
        """Why the plan cannot be written for this match (a number bound where the op needs a
        node: ``malformed-node`` at path ``plan``; an erased node whose size is read, with no new
        value of its shape: its ``output-shared`` reason): a rule declines with it; whoever makes
        a Planner of their own reads it before using the plan."""

    @property
    def dialect(self) -> str:
        """``"aten"`` or ``"edge"``: which spelling new nodes should use (a view op is respelled
        for edge by :meth:`node` and :meth:`call`)."""
        return self.match.snap.dialect

    @property
    def decomposed(self) -> bool:
        """The program's ops are Core ATen's (an edge program, or an aten one after
        ``run_decompositions()``): a new op should be of that set too (``aten.convolution``, not
        ``aten.conv2d``; :attr:`fxpure.snapshot.GraphSnapshot.decomposed`)."""
        return self.match.snap.decomposed

    def const(self, expr: WeightExpr, name: str, *, kind: ConstantKind | None = None) -> NodeRef:
        """A derived constant (computed by the adapter, once, if it survives), keyed under the
        module of the constants it reads (``NewConstant``). A name the plan gave a new value
        already is counted up (``w_padded_1``): the reference returned names this one. Its
        ``kind`` is by default that of what it reads: a parameter if it reads one (or a constant an
        earlier stage dropped, whose kind the snapshot no longer holds), else a buffer if it reads
        one, else a constant (``1 / scale`` of a buffer is a buffer); one of an integer dtype is no
        parameter (an int8 weight requantized with a batch norm's gamma is a buffer)."""
        name = self._unique(name)
        self._constants.append(NewConstant(name=name, expr=expr, kind=kind or self._kind(expr)))
        return NodeRef(name)

    def _kind(self, expr: WeightExpr) -> ConstantKind:
        snap = self.match.snap
        read, held = snap.constants, snap.constant_names  # (a set's membership test: the map's costs more)
        kinds = {read[k].kind if k in held else "parameter" for k in sources(expr)}
        if "parameter" in kinds and _floating(expr):
            return "parameter"
        # (an integer one is a buffer: no parameter of an integer dtype can require grad)
        return "buffer" if kinds & {"parameter", "buffer"} else "constant"

    def _unique(self, name: str) -> str:
        if not isinstance(name, str) or not name.isidentifier():  # (the program's code names it so)
            raise ValueError(f"a new value's name must be a Python identifier, not {name!r}")
        fresh, i = name, 0
        while fresh in self._names:
            i += 1
            fresh = f"{name}_{i}"
        self._names.add(fresh)
        return fresh

    def node(
        self,
        target: str,
        args: tuple[Arg, ...],
        kwargs: Mapping[str, Arg] | None = None,
        *,
        name: str,
        spec: Spec,
        provenance: str | None = None,
        source_fn: str | None = None,
    ) -> NodeRef:
        """A new node with positional arguments as given (a name taken counted up, as for ``const``);
        on edge, a view op is written as its ``_copy`` op (:func:`fxpure.families.spelled`)."""
        name = self._unique(name)
        self._nodes.append(
            NewNode(
                name=name,
                target=spelled(target, self.dialect),
                args=args,
                kwargs=pmap(kwargs or {}),
                spec=spec,
                provenance=provenance or self.anchor,
                source_fn=source_fn,
            )
        )
        return NodeRef(name)

    def copied(self, value: NodeRef, suffix: str = "new") -> NodeRef:
        """``value`` copied as the match's copy (bound as ``idle``, see :func:`idle`) copied the old
        value, re-spelled as ``{idle}_{suffix}`` (its layout kept); ``value`` itself where the
        match read no copy (none, or a dropout, which goes)."""
        copy = self.match.bindings.get("idle")
        if not isinstance(copy, Bound) or copy.node.target not in CLONE.targets:
            return value
        return self.respell(copy, name=f"{copy.name}_{suffix}", self=value)

    def requantize(self, value: NodeRef, like: NodeSnapshot, *, name: str, spec: TensorSpec) -> NodeRef:
        """``value`` (of ``spec``) quantized and dequantized again with the parameters of ``like``,
        a per-tensor quantize or dequantize (:func:`quantized_as`). A view put between a
        dequantize and the op it feeds, or between the op and its quantize, breaks the
        ``dequantize -> op -> quantize`` pattern a quantized backend lowers; this pair after it
        restores it. Where ``value`` is already so rounded (it views a dequantize's result), or
        will be (a quantize with these parameters reads it), the values do not change."""
        params, dtype = like.args[1:6], like.args[5] if len(like.args) > 5 else None
        if len(params) != 5 or not isinstance(dtype, DTypeArg):
            raise TypeError(f"{like.name} is no per-tensor quantize or dequantize: it has no (scale, ..., dtype)")
        overload = like.target.rsplit(".", 1)[-1]  # ``tensor``: the scale and zero point are nodes
        q_spec = TensorSpec(shape=spec.shape, dtype=dtype.name)
        q = self.node(f"{_QD}.quantize_per_tensor.{overload}", (value, *params), name=f"{name}_q", spec=q_spec)
        return self.node(f"{_QD}.dequantize_per_tensor.{overload}", (q, *params), name=f"{name}_dq", spec=spec)

    def call(
        self,
        target: str | Schema,
        /,
        *,
        name: str,
        spec: Spec,
        provenance: str | None = None,
        source_fn: str | None = None,
        **values: Arg | WeightExpr,
    ) -> NodeRef:
        """A new call with arguments by schema name. ``target``: a canonical target of a family
        fxpure ships (``fxpure.families.SCHEMAS``) or of a family the match bound, or the
        ``Schema`` of any op (``MY_FAMILY.schemas[target]``, ``parse_schema(...)``). A constant
        bound as the program holds it (``Const("w")`` of a weight) is read as it is, under its own
        key; any other expression (a view of one, ``b.view(4)``, binds a ``Reshape``; a fold of
        yours) becomes a new constant named ``{name}_{argument}`` (``p.const(expr, name)`` to name
        it yourself; one already held is shared). A dtype may be given
        by name (``dtype="float16"``). Where the program's ops are Core ATen's (:attr:`decomposed`),
        a ``conv{1,2,3}d`` or ``conv_transpose{1,2,3}d`` is written as ``aten.convolution.default``
        with every argument spelled out (a padding given as a string, ``"same"``, is left as it is:
        Core ATen has no spelling of it)."""
        schema = target if isinstance(target, Schema) else SCHEMAS.get(target) or self._bound_schema(target)
        if schema is None:
            raise PatternError(f"no schema for {target}: pass its Schema, or use Planner.node (positional arguments)")
        given = self._fit(f"call {name}", name, schema, values, complete=True)
        core = _as_convolution(schema, given) if self.decomposed else None
        if core is not None:
            schema, given = SCHEMAS[_CONVOLUTION], core
        args, kwargs = arguments(schema, given)
        return self.node(schema.target, args, kwargs, name=name, spec=spec, provenance=provenance, source_fn=source_fn)

    def _bound_schema(self, target: str) -> Schema | None:
        """The schema of ``target`` in a family of an op the match bound."""
        bound = (b for b in self.match.bindings.values() if isinstance(b, Bound))
        return next((b.family.schemas[target] for b in bound if target in b.family.schemas), None)

    def respell(
        self,
        op: Bound,
        /,
        *,
        name: str | None = None,
        spec: Spec | None = None,
        source_fn: str | None = None,
        **updates: Arg | WeightExpr,
    ) -> NodeRef:
        """A copy of a matched node with some arguments replaced by name, in the node's own spelling
        (a constant bound as the program holds it is read as it is, any other expression becomes
        a new constant, as in :meth:`call`)."""
        schema = op.family.schemas[op.node.target]
        args, kwargs = respell(op.node, schema, self._fit(f"respell of {op.name}", name or op.name, schema, updates))
        return self.node(
            op.node.target,
            args,
            kwargs,
            name=name or op.name,
            spec=op.node.spec if spec is None else spec,
            provenance=op.name,
            source_fn=source_fn,
        )

    def _fit(
        self, what: str, name: str, schema: Schema, values: Mapping[str, Arg | WeightExpr], *, complete: bool = False
    ) -> dict[str, Arg]:
        """Raise TypeError for what is wrong whatever the graph (an argument the schema has not,
        a required one left out of a new call, an op given for a value, an expression for a
        non-tensor one); note in
        ``refused`` a value a tensor argument cannot take (a number, None), which depends on the
        match. A number is taken as an ``other`` operand (export writes ``x * 2.0`` so), except on an
        edge program, whose verifier refuses it (``to_edge`` lifts it as a constant). The values, a
        constant bound as the program holds it (a ``Source``) as its node, any other expression as
        a new constant (:meth:`const`)."""
        out: dict[str, Arg] = {}
        for arg, value in values.items():
            q = schema.family_params.get(arg)  # by the family's name only
            if q is None:
                # a schema name its family renames (``reshape``'s ``shape`` is ``size``, as ``view``'s)
                renamed = schema.rename.get(arg)
                hint = f"its family calls {arg!r} {renamed!r}" if renamed else _has(schema)
                raise TypeError(f"{what}: {schema.target} has no argument {arg!r} ({hint})")
            if isinstance(value, NodeRef) or (type(value) in _PLAIN and q.kind != "tensor"):  # (nothing to check)
                out[arg] = cast(Arg, value)
                continue
            if isinstance(value, Source) and value.key in self.match.snap.index:
                value = NodeRef(value.key)  # a constant as the program holds it: its node
            elif isinstance(value, WeightExpr) and q.kind == "tensor":
                # one computed (a view of a weight, ``b.view(4)``, binds a Reshape; an earlier
                # rule's derived one its expression): a new constant, shared if one holds it already
                value = self.const(value, f"{name}_{arg}")
            if isinstance(value, Bound):
                raise TypeError(f"{what}: {arg} is a Bound, not a node: pass NodeRef(op.name), or p.const(expr, name)")
            if isinstance(value, WeightExpr):  # (for a tensor argument it is a new constant, above)
                kind = type(value).__name__
                hint = "bind a number with Scalar, or read one with match.values"
                raise TypeError(f"{what}: {arg} is a {kind}, and {schema.target} takes no tensor there: {hint}")
            if isinstance(value, str) and q.kind == "dtype":  # a dtype by name, as GraphBuilder.call takes it
                value = DTypeArg(name=value)
            out[arg] = value
            if q.kind != "tensor" or type(value) is NodeRef or (value is None and q.optional):
                continue
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if q.name == "other" and number and self.dialect != "edge":
                continue
            # an edge program's verifier wants every tensor argument a tensor (to_edge lifts numbers)
            lift = (
                " (an edge program takes a constant there: p.const(Fill(...)))" if q.name == "other" and number else ""
            )
            self._refuse(f"the plan passes {value!r} as {arg} of {name} ({schema.target}), a tensor{lift}")
        if complete:
            missing = [n for n in schema.required if n not in values]
            if missing:
                raise TypeError(f"{what}: {schema.target} needs {', '.join(map(repr, missing))} ({_has(schema)})")
        return out

    def _refuse(self, detail: str) -> None:
        if self.refused is None:
            self.refused = Malformed(node=self.anchor, detail=detail, path="plan")

    def replace(self, op: Bound, new: NodeRef, *, prune: Sequence[str] = ()) -> RewritePlan:
        """The plan: ``op``'s uses move to ``new``; the matched nodes are erased (shared ones
        dropped once nothing reads them); ``prune`` as in :meth:`finish`."""
        return self.finish([(op, new)], prune=prune)

    def finish(
        self, moves: Sequence[tuple[Bound, NodeRef]], *, erase: Sequence[Bound] | None = None, prune: Sequence[str] = ()
    ) -> RewritePlan:
        """The plan with several moves of uses (each matched op's uses to its new node). By default
        every matched node the new nodes do not read is erased (one they read stays: a node
        inserted after an op, say, reads the op whose uses it takes; so does a matched node uses
        move to, an op dropped for its input, and what those read in the match); ``erase`` names the only ones
        to erase (the rest of the match stays, and its shared nodes are dropped only if nothing
        reads them any more). ``prune``:
        more nodes, by name, dropped too once nothing reads them (what computed an erased node's
        arguments but is no part of the pattern). The sizes an erased node read (a dynamic
        reshape's ``sym_size`` and the arithmetic on it) are dropped so without being named."""
        for op, new in moves:
            if isinstance(new, NodeRef):
                continue
            if isinstance(new, Bound | WeightExpr):
                kind = type(new).__name__
                raise TypeError(f"replace({op.name}, ...): the new value is a {kind}, not a node: pass NodeRef(...)")
            self._refuse(f"the plan moves the uses of {op.name} to {new!r}, not a node")
        moves = [(op, new) for op, new in moves if isinstance(new, NodeRef)]
        matches = (self.match, *self.also)
        matched = tuple(dict.fromkeys(n for m in matches for n in m.erase))
        if erase is None:
            gone = self._unread(matched, moves)
        else:
            gone = tuple(dict.fromkeys(u for op in erase for u in (op.name, *op.uses)))
        shared = [n for m in matches for n in m.prune]
        return RewritePlan(
            rule=self.rule,
            anchor=self.anchor,
            constants=tuple(self._constants),
            nodes=tuple(self._nodes),
            replace=(*((u, new.name) for op, new in moves for u in op.uses), *self._sizes(matches, moves, gone)),
            erase=gone,
            prune=tuple(
                dict.fromkeys(n for n in (*shared, *prune, *self._sizes_read(gone, shared, prune)) if n not in gone)
            ),
        )

    def _sizes_read(self, *dropped: Sequence[str]) -> list[str]:
        """The size computations the nodes a plan may drop read, and the ones those read."""
        snap, out, todo = self.match.snap, [], [n for names in dropped for n in names if n in self.match.snap.index]
        seen = set(todo)
        while todo:
            for r in ref_list(snap.node(todo.pop())):
                if r not in seen and snap.node(r).target in _SIZE_OPS:
                    seen.add(r)
                    out.append(r)
                    todo.append(r)
        return out

    def _sizes(
        self, matches: Sequence[Match], moves: Sequence[tuple[Bound, NodeRef]], gone: tuple[str, ...]
    ) -> tuple[tuple[str, str], ...]:
        """Moves of the size reads of erased inner nodes (:attr:`Match.sized`) to a new value of the
        same shape (one taking uses, else any of the plan's); where there is none, the plan is
        refused with the node's output-shared reason."""
        sized = [(k, v) for m in matches for k, v in m.sized.items() if k in gone]
        if not sized:
            return ()
        shapes = {n.name: n.spec.shape for n in self._nodes if isinstance(n.spec, TensorSpec)}
        out = []
        for inner, why in sized:
            spec = self.match.snap.node(inner).tensor_spec
            # the value taking its uses, else any new value of its shape (LeViT's new linear, for the
            # ``reshape_as`` of its batch norm's flattened output)
            fits = [new.name for _, new in moves] + list(shapes)
            to = next((n for n in fits if spec is not None and shapes.get(n) == spec.shape), None)
            if to is None:
                self.refused = self.refused or why
            else:
                out.append((inner, to))
        return tuple(out)

    def _unread(self, matched: tuple[str, ...], moves: Sequence[tuple[Bound, NodeRef]]) -> tuple[str, ...]:
        """The matched nodes nothing left reads: not the new nodes, not a node uses move to (an op
        dropped for its input), nor, through matched nodes, what those read."""
        kept = set(refs(tuple((*n.args, *n.kwargs.values()) if n.kwargs else n.args for n in self._nodes)))
        kept.update(new.name for _, new in moves)
        kept -= {n.name for n in self._nodes}  # a plan's own name means its own node (a respelled op's, say)
        inside, snap = set(matched), self.match.snap
        todo = [n for n in matched if n in kept]
        while todo:
            for r in ref_list(snap.node(todo.pop())):
                if r in inside and r not in kept:
                    kept.add(r)
                    todo.append(r)
        return tuple(n for n in matched if n not in kept)


PlanFn: TypeAlias = Callable[..., RewritePlan | Result[RewritePlan, Reason]]


# --- rules -----------------------------------------------------------------------------------------


def _has(schema: Schema) -> str:
    """The arguments a planner may name (for an error message)."""
    return f"it has: {', '.join(sorted(schema.family_params))}"


def _names(p: Pattern | None) -> tuple[frozenset[str], frozenset[str]]:
    """Names bound on every successful match, and names bound on some only (inside alternatives)."""
    if p is None:
        return frozenset(), frozenset()
    if isinstance(p, OneOf):
        each = [_names(a) for a in p.alternatives]
        common = frozenset.intersection(*(a for a, _ in each))
        anywhere = frozenset().union(*(a | s for a, s in each))
        return common, anywhere - common
    own = frozenset({n} if (n := getattr(p, "name", None)) else set())
    if not isinstance(p, Op):
        return own, frozenset()
    always: set[str] = set(own)
    some: set[str] = set()
    everywhere = frozenset.intersection(*(s.names for s in p.family.schemas.values()))
    for arg, sub in [*p.args, ("", p.user)]:
        a, s = _names(sub)
        if arg and arg not in everywhere:  # a spelling without the argument binds nothing under it
            a, s = frozenset(), a | s
        always |= a
        some |= s
    return frozenset(always), frozenset(some - always)


def _lint(p: Pattern, *, consumer: bool = False) -> None:
    """Refuse patterns that cannot work, naming the mistake."""
    if isinstance(p, OneOf):
        for a in p.alternatives:
            _lint(a, consumer=consumer)
        return
    if consumer and not isinstance(p, Op):
        raise PatternError(f"user= takes an Op (or OneOf of Ops), got {type(p).__name__}")
    if not isinstance(p, Op):
        return
    fam = p.family
    if p.users not in (ONE, ANY):
        raise PatternError(f"{p.label}: users={p.users!r}, expected {ONE!r} or {ANY!r}")
    outputs = max(s.outputs for s in fam.schemas.values())
    if p.out is not None and outputs == 1:
        raise PatternError(f"{p.label}: out= projects a tuple, and {fam.name} returns one tensor")
    if p.out is not None and not 0 <= p.out < outputs:
        raise PatternError(f"{p.label}: out={p.out}, and {fam.name} returns at most {outputs} tensors")
    if p.commute and fam.commutes is None:
        some = " (not every spelling in it does: an in-place one writes self; give those an Op of their own in a OneOf)"
        raise PatternError(f"{p.label}: {fam.name} does not commute{some if '|' in fam.name else ''}")
    for arg, sub in p.args:
        if arg not in fam.params:
            raise PatternError(f"{fam.name} has no argument {arg!r} (it has: {', '.join(sorted(fam.params))})")
        lacking = next((t for t, s in fam.schemas.items() if arg not in s.names), None)
        if lacking is not None and not isinstance(sub, Var):  # (a Var there binds nothing: see _names)
            raise PatternError(
                f"{p.label}.{arg}: {lacking} has no {arg} and fixes no value for it, so the "
                f"{type(sub).__name__} would go unchecked on it: give that spelling a fixed value "
                f"(parse_schema(..., fixed={{{arg!r}: ...}})) or match it in an Op of its own (OneOf)"
            )
        kinds = fam.kinds(arg)
        if isinstance(sub, Op | Const) and kinds and not kinds & (TENSOR_KINDS | {"any"}):
            raise PatternError(f"{p.label}.{arg} is not a tensor argument: {type(sub).__name__} cannot match it")
        if isinstance(sub, Lit):
            _lint_values(f"{p.label}.{arg}", sub.values, fam, arg)
        _lint(sub)
    if p.user is not None:
        _lint(p.user, consumer=True)


def _lint_values(where: str, values: Iterable[Arg], fam: Family, arg: str) -> None:
    """Refuse a literal that can never be the argument's value: a pattern or family inside a plain
    value (a tuple of patterns: a list argument is matched whole), a lone int where the family's
    normal form holds an int list as a tuple (``stride=1`` of a conv is ``(1, 1)``), a value no kind
    of the argument takes (``training=0``: a bool is True or False)."""
    for v in values:
        if isinstance(v, tuple):
            _lint_values(where, v, fam, "")
        elif isinstance(v, Op | Const | Scalar | Lit | Var | OneOf | Family):
            hint = f": write Op({v.name})" if isinstance(v, Family) else ""
            raise PatternError(f"{where}: a {type(v).__name__} inside a plain value cannot match{hint}")
        elif (
            arg
            and fam.normalize is not None
            and "ints" in fam.kinds(arg)
            and isinstance(v, int)
            and not isinstance(v, bool)
        ):
            raise PatternError(
                f"{where}: {v!r} is never its value: {fam.name} holds {arg} as a tuple ({arg}=(1, 1), say)"
            )
        elif arg and v is not None and (kinds := fam.kinds(arg)) and not any(fits(k, v) for k in kinds):
            hint = (
                " (a list argument is held as a tuple: write one)"
                if isinstance(v, list)
                else " (a dtype is held as a DTypeArg: DTypeArg('float32'), say)"
                if isinstance(v, str) and "dtype" in kinds
                else ""
            )
            raise PatternError(f"{where}: {v!r} is never its value: {arg} is {' or '.join(sorted(kinds))}{hint}")


def _codes(p: Pattern, *, root: bool = False, consumer: bool = False) -> set[str]:
    out: set[str] = set()
    match p:
        case OneOf():
            for a in p.alternatives:
                out |= _codes(a, consumer=consumer)
        case Op():
            if not root:
                out.add(p.code)
            if p.out is not None:
                out.add(p.out_code)
            if (not root and not consumer and p.users == ONE) or p.user is not None:
                out.add(p.shared)
            if p.family.strict - {k for k, _ in p.args}:  # a strict argument left unnamed
                out.add("arg-mismatch")
            for _, sub in p.args:
                out |= _codes(sub)
            if p.user is not None:
                out |= _codes(p.user, consumer=True)
        case Const():
            out.add("not-constant")
        case Scalar():
            out.add("not-scalar")
        case Lit():
            out.add(p.code)
        case Var():
            pass
    return out


def _rooted(p: Pattern) -> bool:
    """An Op, or alternatives (however nested) that are all Ops."""
    return isinstance(p, Op) or (isinstance(p, OneOf) and all(_rooted(a) for a in p.alternatives))


# primitives whose bindings can never be equal: a matched op, a constant's expression, a number
_NEVER_EQUAL = frozenset({frozenset({"Op", "Const"}), frozenset({"Op", "Scalar"}), frozenset({"Const", "Scalar"})})


_ARTICLE = {"Op": "an "}


def _kinds(p: Pattern | None) -> dict[str, frozenset[str]]:
    """The primitives that may bind each name (``"Op"``, ``"Const"``, ...); refuse a name two parts
    of one match bind with primitives whose values can never be equal (every match would fail)."""
    if p is None:
        return {}
    if isinstance(p, OneOf):
        out: dict[str, frozenset[str]] = {}
        for alt in p.alternatives:
            for k, v in _kinds(alt).items():
                out[k] = out.get(k, frozenset()) | v
        return out
    name = getattr(p, "name", None)
    out = {name: frozenset({type(p).__name__})} if name else {}
    for sub in [*(s for _, s in p.args), p.user] if isinstance(p, Op) else []:
        for k, v in _kinds(sub).items():
            have = out.get(k, frozenset())
            if have and all(frozenset({a, b}) in _NEVER_EQUAL for a in have for b in v):
                a, b = (_ARTICLE.get(x, "a ") + x for x in (sorted(have)[0], sorted(v)[0]))
                raise PatternError(f"{k!r} is bound by {a} and by {b}, which are never one value: rename one")
            out[k] = have | v
    return out


def _conflict_codes(p: Pattern | None) -> dict[str, set[str]]:
    """Per name, the codes its ``Var``s give a conflict of it (none: ``binding-conflict``)."""
    out: dict[str, set[str]] = {}
    subs = p.alternatives if isinstance(p, OneOf) else [*(s for _, s in p.args), p.user] if isinstance(p, Op) else []
    for sub in subs:
        for k, v in _conflict_codes(sub).items():
            out.setdefault(k, set()).update(v)
    if isinstance(p, Var) and p.code != CONFLICT:
        out.setdefault(p.name, set()).add(p.code)
    return out


def _bound_twice(p: Pattern | None) -> dict[str, int]:
    """How many times each name can be bound in one match (alternatives: the most of any one)."""
    counts: dict[str, int] = {}
    if isinstance(p, OneOf):
        for a in p.alternatives:
            for k, v in _bound_twice(a).items():
                counts[k] = max(counts.get(k, 0), v)
    elif isinstance(p, Op):
        for sub in [s for _, s in p.args] + [p.user]:
            for k, v in _bound_twice(sub).items():
                counts[k] = counts.get(k, 0) + v
    if p is not None and (n := getattr(p, "name", None)):
        counts[n] = counts.get(n, 0) + 1
    return counts


@final
@dataclass(frozen=True, slots=True)
class PatternRule:
    """A rule made of a pattern, typed checks, and a planner from the match to a ``RewritePlan``.
    Implements ``fxpure.Rule``; build one with :func:`rule`."""

    name: str
    pattern: Root
    checks: tuple[Check | Compute, ...]
    planner: PlanFn = field(compare=False)
    reads: tuple[str, ...] = ()
    codes: frozenset[str] = frozenset()
    candidate: Callable[[Bound, GraphSnapshot], bool] | None = field(default=None, compare=False)
    fallback: PatternRule | None = None
    plan_codes: frozenset[str] = frozenset()  # what the planner itself may decline with (also in codes)
    repeat: bool = False  # run again on its own result while it plans (fxpure.plan.runs)

    def anchors(self, snap: GraphSnapshot) -> Iterable[NodeSnapshot]:
        """Every call of the root's family (through the snapshot's index by target) that is a candidate."""
        tops = roots(self.pattern)
        calls = snap.calls(frozenset().union(*(op.family.targets for op in tops)))
        keep = self.candidate
        return calls if keep is None else [n for n in calls if _is_candidate(tops, snap, n, keep)]

    def plan_at(self, snap: GraphSnapshot, node: NodeSnapshot) -> Result[RewritePlan, Reason]:
        """The plan at ``node``, or the typed, located reason there is none; when the rule declines
        and its fallback applies there, the fallback's plan, which records the reason it replaces."""
        m, err, _ = _matched(self.pattern, snap, node)  # (as match(...).bind(self._finish), without the wrappers)
        result: Result[RewritePlan, Reason] = self._finish(m) if m is not None else Failure(cast(Reason, err))
        if isinstance(result, Success) or self.fallback is None:
            return result
        reason: Reason = result.failure()
        other = self.fallback.plan_at(snap, node)
        return (
            result
            if isinstance(other, Failure)
            else Success(replace(other.unwrap(), rule=self.name, instead_of=reason))
        )

    def _finish(self, m: Match) -> Result[RewritePlan, Reason]:
        try:
            return self._decide(m)
        except NotLiteral as e:  # an argument the checks or the planner read as a literal is not one
            return Failure(_located(m, e.reason))

    def _decide(self, m: Match) -> Result[RewritePlan, Reason]:
        values: dict[str, object] = {}  # what the need.compute steps computed, by name
        for check in self.checks:
            if isinstance(check, Compute):
                value = check(m, values)
                if not isinstance(value, Success):
                    return Failure(value.failure())
                values[check.binds] = value.unwrap()
                continue
            reason = check(m, values)
            if reason is not None:
                return Failure(reason)
        kwargs = _named(m, values, self.reads)
        planner = Planner(self.name, m)
        out = self.planner(planner, **kwargs)
        if not _is_plan(out):
            raise TypeError(
                f"planner {_name(self.planner)} of rule {self.name} returned {out!r},"
                " not a RewritePlan, Success(RewritePlan) or Failure(Reason)"
            )
        if planner.refused is not None:
            return Failure(planner.refused)
        if isinstance(out, Failure):  # a code the rule does not list is a bug in the rule, as a check's
            _declared(out.failure(), self.plan_codes, "planner", _name(self.planner))
            return Failure(_located(m, out.failure()))
        return _typed(m.snap, out if isinstance(out, RewritePlan) else out.unwrap())

    def attempt(self, snap: GraphSnapshot, node: NodeSnapshot) -> Attempt:
        """How far the rule gets at ``node`` (for ``fxpure explain --node``)."""
        m, err, st = _matched(self.pattern, snap, node)
        if m is not None:
            err = self._finish(m).swap().value_or(None)
        if err is not None and self.fallback is not None and isinstance(self.fallback.plan_at(snap, node), Success):
            err = None  # the fallback rewrites it (plan_at reports its plan as this rule's)
        return Attempt(rule=self.name, anchor=node.name, reason=err, bindings=FrozenDict(st.bindings), depth=st.depth)


def _is_candidate(
    tops: Sequence[Op], snap: GraphSnapshot, node: NodeSnapshot, keep: Callable[[Bound, GraphSnapshot], bool]
) -> bool:
    """A node whose arguments do not even bind is a candidate: it is reported as malformed; so is one
    whose argument ``keep`` reads as a literal is given by a node (:class:`NotLiteral`): the rule
    decides there, with a reason, rather than skip it unreported."""
    family = next(op.family for op in tops if node.target in op.family.schemas)
    args = family.bind(snap, node)
    if isinstance(args, Failure):
        return True
    try:
        return keep(Bound(node=node, family=family, args=args.unwrap(), uses=(node.name,)), snap)
    except NotLiteral:
        return True


def _matches(pattern: Root) -> Callable[[Bound, GraphSnapshot], bool]:
    """``candidate`` given as a pattern: the root is a candidate where the pattern matches at it, or
    where it fails at a node whose arguments do not bind (``malformed-node``, as at the root: the
    rule reports it rather than skip it unreported, an op declared with a default it misreads say)."""

    def candidate(root: Bound, snap: GraphSnapshot) -> bool:
        m, err, _ = _matched(pattern, snap, root.node, loose=True)
        return m is not None or (err is not None and err.code == "malformed-node")

    return candidate


def _is_plan(out: object) -> bool:
    """``out`` is what a planner returns: a plan, ``Success(plan)`` or ``Failure(reason)``."""
    if isinstance(out, Success):
        return isinstance(out.unwrap(), RewritePlan)
    return isinstance(out, RewritePlan) or (isinstance(out, Failure) and isinstance(out.failure(), Reason))


def _located(m: Match, reason: Reason) -> Reason:
    """A planner's reason is located at ``plan`` in the pattern, unless it says where; one about a
    weight expression (which knows no node) at the anchor too."""
    node = m.anchor if reason.node == EXPR_NODE else reason.node
    return reason if reason.path and node == reason.node else replace(reason, node=node, path=reason.path or "plan")


def _typed(snap: GraphSnapshot, p: RewritePlan) -> Result[RewritePlan, Reason]:
    """The plan, if its derived constants are well typed and its new nodes read operands of the
    dtypes torch takes and stand for values of their own dtype and shape
    (:func:`fxpure.plan.ill_fitting`)."""
    specs: dict[str, Spec] = {}
    for c in p.constants:
        spec = infer_spec(c.expr)
        if not isinstance(spec, Success):
            return Failure(replace(spec.failure(), node=p.anchor, path=f"plan.{c.name}"))
        specs[c.name] = spec.unwrap()
    misfit = ill_fitting(snap, p, specs)
    return Success(p) if misfit is None else Failure(replace(misfit, path="plan"))


def rule(
    name: str,
    pattern: Root,
    *checks: Check | Compute,
    plan: PlanFn,
    candidate: Callable[[Bound, GraphSnapshot], bool] | Root | None = None,
    fallback: PatternRule | None = None,
    codes: Iterable[str] = (),
    repeat: bool = False,
) -> PatternRule:
    """A rule from a pattern, checks (``need.*``) run in order after it matches, and a planner.
    A ``need.compute`` step among the checks binds a value the checks after it and the planner read.

    ``plan(p, **bindings)`` takes a :class:`Planner` first, then bound values by keyword: its
    parameter names must be names the pattern binds (those bound only in some alternatives need
    a default). ``candidate(root, snap)`` narrows which calls of the root's family the rule considers
    at all (a grouped-conv rule ignores convs with ``groups=1``); every candidate ends as a plan
    or a typed reason. ``candidate`` may also be a pattern: a call is a candidate where it matches
    (a looser form of the rule's, such as an add that reads a linear, whatever its other operand,
    so residual adds are not reported). ``fallback``: another rule tried where this one declines; its plan is
    reported as this rule's, with ``instead_of`` the reason it stands in for (a quantized conv no
    kernel takes is dequantized to run in float, say). ``codes``: the codes the planner itself may
    decline with (``Failure(reason)``), besides the generic ones; ``rule.codes`` lists them with the
    pattern's and the checks'. ``repeat``: ``plan`` runs the rule again on its own result while it
    plans (up to ``fxpure.plan.MAX_RUNS`` runs), for a rewrite that makes another candidate of it
    (the ``add`` of ``conv(x) * s + t`` reads the conv the ``mul`` folded into); a later run reports
    no rejection at a node an earlier run decided, nor at a node the rule made. Everything is
    checked here, when the rule is built.
    """
    for p in (pattern, candidate) if isinstance(candidate, Op | OneOf) else (pattern,):
        if not _rooted(p):
            raise PatternError(f"{name}: a rule's pattern is rooted at an Op (or OneOf of Ops), got {p!r}")
        for op in roots(p):
            _lint(op)
    if isinstance(candidate, Op | OneOf):
        candidate = _matches(candidate)
    kinds = _kinds(pattern)
    if "match" in kinds:
        raise PatternError(f"{name}: {_MATCH}")
    always, some = _steps(name, checks, *_names(pattern), kinds)
    params = list(inspect.signature(plan).parameters.values())
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        raise PatternError(f"{name}: the planner takes the Planner as its first parameter")
    _keywords(f"{name}: the planner", params[1:])
    reads = []
    for param in params[1:]:
        if param.name not in always | some:
            raise PatternError(f"{name}: the planner reads {param.name!r}, which the pattern never binds")
        if param.name in some and param.default is param.empty:
            raise PatternError(f"{name}: the planner reads {param.name!r}, which {_SOME}")
        reads.append(param.name)
    plan_codes = frozenset(codes)
    every = set(GENERIC_CODES).union(*(_codes(op, root=True) for op in roots(pattern)), plan_codes)
    if repeat:
        every.add(RUNS_EXHAUSTED)
    for check in checks:
        every |= check.codes
    coded = _conflict_codes(pattern)
    every.update(*(coded.get(n) or {CONFLICT} for n, v in _bound_twice(pattern).items() if v > 1))
    return PatternRule(
        name, pattern, tuple(checks), plan, tuple(reads), frozenset(every), candidate, fallback, plan_codes, repeat
    )


_MATCH = "'match' names the whole match in checks: bind another name"
_SOME = (
    "is bound on some matches only (in some alternatives, or under an argument some spellings lack): give it a default"
)


def _steps(
    name: str,
    checks: Sequence[object],
    always: frozenset[str],
    some: frozenset[str],
    kinds: Mapping[str, frozenset[str]],
) -> tuple[frozenset[str], frozenset[str]]:
    """Refuse checks and computes that read what is not bound before them (or may not be, for a
    function without a default), or a matched op that is none; the names bound after them."""
    computed: set[str] = set()
    for check in checks:
        if not isinstance(check, Check | Compute):
            raise PatternError(f"{name}: {check!r} is not a Check (wrap functions with need.check)")
        kind = "compute" if isinstance(check, Compute) else "check"
        for r in check.reads:
            if r not in always | some:
                raise PatternError(f"{name}: {kind} {check.label} reads {r!r}, which nothing binds before it")
            if r in some and r in check.needs:  # (a function of the author's, called with keywords)
                raise PatternError(f"{name}: {kind} {check.label} reads {r!r}, which {_SOME}")
            if r in computed and isinstance(check, Check) and not check.computed:
                raise PatternError(f"{name}: check {check.label} reads bindings, and {r!r} is computed: use need.check")
        for r in check.ops if isinstance(check, Check) else ():
            if not kinds.get(r, frozenset({"Op"})) & {"Op"}:  # (a computed value: reads said so already)
                by = ", ".join(sorted(kinds[r]))
                raise PatternError(
                    f"{name}: check {check.label} reads {r!r} as an op, and the pattern binds it by {by}, not Op"
                )
        for r in check.weights if isinstance(check, Check) else ():
            if r in kinds and "Const" not in kinds[r]:  # (its dim 0 is no channel count of an activation)
                by = ", ".join(sorted(kinds[r]))
                raise PatternError(
                    f"{name}: check {check.label} reads {r!r} as a weight, and the pattern binds it by {by}, not Const"
                )
        if isinstance(check, Compute):
            if check.binds == "match":
                raise PatternError(f"{name}: compute {check.label}: {_MATCH}")
            if check.binds in always | some:
                raise PatternError(f"{name}: compute {check.label} binds {check.binds!r}, which is bound already")
            always = always | {check.binds}  # for the checks after it and the planner
            computed.add(check.binds)
    return always, some


def explain(snap: GraphSnapshot, rule: Any, node: NodeSnapshot | str) -> Attempt:
    """How far ``rule`` gets at ``node`` (a node, or its name): a pattern rule reports its partial
    bindings and depth; a hand-written one just its reason."""
    if isinstance(node, str):
        if node not in snap.index:
            raise KeyError(f"the snapshot has no node {node!r}")
        node = snap.node(node)
    if isinstance(rule, PatternRule):
        return rule.attempt(snap, node)
    result = rule.plan_at(snap, node)
    reason = result.failure() if isinstance(result, Failure) else None
    return Attempt(rule=rule.name, anchor=node.name, reason=reason, bindings=FrozenDict({}), depth=0)


def attempts(report: RewriteReport, rules: Sequence[Rule], node: str) -> tuple[Attempt, ...]:
    """For each rule that considered ``node``, how far it got there, on the snapshot it planned on
    (rules run in stages, each on the previous one's result); ``report`` comes from ``plan``. A
    later stage considers, in place of ``node``, the nodes an earlier stage made from it (each
    attempt names its ``anchor``)."""
    current, out = report.before, []
    stages = iter(report.stages)  # a report without stages: each rule looks at the snapshot planned on
    for r in rules:
        for _ in range(runs(r)):  # a rule with ``repeat``: its runs, up to the first that planned nothing
            stage = next(stages, ())
            for a in r.anchors(current):
                if a.name != node and a.provenance != node:
                    continue
                attempt = explain(current, r, a)
                late = next((j.reason for j in report.rejections if j.rule == r.name and j.node == a.name), None)
                attempt = attempt if attempt.reason is not None or late is None else replace(attempt, reason=late)
                if attempt not in out:  # a later run that got as far as an earlier one
                    out.append(attempt)
            current = rewrite(current, stage).value_or(current)
            if not stage:
                break
    # a candidate no snapshot holds, declined by the adapter (a node of a control-flow branch, a module call)
    seen, names = {(a.rule, a.anchor) for a in out}, {r.name for r in rules}
    for j in report.rejections:
        if j.node == node and j.rule in names and (j.rule, node) not in seen:  # (a rule given twice: once)
            seen.add((j.rule, node))
            out.append(Attempt(rule=j.rule, anchor=node, reason=j.reason, bindings=FrozenDict({}), depth=0))
    return tuple(out)

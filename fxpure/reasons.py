"""Typed reasons: why a rule declined a candidate, or why a rewrite failed.

One record per failure mode: each pattern primitive fails in exactly one way and says so
with one of these, carrying a stable kebab-case ``code`` (a primitive may be given its own
code, such as ``producer-not-conv`` for "the producer is not a convolution"), the ``node``
where it failed, the ``path`` in the pattern (``bn.input/conv.weight``), and the details.
``message`` is for people; codes and field names are stable.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar, final

from returns.result import Failure, Result

if TYPE_CHECKING:
    from fxpure.snapshot import Arg, Dim


@dataclass(frozen=True, slots=True, kw_only=True)
class Reason:
    """Base of every reason record: a stable ``code``, the ``node`` it is about, and ``path``,
    where in the pattern it failed ("" when no pattern was involved)."""

    code: str
    node: str
    path: str = ""

    @property
    def message(self) -> str:
        """Human-readable explanation.

        >>> NotConstant(node="conv", role="weight", source="x").message
        "weight of conv is not a constant (it is computed by 'x')"
        """
        return f"{self.node}: {self.code}"

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


@dataclass(frozen=True, slots=True, kw_only=True)
class _Detailed(Reason):
    """A reason told by a free-form detail about its node."""

    detail: str

    @property
    def message(self) -> str:
        return f"{self.node}: {self.detail}"


R = TypeVar("R", bound=Reason)


def first_failure(results: Iterable[Result[object, R]]) -> R | None:
    """The reason of the first failed result, or None when every one succeeded.

    >>> from returns.result import Failure, Success
    >>> first_failure([Success(1), Failure(Malformed(node="n", detail="bad"))]).code
    'malformed-node'
    """
    for r in results:
        if isinstance(r, Failure):
            err: R = r.failure()
            return err
    return None


# --- failures of pattern primitives ---------------------------------------------------------------


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class Malformed(_Detailed):
    """A node's arguments do not fit its op's schema."""

    code: str = "malformed-node"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class WrongOp(Reason):
    """An operand comes from (or, ``consumer``, the output goes to) a node of another op."""

    code: str = "wrong-op"
    role: str
    producer: str
    target: str
    expected: str
    consumer: bool = False

    @property
    def message(self) -> str:
        if self.consumer:
            return f"output of {self.node} goes to {self.producer} ({self.target}), not {self.expected}"
        return f"{self.role} of {self.node} comes from {self.producer} ({self.target}), not {self.expected}"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class OutputShared(Reason):
    """A node the rewrite would remove is also read by other nodes."""

    code: str = "output-shared"
    users: tuple[str, ...]

    @property
    def message(self) -> str:
        if not self.users:  # (a pattern's ``user=``, where nothing reads the node)
            return f"output of {self.node} is read by no node, where the pattern takes its one reader"
        return f"output of {self.node} is also used by {', '.join(self.users)}"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class TupleUsed(Reason):
    """A user reads another element of a tuple-output op than the one the rewrite keeps."""

    code: str = "tuple-output-used"
    user: str
    index: int

    @property
    def message(self) -> str:
        return f"{self.user} reads more than output {self.index} of {self.node}"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class NotConstant(Reason):
    """An operand the rule must fold is computed at run time."""

    code: str = "not-constant"
    role: str
    source: str
    computed: bool = True  # False: no node gives the operand (a number, or nothing), shown in ``source``

    @property
    def message(self) -> str:
        if not self.computed:
            return f"{self.role} of {self.node} is not a constant tensor (it is {self.source})"
        return f"{self.role} of {self.node} is not a constant (it is computed by {self.source!r})"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class NotScalar(Reason):
    """An operand the rule needs as a Python number is something else."""

    code: str = "not-scalar"
    role: str
    value: str

    @property
    def message(self) -> str:
        return f"{self.role} of {self.node} is {self.value}, not a number"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class ArgMismatch(Reason):
    """A non-tensor argument has a value the rule does not handle. ``text``, when given, is the
    message with ``{node}``, ``{role}``, ``{value}`` and ``{expected}`` filled in."""

    code: str = "arg-mismatch"
    role: str
    value: Arg
    expected: tuple[Arg, ...]
    text: str = ""

    @property
    def message(self) -> str:
        expected = " or ".join(repr(e) for e in self.expected)
        if self.text:
            return self.text.format(node=self.node, role=self.role, value=self.value, expected=expected)
        return f"{self.role} of {self.node} is {self.value!r}, expected {expected}"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class BindingConflict(Reason):
    """A pattern variable used twice would bind two different values."""

    code: str = "binding-conflict"
    name: str
    first: str
    second: str

    @property
    def message(self) -> str:
        return f"{self.name} is {self.first} in one place and {self.second} at {self.node}"


# --- failures of typed checks on bound values -----------------------------------------------------


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class SymbolicShape(Reason):
    """A dimension the rule needs is symbolic."""

    code: str = "symbolic-shape"
    role: str
    shape: tuple[Dim, ...]

    @property
    def message(self) -> str:
        return f"{self.role} of {self.node} has symbolic shape {self.shape}"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class UnsupportedDtype(Reason):
    """The rule only handles some dtypes."""

    code: str = "unsupported-dtype"
    role: str
    dtype: str

    @property
    def message(self) -> str:
        return f"{self.role} of {self.node} has dtype {self.dtype}"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class UnsupportedRank(Reason):
    """The rule handles only some ranks (``of``: what is counted, e.g. "spatial dims")."""

    code: str = "unsupported-rank"
    rank: int
    allowed: tuple[int, ...]
    of: str = "spatial dims"

    @property
    def message(self) -> str:
        return f"{self.node} has {self.rank} {self.of}, the rule handles {self.allowed}"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class ChannelMismatch(Reason):
    """Channel counts of the fused operands disagree."""

    code: str = "channel-mismatch"
    expected: int
    found: int

    @property
    def message(self) -> str:
        return f"{self.node} has {self.found} channels, the conv produces {self.expected}"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class Declined(Reason):
    """A rule's own check said no; ``detail`` is the whole message."""

    detail: str

    @property
    def message(self) -> str:
        return self.detail


# --- failures outside matching --------------------------------------------------------------------


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class PlanConflict(_Detailed):
    """Two plans claim the same node, or a plan does not fit the graph."""

    code: str = "plan-conflict"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class BadExpr(Reason):
    """A weight expression is ill-typed (shape or dtype)."""

    code: str = "bad-weight-expr"
    detail: str

    @property
    def message(self) -> str:
        return self.detail


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class InvalidSnapshot(_Detailed):
    """A snapshot breaks an invariant (order, users, constants)."""

    code: str = "invalid-snapshot"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class NonFinite(Reason):
    """A derived constant does not hold its values in its dtype: it computes to inf or NaN (a fold
    that overflows float16), or, with code ``weight-underflow``, computed wider and cast back, it
    loses a channel below the dtype's smallest normal (a float16 fold by a small scale, flushed
    toward zero), where the op it replaces scaled a sum of ordinary values."""

    code: str = "non-finite-weight"
    constant: str
    dtype: str

    @property
    def message(self) -> str:
        if self.code == "weight-underflow":
            return f"{self.node}: folding flushes a channel of {self.constant} toward zero ({self.dtype} underflows)"
        return f"{self.node}: folding gives inf or NaN in {self.constant} ({self.dtype})"


GENERIC_CODES = frozenset(
    {
        "malformed-node",
        "plan-conflict",
        "bad-weight-expr",
        "non-finite-weight",
        "weight-underflow",
        "module-call",
        "in-subgraph",
        "preserved-signature",
        "op-not-allowed",
        "written-between",
        "dim-order-changes",
        "unsupported-argument",
    }
)
"""Codes any rule may end with, whatever its pattern: a node that fits no schema, a plan that overlaps
another, a derived weight that is ill-typed; and, found by the adapter, a weight that computes to
inf or NaN or, cast back to float16, loses a channel to underflow, a candidate that is an
``nn.Module`` call (``symbolic_trace``), one in a control-flow branch, one whose plan would remove a
node a preserved module call signature names (``torch.export``'s
``preserve_module_call_signature``), one whose plan writes an op the program's own verifier refuses
(``op-not-allowed``: an edge program takes Core ATen ops and the exceptions it was made with), or
one whose new nodes would read a tensor on the other side of an in-place write to it than the nodes
they replace did, or whose moved uses would read, or write, a tensor written in place while they use
it (``written-between``), or one with a new node an edge program's portable ExecuTorch kernels would
refuse, its input channels last and its output laid out otherwise (``dim-order-changes``: a slice of
a channels-last tensor), or one whose new node copies a literal the adapter cannot write into a
program (``unsupported-argument``: an object captured as its text, other than a memory format)."""

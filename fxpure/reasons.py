"""Typed reasons: why a rule declined a candidate, or why a rewrite failed.

Every reason is a frozen record with a stable kebab-case ``code`` and a human
``message``. The set is closed: rules only ever return these.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar, TypeVar, final

from returns.result import Failure, Result


@dataclass(frozen=True, slots=True, kw_only=True)
class Reason:
    """Base of every reason record; ``code`` is stable, ``message`` is for people."""

    code: ClassVar[str] = "reason"
    node: str

    @property
    def message(self) -> str:
        """Human-readable explanation.

        >>> NotConstant(node="conv", role="weight", source="x").message
        "weight of conv is not a constant (it is computed by 'x')"
        """
        return self.code

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


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class Malformed(_Detailed):
    """A node's arguments do not fit its op's schema."""

    code: ClassVar[str] = "malformed-node"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class NotAConv(Reason):
    """The batch norm's input is not produced by a convolution."""

    code: ClassVar[str] = "producer-not-conv"
    producer: str
    target: str

    @property
    def message(self) -> str:
        return f"input of {self.node} comes from {self.producer} ({self.target}), not a convolution"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingMode(Reason):
    """A batch norm that updates or uses batch statistics cannot be folded."""

    code: ClassVar[str] = "bn-training-mode"

    @property
    def message(self) -> str:
        return f"{self.node} runs in training mode (batch statistics)"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class OutputShared(Reason):
    """The conv output is read by other nodes too, so it must stay unfused."""

    code: ClassVar[str] = "conv-output-shared"
    users: tuple[str, ...]

    @property
    def message(self) -> str:
        return f"output of {self.node} is also used by {', '.join(self.users)}"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class StatsUsed(Reason):
    """A user reads the batch norm's saved mean/invstd, not just its output."""

    code: ClassVar[str] = "bn-stats-used"
    user: str

    @property
    def message(self) -> str:
        return f"{self.user} reads more than output 0 of {self.node}"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class NotConstant(Reason):
    """An operand the rule must fold is computed at run time."""

    code: ClassVar[str] = "not-constant"
    role: str
    source: str

    @property
    def message(self) -> str:
        return f"{self.role} of {self.node} is not a constant (it is computed by {self.source!r})"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class SymbolicShape(Reason):
    """A dimension the rule needs is symbolic."""

    code: ClassVar[str] = "symbolic-shape"
    role: str
    shape: tuple[int | str, ...]

    @property
    def message(self) -> str:
        return f"{self.role} of {self.node} has symbolic shape {self.shape}"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class UnsupportedDtype(Reason):
    """The rule only handles some dtypes."""

    code: ClassVar[str] = "unsupported-dtype"
    role: str
    dtype: str

    @property
    def message(self) -> str:
        return f"{self.role} of {self.node} has dtype {self.dtype}"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class ChannelMismatch(Reason):
    """Channel counts of the fused operands disagree."""

    code: ClassVar[str] = "channel-mismatch"
    expected: int
    found: int

    @property
    def message(self) -> str:
        return f"{self.node} has {self.found} channels, the conv produces {self.expected}"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class PlanConflict(_Detailed):
    """Two plans claim the same node, or a plan does not fit the graph."""

    code: ClassVar[str] = "plan-conflict"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class BadExpr(Reason):
    """A weight expression is ill-typed (shape or dtype)."""

    code: ClassVar[str] = "bad-weight-expr"
    detail: str

    @property
    def message(self) -> str:
        return self.detail


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class InvalidSnapshot(_Detailed):
    """A snapshot breaks an invariant (order, users, constants)."""

    code: ClassVar[str] = "invalid-snapshot"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class GroupsOutOfRange(Reason):
    """The number of groups is outside the rule's policy range."""

    code: ClassVar[str] = "groups-out-of-range"
    groups: int
    low: int
    high: int

    @property
    def message(self) -> str:
        return f"groups={self.groups}, allowed {self.low}..{self.high}"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class Depthwise(Reason):
    """A depthwise convolution (in == out == groups) runs natively; nothing to split."""

    code: ClassVar[str] = "depthwise-conv"
    groups: int

    @property
    def message(self) -> str:
        return f"{self.node} is depthwise (in = out = groups = {self.groups})"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class TransposedConv(Reason):
    """The rule handles only regular (not transposed) convolutions."""

    code: ClassVar[str] = "transposed-conv"

    @property
    def message(self) -> str:
        return f"{self.node} is a transposed convolution"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class UnsupportedRank(Reason):
    """The rule handles only some numbers of spatial dims."""

    code: ClassVar[str] = "unsupported-rank"
    rank: int
    allowed: tuple[int, ...]

    @property
    def message(self) -> str:
        return f"{self.node} has {self.rank} spatial dims, the rule handles {self.allowed}"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class NotQuantized(Reason):
    """An operand is not in the quantized form the rule rewrites (dequantize in, quantize out)."""

    code: ClassVar[str] = "not-quantized"
    role: str
    detail: str

    @property
    def message(self) -> str:
        return f"{self.role} of {self.node} {self.detail}"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class AsymmetricWeight(Reason):
    """The weight has non-zero (or unknown) zero points; the int8 kernels assume symmetric weights."""

    code: ClassVar[str] = "asymmetric-weight"
    detail: str

    @property
    def message(self) -> str:
        return f"weight of {self.node}: {self.detail}"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class ChannelAlignment(Reason):
    """A channel count the kernel needs aligned to its texel width is not."""

    code: ClassVar[str] = "channel-alignment"
    what: str
    channels: int
    align: int

    @property
    def message(self) -> str:
        return f"{self.node}: {self.what} is {self.channels}, not a multiple of {self.align}"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class NoKernel(_Detailed):
    """No target kernel implements this configuration."""

    code: ClassVar[str] = "no-kernel"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class NonFinite(Reason):
    """A derived constant computes to inf or NaN (e.g. a fold that overflows float16)."""

    code: ClassVar[str] = "non-finite-weight"
    constant: str
    dtype: str

    @property
    def message(self) -> str:
        return f"{self.node}: folding gives inf or NaN in {self.constant} ({self.dtype})"

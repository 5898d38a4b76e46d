"""Views: one normalised record for the many spellings of an op (read through its family)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import final

from returns.result import Failure, Result, Success

from fxpure.families import BATCH_NORM, CONV
from fxpure.reasons import Malformed
from fxpure.snapshot import Arg, GraphSnapshot, NodeRef, NodeSnapshot


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


def _ints(value: Arg) -> tuple[int, ...]:
    return tuple(v for v in value if isinstance(v, int)) if isinstance(value, tuple) else ()


def conv_view(snap: GraphSnapshot, node: NodeSnapshot) -> Result[ConvView, Malformed]:
    """Normalise ``aten.conv{1,2,3}d``, ``conv_transpose*`` and ``convolution``; a conv on an
    unbatched input (or a ``conv{1,2,3}d`` with no shape known) is ``Malformed``.

    >>> from fxpure.snapshot import TensorSpec, snapshot
    >>> n = NodeSnapshot(name="c", op="call_function", target="aten.conv2d.default",
    ...                  args=(NodeRef("x"), NodeRef("w"), None, (2, 2)),
    ...                  spec=TensorSpec(shape=(1, 8, 4, 4), dtype="float32"))
    >>> v = conv_view(snapshot([], {}), n).unwrap()
    >>> v.stride, v.padding, v.groups, v.transposed
    ((2, 2), (0, 0), 1, False)
    """
    return CONV.bind(snap, node).bind(lambda a: _conv_from(node.name, a))


def _conv_from(n: str, a: Mapping[str, Arg]) -> Result[ConvView, Malformed]:
    x, w, b, transposed, groups, padding = (
        a["input"],
        a["weight"],
        a["bias"],
        a["transposed"],
        a["groups"],
        a["padding"],
    )
    if not isinstance(x, NodeRef) or not isinstance(w, NodeRef) or not isinstance(b, NodeRef | None):
        return Failure(Malformed(node=n, detail=f"bias is {b!r}, expected a tensor"))
    return Success(
        ConvView(
            node=n,
            x=x,
            w=w,
            b=b,
            stride=_ints(a["stride"]),
            padding=padding if isinstance(padding, str) else _ints(padding),
            dilation=_ints(a["dilation"]),
            transposed=transposed is True,
            output_padding=_ints(a["output_padding"]),
            groups=groups if isinstance(groups, int) else 1,
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
    bound = BATCH_NORM.bind(snap, node)
    if isinstance(bound, Failure):
        return Failure(bound.failure())
    a = bound.unwrap()
    refs = {k: a[k] for k in ("input", "weight", "bias", "running_mean", "running_var")}
    x, eps, training = refs.pop("input"), a["eps"], a["training"]
    if not isinstance(x, NodeRef) or not all(isinstance(v, NodeRef | None) for v in refs.values()):
        return Failure(Malformed(node=node.name, detail="an operand is not a tensor"))
    if not isinstance(eps, (int, float)) or not isinstance(training, bool):
        return Failure(Malformed(node=node.name, detail=f"eps={eps!r}, training={training!r}"))
    ref = {k: v if isinstance(v, NodeRef) else None for k, v in refs.items()}
    return Success(
        BatchNormView(
            node=node.name,
            x=x,
            weight=ref["weight"],
            bias=ref["bias"],
            mean=ref["running_mean"],
            var=ref["running_var"],
            training=training,
            eps=float(eps),
            tuple_output=BATCH_NORM.schemas[node.target].tuple_output,
        )
    )

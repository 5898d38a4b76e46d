"""Translation between torch objects and the core's canonical names."""

from __future__ import annotations

import contextlib
import importlib
import operator
from collections.abc import Callable
from functools import cache
from typing import Any

import torch
from executorch.exir.dialects._ops import ops as exir_ops
from executorch.exir.dialects.edge._ops import EdgeOpOverload


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


_TARGET_NAMES: dict[Any, str] = {operator.getitem: "getitem"}


def target_name(target: Any) -> str:
    """Canonical name of an FX call_function target (``"aten.convolution.default"``)."""
    try:
        return _TARGET_NAMES[target]
    except (KeyError, TypeError):
        pass
    op = target._op if isinstance(target, EdgeOpOverload) else target
    if isinstance(op, torch._ops.OpOverload):
        ns, _, base = op._schema.name.partition("::")
        name = f"{ns}.{base}.{op._overloadname}"
    elif isinstance(op, torch._ops.HigherOrderOperator):  # (its repr holds an address)
        name = f"higher_order.{op.name()}"  # type: ignore[no-untyped-call]
    else:
        name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"
    with contextlib.suppress(TypeError):
        _TARGET_NAMES[target] = name
    return name


def is_edge(target: Any) -> bool:
    """True for an edge-dialect op."""
    return isinstance(target, EdgeOpOverload)


# op namespaces whose operators exist only once a library module has registered them
OP_LIBRARIES = {"et_vk": "executorch.backends.vulkan.custom_ops_lib"}


@cache
def resolve_target(name: str, dialect: str) -> Callable[..., Any]:
    """The op overload for a canonical name in a dialect; raises ValueError if there is none (no
    such op or overload, a name of something else, ``aten.conv2d.__call__``, or an op whose library
    does not import)."""
    if name == "getitem":
        return operator.getitem
    parts = name.split(".")
    if len(parts) != 3:
        raise ValueError(f"cannot resolve op {name!r}")
    ns, op, overload = parts
    if ns in OP_LIBRARIES:
        try:
            importlib.import_module(OP_LIBRARIES[ns])
        except Exception as e:  # (an ImportError, or whatever the library's registration raises)
            raise ValueError(f"cannot resolve op {name!r}: {OP_LIBRARIES[ns]} does not import ({e})") from e
    root: Any = exir_ops.edge if dialect == "edge" else torch.ops
    try:
        target: Callable[..., Any] = getattr(getattr(getattr(root, ns), op), overload)
    except AttributeError as e:
        raise ValueError(f"cannot resolve op {name!r} in dialect {dialect}") from e
    if not isinstance(target, torch._ops.OpOverload | EdgeOpOverload):
        raise ValueError(f"cannot resolve op {name!r} in dialect {dialect}: {overload!r} is no overload of {op}")
    return target


# user-level functions by the core's ``source_fn`` names, for ``meta["source_fn_stack"]``
SOURCE_FNS: dict[str, Any] = {
    "split": torch.split,
    "getitem": operator.getitem,
    "cat": torch.cat,
    "conv1d": torch.conv1d,
    "conv2d": torch.conv2d,
    "conv_transpose2d": torch.conv_transpose2d,
    "convolution": torch.convolution,
    "linear": torch.nn.functional.linear,
    "permute": torch.permute,
    "unsqueeze": torch.unsqueeze,
    "squeeze": torch.squeeze,
    "reshape": torch.reshape,
    "slice": operator.getitem,
}

"""The torch side of fxpure: capture programs, materialise weights, apply plans.

Names load lazily, so ``import adapters`` (and the ``fxpure`` console script) stays
cheap and quiet until torch is actually needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from adapters import passes
    from adapters.realize import TransformError, TransformOutcome, apply, transform
    from adapters.snap import capture
    from adapters.validate import check_plans
    from adapters.weights import materialize

_LAZY = {
    "passes": ("adapters.passes", None),
    "capture": ("adapters.snap", "capture"),
    "check_plans": ("adapters.validate", "check_plans"),
    "materialize": ("adapters.weights", "materialize"),
    "TransformError": ("adapters.realize", "TransformError"),
    "TransformOutcome": ("adapters.realize", "TransformOutcome"),
    "apply": ("adapters.realize", "apply"),
    "transform": ("adapters.realize", "transform"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'adapters' has no attribute {name!r}")
    module, attr = _LAZY[name]
    loaded = importlib.import_module(module)
    return loaded if attr is None else getattr(loaded, attr)


__all__ = [
    "TransformError",
    "TransformOutcome",
    "apply",
    "capture",
    "check_plans",
    "materialize",
    "passes",
    "transform",
]

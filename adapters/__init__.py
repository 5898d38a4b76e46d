"""The torch side of fxpure: capture programs, materialise weights, apply plans."""

from adapters import passes
from adapters.apply import TransformError, TransformOutcome, apply, transform
from adapters.capture import capture
from adapters.materialize import materialize

__all__ = ["TransformError", "TransformOutcome", "apply", "capture", "materialize", "passes", "transform"]

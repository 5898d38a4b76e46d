"""The torch side of fxpure: capture programs, materialise weights, apply plans."""

from adapters import passes
from adapters.capture import capture
from adapters.materialize import materialize
from adapters.realize import TransformError, TransformOutcome, apply, transform

__all__ = ["TransformError", "TransformOutcome", "apply", "capture", "materialize", "passes", "transform"]

"""Plain-data (JSON-ready) form of plans, reports and reasons."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

JSON = None | bool | int | float | str | list["JSON"] | dict[str, "JSON"]


def to_data(value: object) -> JSON:
    """Records become dicts tagged with ``"type"``; reasons also carry ``code`` and ``message``.

    >>> from fxpure.snapshot import TensorSpec
    >>> to_data(TensorSpec(shape=(2, "s0"), dtype="int8"))
    {'type': 'TensorSpec', 'shape': [2, 's0'], 'dtype': 'int8'}
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return [to_data(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): to_data(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, JSON] = {"type": type(value).__name__}
        # a field the record derives itself (init=False) is a cache of the others, not data
        out.update({f.name: to_data(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init})
        for extra in ("code", "message"):
            if hasattr(value, extra) and extra not in out:
                out[extra] = to_data(getattr(value, extra))
        return out
    if callable(value) and hasattr(value, "__qualname__"):  # a function (a family's normaliser): by name
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return repr(value)

"""The read-only map the core's records hold."""

from __future__ import annotations

from typing import NoReturn, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class FrozenDict(dict[K, V]):
    """A dict whose methods refuse to change it, looked up at a dict's speed, and copied
    (``copy.deepcopy``) and pickled as one: ``types.MappingProxyType``, which the records held
    before, is neither, so a rule, a snapshot or a report could not be copied (a pass list
    deep-copied with its config). ``dict``'s own methods called on it (``dict.update(d, ...)``,
    ``d.__init__(...)`` again) still change it: a guard on ``__init__`` would cost every record
    made six times what making it costs."""

    __slots__ = ()

    def _read_only(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError(f"{type(self).__name__} is read-only")

    __setitem__ = __delitem__ = __ior__ = _read_only
    clear = pop = popitem = setdefault = update = _read_only

    def __reduce__(self) -> tuple[type[FrozenDict[K, V]], tuple[dict[K, V]]]:
        return (type(self), (dict(self),))

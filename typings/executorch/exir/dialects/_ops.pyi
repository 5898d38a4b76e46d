from typing import Any

class _Ops:
    edge: Any
    backend: Any

ops: _Ops

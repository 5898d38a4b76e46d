from typing import Any

import torch

class EdgeOpOverload:
    _op: torch._ops.OpOverload[Any, Any]
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

from typing import Any

class XnnpackPartitioner:
    def __init__(self, *args: Any, **kwargs: Any) -> None: ...

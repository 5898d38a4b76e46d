from typing import Any

class VulkanPartitioner:
    def __init__(self, compile_options: dict[str, Any] | None = None) -> None: ...

from typing import Any

from torch.export import ExportedProgram

class ExecutorchProgramManager:
    @property
    def buffer(self) -> bytes: ...
    def exported_program(self, method_name: str = ...) -> ExportedProgram: ...

class EdgeCompileConfig:
    def __init__(self, **kwargs: Any) -> None: ...

class EdgeProgramManager:
    def exported_program(self, method_name: str = ...) -> ExportedProgram: ...
    def transform(self, passes: Any, compile_config: Any = ...) -> EdgeProgramManager: ...
    def to_executorch(self, config: Any = ...) -> ExecutorchProgramManager: ...
    def to_backend(self, partitioner: Any) -> EdgeProgramManager: ...

def to_edge(
    programs: ExportedProgram | dict[str, ExportedProgram],
    constant_methods: Any = ...,
    compile_config: EdgeCompileConfig | None = ...,
) -> EdgeProgramManager: ...
def to_edge_transform_and_lower(
    programs: ExportedProgram | dict[str, ExportedProgram],
    transform_passes: Any = ...,
    partitioner: Any = ...,
    constant_methods: Any = ...,
    compile_config: EdgeCompileConfig | None = ...,
) -> EdgeProgramManager: ...

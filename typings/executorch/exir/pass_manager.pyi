from collections.abc import Sequence
from typing import Any

from executorch.exir.pass_base import ExportedProgramPassResult
from torch.export import ExportedProgram

class ExportedProgramPassManager:
    def __init__(self, passes: Sequence[Any], run_checks_after_each_pass: bool = ..., steps: int = ...) -> None: ...
    def __call__(
        self, exported_program: ExportedProgram, override_verifiers: Any = ...
    ) -> ExportedProgramPassResult: ...

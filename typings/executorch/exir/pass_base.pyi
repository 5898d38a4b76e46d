from dataclasses import dataclass

from torch.export import ExportedProgram

@dataclass(frozen=True)
class ExportedProgramPassResult:
    exported_program: ExportedProgram
    modified: bool

class ExportedProgramPassBase:
    def __call__(self, exported_program: ExportedProgram) -> ExportedProgramPassResult: ...
    def call(self, exported_program: ExportedProgram) -> ExportedProgramPassResult: ...
    def requires(self, exported_program: ExportedProgram) -> None: ...
    def ensures(self, exported_program: ExportedProgram) -> None: ...

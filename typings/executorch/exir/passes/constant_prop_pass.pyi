from torch.export import ExportedProgram

def constant_prop_pass(
    exported_program: ExportedProgram, custom_skip_targets: set[object] | None = None, _skip_dim_order: bool = True
) -> ExportedProgram: ...

"""Build test programs in each form, and check them after a transform."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from executorch.exir import to_edge
from executorch.runtime import Runtime
from torch.export import ExportedProgram

Program = ExportedProgram | torch.fx.GraphModule
FORMS = ("gm", "aten", "edge")


def build(model: torch.nn.Module, x: tuple[torch.Tensor, ...], form: str) -> Program:
    """``gm``: unlifted GraphModule; ``aten``: torch.export; ``edge``: after to_edge."""
    ep = torch.export.export(copy.deepcopy(model), x)
    if form == "gm":
        return ep.module()
    if form == "aten":
        return ep
    return to_edge(ep).exported_program()


def run(program: Program, x: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Outputs of the program as a flat list."""
    module = program.module() if isinstance(program, ExportedProgram) else program
    with torch.no_grad():
        out = module(*x)
    return list(out) if isinstance(out, (list, tuple)) else [out]


def assert_close(got: list[torch.Tensor], want: list[torch.Tensor], rel: float = 1e-5) -> None:
    """Each output within ``rel`` of the reference, relative to its magnitude."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        scale = max(w.abs().max().item(), 1e-6)
        err = (g.float() - w.float()).abs().max().item() / scale
        assert err <= rel, f"relative error {err:.3g} > {rel}"


def count(program: Program, name_part: str) -> int:
    """Number of call_function nodes whose target mentions ``name_part``."""
    gm = program.graph_module if isinstance(program, ExportedProgram) else program
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and name_part in str(n.target))


def dead_constants(program: Program) -> list[str]:
    """Constants present in the program that no node reads."""
    if isinstance(program, ExportedProgram):
        used = {n.name for n in program.graph.nodes if n.op == "placeholder" and n.users}
        live = {s.target for s in program.graph_signature.input_specs if s.arg.name in used}
        stored = set(program.state_dict) | set(program.constants)
        placeholders = [n.name for n in program.graph.nodes if n.op == "placeholder" and not n.users]
        return sorted((stored - live) | set(placeholders))
    read = {n.target for n in program.graph.nodes if n.op == "get_attr" and n.users}
    names = {k for k, _ in program.named_parameters()} | {k for k, _ in program.named_buffers()}
    return sorted(names - read)


def validate(program: ExportedProgram) -> None:
    """``ExportedProgram.validate()`` (untyped upstream)."""
    check: Callable[[], None] = program.validate
    check()


def assert_sound(program: Program, x: tuple[torch.Tensor, ...], want: list[torch.Tensor]) -> None:
    """After a transform: same outputs, no dead constant anywhere, and the program validates."""
    assert_close(run(program, x), want)
    assert dead_constants(program) == []
    if isinstance(program, ExportedProgram):
        validate(program)
    else:
        program.graph.lint()


def run_pte(buffer: bytes, x: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Run a serialised ExecuTorch program in the runtime (the program kept alive while its method
    runs: a method outliving it read freed memory, and gave numbers far off)."""
    program = Runtime.get().load_program(buffer)
    method = program.load_method("forward")
    assert method is not None
    return [t for t in method.execute(list(x)) if isinstance(t, torch.Tensor)]

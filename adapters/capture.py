"""capture: GraphModule / ExportedProgram -> GraphSnapshot, in one pass over the nodes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from pyrsistent import pmap
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec

from adapters.torchnames import dtype_name, is_edge, target_name
from fxpure.snapshot import (
    Arg,
    ConstantInfo,
    ConstantKind,
    DTypeArg,
    GraphSnapshot,
    NodeRef,
    NodeSnapshot,
    Opaque,
    Spec,
    TensorSpec,
    snapshot,
)

Program = ExportedProgram | torch.fx.GraphModule

_KINDS: dict[InputKind, ConstantKind] = {
    InputKind.PARAMETER: "parameter",
    InputKind.BUFFER: "buffer",
    InputKind.CONSTANT_TENSOR: "constant",
}


def _arg(value: Any) -> Arg:
    if isinstance(value, torch.fx.Node):
        return NodeRef(value.name)
    if isinstance(value, (list, tuple)):
        return tuple(_arg(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return DTypeArg(dtype_name(value))
    return Opaque(repr(value))


def _dim(d: Any) -> int | str:
    return int(d) if isinstance(d, int) else str(d)


def tensor_spec(value: Any) -> TensorSpec | None:
    """Spec of a (fake) tensor, or None for anything else."""
    if not isinstance(value, torch.Tensor):
        return None
    return TensorSpec(shape=tuple(_dim(d) for d in value.shape), dtype=dtype_name(value.dtype))


def _spec(value: Any) -> Spec:
    if isinstance(value, (list, tuple)):
        return tuple(tensor_spec(v) for v in value)
    return tensor_spec(value)


def _storage(t: torch.Tensor) -> str:
    return f"{t.untyped_storage().data_ptr():x}"


@dataclass
class Captured:
    """A program with its snapshot and the live objects behind it (adapter-internal)."""

    program: Program
    gm: torch.fx.GraphModule
    snap: GraphSnapshot
    tensors: dict[str, torch.Tensor]
    specs: dict[str, InputSpec]


def _tensor_of(ep: ExportedProgram, spec: InputSpec) -> torch.Tensor | None:
    target = spec.target
    if target is None:
        return None
    t = ep.state_dict.get(target)
    if t is None:
        t = ep.constants.get(target)
    return t if isinstance(t, torch.Tensor) else None


def _attr(gm: torch.nn.Module, path: str) -> Any:
    obj: Any = gm
    for atom in path.split("."):
        obj = getattr(obj, atom, None)
    return obj


def capture_program(program: Program) -> Captured:
    """Snapshot a program and keep the live tensors and input specs beside it."""
    ep = program if isinstance(program, ExportedProgram) else None
    gm = program.graph_module if isinstance(program, ExportedProgram) else program
    if not isinstance(gm, torch.fx.GraphModule):
        raise TypeError(f"expected an ExportedProgram or a torch.fx.GraphModule, got {type(program).__name__}")
    specs = {s.arg.name: s for s in ep.graph_signature.input_specs if hasattr(s.arg, "name")} if ep else {}
    nodes: list[NodeSnapshot] = []
    constants: dict[str, ConstantInfo] = {}
    tensors: dict[str, torch.Tensor] = {}
    edge = False
    for n in gm.graph.nodes:
        tensor: torch.Tensor | None = None
        kind: ConstantKind = "parameter"
        key = str(n.target)
        if n.op == "call_function":
            edge = edge or is_edge(n.target)
            target = target_name(n.target)
        else:
            target = key
        if n.op == "placeholder" and n.name in specs and specs[n.name].kind in _KINDS and ep is not None:
            tensor, kind, key = _tensor_of(ep, specs[n.name]), _KINDS[specs[n.name].kind], specs[n.name].target or key
        elif n.op == "get_attr":
            value = _attr(gm, key)
            if isinstance(value, torch.Tensor):
                tensor, kind = value, "parameter" if isinstance(value, torch.nn.Parameter) else "buffer"
        if tensor is not None:
            spec = tensor_spec(tensor)
            assert spec is not None
            constants[n.name] = ConstantInfo(kind=kind, key=key, spec=spec, storage=_storage(tensor))
            tensors[n.name] = tensor
        nodes.append(
            NodeSnapshot(
                name=n.name,
                op=n.op,
                target=target,
                args=tuple(_arg(a) for a in n.args),
                kwargs=pmap({k: _arg(v) for k, v in n.kwargs.items()}),
                spec=_spec(n.meta.get("val")),
            )
        )
    snap = snapshot(nodes, constants, dialect="edge" if edge else "aten", lifted=ep is not None)
    return Captured(program=program, gm=gm, snap=snap, tensors=tensors, specs=specs)


def capture(program: Program) -> GraphSnapshot:
    """The immutable snapshot of a GraphModule or ExportedProgram; O(nodes)."""
    return capture_program(program).snap

"""The FX floor of a rewrite: what any implementation that leaves a runnable program must spend.

``prepare(program, rules)`` plans off the clock (with fxpure: the floor is about applying, not
finding) and resolves every new node's op, literal arguments and meta (its fake value). The
function it returns then does only the unavoidable work, in place, with no checks and no undo:
compute the new weights, create the new nodes, move the uses, erase the old nodes, register the new
constants (state dict and signature, or module attributes) and drop the dead ones, and one
``recompile()`` of the final graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec, TensorArgument

from adapters.realize import _bind, _literal, _prepare
from adapters.snap import Program, capture_program
from adapters.torchnames import resolve_target
from adapters.weights import materialize
from fxpure import plan
from fxpure.plan import Rule


def prepare(program: Program, rules: list[Rule]) -> Callable[[], int]:
    """Plan ``rules`` on ``program``; return the floor's in-place replay (it returns the plans applied)."""
    cap = capture_program(program)
    report = plan(cap.snap, rules)
    before, after, gm = cap.snap, report.after, cap.gm
    graph = gm.graph
    ep = program if isinstance(program, ExportedProgram) else None
    sources = {name: info.source for name, info in after.constants.items() if info.source is not None}
    kinds = {name: after.constants[name].kind for name in sources}
    new: list[tuple[str, Any, list[Any], dict[str, Any], str]] = []  # name, target, args, kwargs, next
    nxt = ""
    for rec in reversed(after.nodes):
        if rec.name in before.index:
            nxt = rec.name
        elif rec.name in sources:
            new.append((rec.name, None, [], {}, nxt))
        else:
            target = resolve_target(rec.target, after.dialect)
            args = [_literal(a) for a in rec.args]
            new.append((rec.name, target, args, {k: _literal(v) for k, v in rec.kwargs.items()}, nxt))
    new.reverse()
    changed = [
        (rec.name, [_literal(a) for a in rec.args], {k: _literal(v) for k, v in rec.kwargs.items()})
        for rec in after.nodes
        if rec.name in before.index and before.node(rec.name) is not rec
    ]
    erased = [n.name for n in before.nodes if n.name not in after.index]
    # each new node's meta (its fake value, provenance): needed by a valid program, made off the clock
    metas = {new.rec.name: new.meta for new in _prepare(cap, after, dict.fromkeys(sources)).new}  # type: ignore[arg-type]
    dead = {name: before.constants[name].key for name in erased if name in before.constants}

    def run() -> int:
        memo: dict[object, torch.Tensor] = {}
        tensors = {name: materialize(src, cap.tensors, memo) for name, src in sources.items()}
        for name, t in tensors.items():
            if kinds[name] == "parameter":
                tensors[name] = torch.nn.Parameter(t, requires_grad=False)
        if ep is None:
            for name, t in tensors.items():
                setattr(gm, name, t)
        env = {n.name: n for n in graph.nodes}
        for name, target, args, kwargs, at in new:
            with graph.inserting_before(env[at]):
                if target is None:
                    node = graph.placeholder(name) if ep is not None else graph.get_attr(name)
                else:
                    node = graph.create_node("call_function", target, _bind(tuple(args), env), _bind(kwargs, env), name)
            node.meta.update(metas[name])
            env[name] = node
        for name, args, kwargs in changed:
            node = env[name]
            node.args, node.kwargs = _bind(tuple(args), env), _bind(kwargs, env)
        for name in reversed(erased):
            graph.erase_node(env[name])
        if ep is not None:
            for key in dead.values():
                ep.state_dict.pop(key, None)
                ep.constants.pop(key, None)
            for name, t in tensors.items():
                (ep.constants if kinds[name] == "constant" else ep.state_dict)[name] = t
            specs = {s.arg.name: s for s in ep.graph_signature.input_specs if isinstance(s.arg, TensorArgument)}
            fresh = {
                name: InputSpec(_KIND[k], TensorArgument(name=name), name, persistent=True if k == "buffer" else None)
                for name, k in kinds.items()
            }
            ep.graph_signature.input_specs[:] = [
                specs.get(n.name) or fresh[n.name] for n in graph.find_nodes(op="placeholder")
            ]
            outputs = graph.output_node().args[0]
            assert isinstance(outputs, (list, tuple))
            for spec, value in zip(ep.graph_signature.output_specs, outputs, strict=True):
                if isinstance(spec.arg, TensorArgument) and isinstance(value, torch.fx.Node):
                    spec.arg = TensorArgument(name=value.name)
        else:
            for key in dead.values():
                owner, _, leaf = key.rpartition(".")
                delattr(gm.get_submodule(owner), leaf)
        gm.recompile()
        return len(report.plans)

    return run


_KIND = {"parameter": InputKind.PARAMETER, "buffer": InputKind.BUFFER, "constant": InputKind.CONSTANT_TENSOR}

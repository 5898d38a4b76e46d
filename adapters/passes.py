"""Pass objects for lowering pipelines: any fxpure rules as one pass, needing no program up front.

A ``RulesPass`` is an ExecuTorch ``ExportedProgramPassBase``: ``EdgeProgramManager.transform``,
``to_edge_transform_and_lower(transform_passes=...)`` and ``ExportedProgramPassManager`` hand it
the program (constants, state dict and signature included), so it works where the program does
not exist yet when the pass list is written. Called with a ``torch.fx.GraphModule`` it is a
torch.fx pass (returns a ``PassResult``), as in a ``PassManager``.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import overload

import torch
from executorch.exir.pass_base import ExportedProgramPassBase, ExportedProgramPassResult
from returns.result import Failure, Result
from torch.export import ExportedProgram
from torch.fx.passes.infra.pass_base import PassResult

from adapters.realize import TransformError, TransformOutcome, apply, transform
from fxpure.plan import RewriteReport, Rule, check_rules
from fxpure.rules import fuse_conv_bn, quantized_conv, split_group_conv
from fxpure.serial import JSON, to_data


class FxpureError(RuntimeError):
    """A pass could not apply its plans; the program was left unchanged. ``error`` says why, typed
    (its ``code`` is ``TransformError``'s: ``unknown-op``, ``apply-failed``, ...). A pass manager
    (``EdgeProgramManager.transform``, ``to_edge_transform_and_lower``) raises its own ``Exception``
    instead, with this error as its ``__cause__``."""

    def __init__(self, error: TransformError) -> None:
        super().__init__(error)  # (its str, and what a pickle makes it again from)
        self.error = error


class RulesPass(ExportedProgramPassBase):
    """``rules`` applied as one pass, all or nothing; ``last`` holds the latest outcome (report
    included; None after a call that raised :class:`FxpureError`), ``outcomes`` every call's in
    order (a pass manager's second step, or a second method, finds nothing left: its empty report is
    then ``last``; each holds its snapshots: clear the list to reuse the object on many programs).
    ``exported_program`` is only needed to call it on that program's graph module."""

    def __init__(self, rules: Iterable[Rule], exported_program: ExportedProgram | None = None) -> None:
        self.rules = check_rules(rules)
        self.exported_program = exported_program
        self.last: TransformOutcome | None = None
        self.outcomes: list[TransformOutcome] = []

    @overload
    def __call__(self, program: ExportedProgram) -> ExportedProgramPassResult: ...

    @overload
    def __call__(self, program: torch.fx.GraphModule) -> PassResult: ...

    def __call__(self, program: ExportedProgram | torch.fx.GraphModule) -> ExportedProgramPassResult | PassResult:
        if isinstance(program, ExportedProgram):
            self.requires(program)
            result = self.call(program)
            self.ensures(program)
            return result
        return self.call_graph_module(program)

    def call(self, exported_program: ExportedProgram) -> ExportedProgramPassResult:
        """Plan on the program and, if there is something to rewrite, apply it to a copy (its own
        graph, signature, state dict and constants; the tensors shared, none written), returned; the
        program given is left as it was: ExecuTorch's pass managers hand a pass a shallow copy of the
        caller's program, whose graph module and dictionaries an edit in place would change under
        the caller (``edge`` of ``edge.transform([...])``, half of it: its graph, not its constants).

        A new constant's key ends in a digest of what computes it, each constant it reads named by
        its key (``t.conv2d_bn_weight_3f09c1a2b4d6``): ExecuTorch's external constant file keeps
        one tensor per key, and methods transformed apart (by this pass or another, before or
        after any other pass) must not give one key other values. The same computation of the same
        keys shares a key, stored once; and the keys do not change with the values, so a data file
        of retrained weights still fits the program (the report says the keys as the program does)."""
        planned = transform(exported_program, self.rules, dry_run=True)
        if isinstance(planned, Failure) or not planned.unwrap().report.plans:
            self._keep(planned)
            return ExportedProgramPassResult(exported_program, False)
        program, report = _copied(exported_program), planned.unwrap().report
        # (the report planned on the program: its rejections too, which applying does not repeat)
        done = apply(program, report).map(lambda o: replace(o, report=_named(exported_program, program, report)))
        self._keep(done)
        return ExportedProgramPassResult(program, True)

    def call_graph_module(self, graph_module: torch.fx.GraphModule) -> PassResult:
        """As a torch.fx pass; the constructor's program, if this is its graph module, follows."""
        ep = self.exported_program
        return PassResult(
            graph_module, self._run(ep if ep is not None and ep.graph_module is graph_module else graph_module)
        )

    def _run(self, program: ExportedProgram | torch.fx.GraphModule) -> bool:
        return self._keep(transform(program, self.rules))

    def _keep(self, result: Result[TransformOutcome, TransformError]) -> bool:
        if isinstance(result, Failure):
            self.last = None  # (not the outcome of an earlier call: this one has none)
            raise FxpureError(result.failure())
        self.last = result.unwrap()
        self.outcomes.append(self.last)
        return self.last.changed


def _named(before: ExportedProgram, after: ExportedProgram, report: RewriteReport) -> RewriteReport:
    """Each constant ``after`` holds under a key ``before`` has not goes under that key and a digest
    of its expression, each constant it reads by its key in ``before`` (numbered after that if
    ``after`` holds such a key already); ``report`` with its snapshot after saying so."""
    keys = {s.arg.name: s.target for s in before.graph_signature.input_specs if s.target is not None}
    old = before.state_dict.keys() | before.constants.keys()
    node = {s.target: s.arg.name for s in after.graph_signature.input_specs if s.target not in old}
    held = set(after.state_dict) | set(after.constants)
    renamed: dict[str, str] = {}
    for d in (after.state_dict, after.constants):
        for key in [k for k in d if k not in old]:
            expr = report.after.constants[node[key]].source
            text = json.dumps(_over_keys(to_data(expr), keys), sort_keys=True)
            name = new = f"{key}_{hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()[:12]}"
            n = 0
            while new in held:
                n += 1
                new = f"{name}_{n}"
            d[new] = d.pop(key)
            held.add(new)
            renamed[key] = new
    specs = after.graph_signature.input_specs
    specs[:] = [replace(s, target=renamed[s.target]) if s.target in renamed else s for s in specs]
    infos = report.after.constants
    constants = infos.update({node[k]: replace(infos[node[k]], key=new) for k, new in renamed.items()})
    return replace(report, after=replace(report.after, constants=constants))


def _over_keys(data: JSON, keys: Mapping[str, str]) -> JSON:
    """``data`` of an expression with each constant it reads named by its key in the program."""
    if isinstance(data, list):
        return [_over_keys(v, keys) for v in data]
    if not isinstance(data, dict):
        return data
    out = {k: _over_keys(v, keys) for k, v in data.items()}
    if out.get("type") == "Source" and isinstance(name := out.get("key"), str):
        out["key"] = keys.get(name, name)
    return out


def _copied(ep: ExportedProgram) -> ExportedProgram:
    gm = copy.deepcopy(ep.graph_module)  # (the nodes' metadata is copied shallowly: fake values shared)
    # a copied graph names its nodes anew, and a name torch.fx keeps for builtins (an input named
    # ``input``, as nn.Sequential's) comes back as ``input_1``: the signature names the original's
    renamed = False
    for old, new in zip(ep.graph.nodes, gm.graph.nodes, strict=True):
        if new.name != old.name:
            new.name, renamed = old.name, True
    if renamed:
        gm.recompile()
    return ExportedProgram(
        root=gm,
        graph=gm.graph,
        graph_signature=copy.deepcopy(ep.graph_signature),
        state_dict=dict(ep.state_dict),
        range_constraints=ep.range_constraints,
        module_call_graph=copy.deepcopy(ep.module_call_graph),
        example_inputs=ep.example_inputs,
        constants=dict(ep.constants),
        verifiers=ep.verifiers,
    )


class FuseConvBatchNormPass(RulesPass):
    """Drop-in for ``FuseBatchNormWithConvPass(exported_program)``; the program is optional."""

    def __init__(self, exported_program: ExportedProgram | None = None) -> None:
        super().__init__([fuse_conv_bn()], exported_program)


class SplitGroupConvolutionPass(RulesPass):
    """Drop-in for NXP's ``SplitGroupConvolution()`` (a torch.fx pass over a GraphModule)."""

    def __init__(self, min_groups: int = 2, max_groups: int = 10) -> None:
        super().__init__([split_group_conv(min_groups, max_groups)])


class QuantizedConvolutionPass(RulesPass):
    """Vulkan q8ta packing of a PT2E-quantized edge program; ``fallback`` as in ``quantized_conv``."""

    def __init__(
        self, exported_program: ExportedProgram | None = None, align: int = 4, fallback: str = "dequantize"
    ) -> None:
        super().__init__([quantized_conv(align, fallback)], exported_program)

"""Drop-in pass objects for existing pipelines (EdgeProgramManager.transform, fx PassManager)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from returns.result import Failure
from torch.export import ExportedProgram
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from adapters.realize import TransformOutcome, transform
from fxpure.plan import Rule
from fxpure.rules import fuse_conv_bn, quantized_conv, split_group_conv


class FxpureError(RuntimeError):
    """A pass could not apply its plans; the graph was left unchanged."""


class _RulePass(PassBase):
    """Runs fxpure rules on the graph module it is called with."""

    def __init__(self, rules: Sequence[Rule], exported_program: ExportedProgram | None = None) -> None:
        super().__init__()
        self.rules = tuple(rules)
        self.exported_program = exported_program
        self.last: TransformOutcome | None = None

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        """Transform in place; the owning ExportedProgram's state and signature follow."""
        ep = self.exported_program
        program = ep if ep is not None and ep.graph_module is graph_module else graph_module
        result = transform(program, self.rules)
        if isinstance(result, Failure):
            raise FxpureError(str(result.failure()))
        self.last = result.unwrap()
        return PassResult(graph_module, self.last.changed)


class FuseConvBatchNormPass(_RulePass):
    """Drop-in for ``FuseBatchNormWithConvPass(exported_program)``; also takes an unlifted GraphModule."""

    def __init__(self, exported_program: ExportedProgram | None = None) -> None:
        super().__init__([fuse_conv_bn()], exported_program)


class SplitGroupConvolutionPass(_RulePass):
    """Drop-in for NXP's ``SplitGroupConvolution()``: a torch.fx pass over a GraphModule."""

    def __init__(self, min_groups: int = 2, max_groups: int = 10) -> None:
        super().__init__([split_group_conv(min_groups, max_groups)])


class QuantizedConvolutionPass(_RulePass):
    """The quantized-conv rule for Vulkan: an edge program after PT2E quantization, packed for q8ta."""

    def __init__(self, exported_program: ExportedProgram, align: int = 4) -> None:
        super().__init__([quantized_conv(align)], exported_program)

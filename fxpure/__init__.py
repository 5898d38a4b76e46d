"""fxpure: pure graph analysis and rewrite planning for torch.fx graphs (no torch here)."""

from fxpure import rules
from fxpure.plan import (
    NewConstant,
    NewNode,
    Rejection,
    RewritePlan,
    RewriteReport,
    Rule,
    constant_expr,
    constant_operand,
    plan,
    rewrite,
)
from fxpure.reasons import PlanConflict, Reason
from fxpure.snapshot import (
    ConstantInfo,
    DTypeArg,
    GraphSnapshot,
    NodeRef,
    NodeSnapshot,
    Opaque,
    TensorSpec,
    snapshot,
    verify,
)
from fxpure.views import BatchNormView, ConvView, batch_norm_view, conv_view

__all__ = [
    "BatchNormView",
    "ConstantInfo",
    "ConvView",
    "DTypeArg",
    "GraphSnapshot",
    "NewConstant",
    "NewNode",
    "NodeRef",
    "NodeSnapshot",
    "Opaque",
    "PlanConflict",
    "Reason",
    "Rejection",
    "RewritePlan",
    "RewriteReport",
    "Rule",
    "TensorSpec",
    "batch_norm_view",
    "constant_expr",
    "constant_operand",
    "conv_view",
    "plan",
    "rewrite",
    "rules",
    "snapshot",
    "verify",
]

"""An outside author's rule, written with the public kit only: constant folding, as ExecuTorch's
``constant_prop_pass`` (``exir/passes/constant_prop_pass.py``) does it for the arithmetic fxpure's
weight expressions cover.

A node the program computes from constants alone (``W.t()``, a layer scale's ``gamma[:, None, None]``,
a frozen batch norm's ``weight * (running_var + eps).rsqrt()``, a merged LoRA's ``W + B @ A``: what
``fxpure.plan.constant_expr`` recognises) becomes one new constant, where a node that computes from
something else reads it; the nodes that computed it go once nothing else reads them. The rule is
hand-written (the ``Rule`` protocol: ``name``, ``anchors``, ``plan_at``), as its anchor is any node,
not an op of one family.

Where it differs from upstream: a value the program returns stays computed (declined
``returns-constant``): folded, ``ep.module()`` would return the constant itself, which a caller
writing into its output would change for every later call (upstream's pass broke the output
spec there until PR 11209, and now inserts a clone). A new constant's name and state-dict key
never take one the program has (upstream redefined its ``_prop_tensor_constant`` names until PR
7301). The adapter computes every new constant before it changes anything, so a fold torch fails
on leaves the program as it was. Narrower: it folds only what the weight expressions compute
(upstream runs any op), so a computation of another op stays. Tested in
``tests/test_fold_constants.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from returns.result import Failure, Result, Success

from fxpure.plan import NewConstant, RewritePlan, computed_by, constant_expr
from fxpure.reasons import Declined, Reason
from fxpure.snapshot import GraphSnapshot, NodeSnapshot
from fxpure.weights import Source

RETURNS = "returns-constant"


def _folds(snap: GraphSnapshot, node: NodeSnapshot) -> bool:
    """``node`` computes a constant (not merely holds one)."""
    return node.op == "call_function" and not isinstance(constant_expr(snap, node.name), Source | None)


@dataclass(frozen=True)
class FoldConstants:
    name: str = "fold-constants"
    codes: frozenset[str] = frozenset({RETURNS})

    def anchors(self, snap: GraphSnapshot) -> Iterator[NodeSnapshot]:
        """The last node of each constant computation: one some node that is not itself folded reads."""
        folds = {n.name for n in snap.nodes if _folds(snap, n)}
        for node in snap.nodes:  # (in graph order: the report's order is the program's)
            if node.name in folds and not all(u in folds for u in snap.users[node.name]):
                yield node

    def plan_at(self, snap: GraphSnapshot, node: NodeSnapshot) -> Result[RewritePlan, Reason]:
        expr = constant_expr(snap, node.name)
        assert expr is not None  # an anchor
        if any(u.op == "output" for u in snap.users_of(node.name)):
            detail = f"{node.name} is a value the program returns: it stays computed"
            return Failure(Declined(code=RETURNS, node=node.name, detail=detail))
        new = f"{node.name}_folded"
        inner = computed_by(snap, node.name)[1:]  # (the nodes before it: each goes once unread)
        return Success(
            RewritePlan(
                rule=self.name,
                anchor=node.name,
                constants=(NewConstant(name=new, expr=expr, kind="constant"),),
                replace=((node.name, new),),
                erase=(node.name,),
                prune=inner,
            )
        )


fold_constants = FoldConstants()

"""Every spelling fxpure ships a family for (``fxpure.families.STANDARD``) against torch's own
registry: the same parameters in the same order, each keyword-only, optional and defaulted as
torch declares it, and as many outputs. The schemas in ``fxpure.families`` are hand-copied text;
this is the check that the copy is faithful (a wrong name binds nothing, a wrong order binds the
wrong argument)."""

from __future__ import annotations

import executorch.exir  # noqa: F401  (registers the edge dialect's dim_order_ops)
import pytest
import torch
from returns.result import Success

from adapters.snap import capture
from fxpure.families import STANDARD
from fxpure.linear import MATRIX_T, MOVEDIM
from fxpure.schema import Schema
from tests.programs import build

# the standard families' spellings and the transposes fxpure.linear reads a weight through (getitem
# is Python's)
SPELLINGS = sorted(
    {t: s for f in (*STANDARD, MATRIX_T, MOVEDIM) for t, s in f.schemas.items() if t != "getitem"}.items()
)


def _torch_schema(target: str) -> torch.FunctionSchema:
    ns, op, overload = target.split(".")
    return getattr(getattr(getattr(torch.ops, ns), op), overload)._schema  # type: ignore[no-any-return]


@pytest.mark.parametrize(("target", "schema"), SPELLINGS, ids=[t for t, _ in SPELLINGS])
def test_a_spelling_has_torchs_parameters(target: str, schema: Schema) -> None:
    theirs = _torch_schema(target)
    ours = [(p.name, p.keyword_only, p.optional, p.has_default) for p in schema.params]
    expected = [
        (a.name, a.kwarg_only, isinstance(a.type, torch.OptionalType), a.has_default_value())
        for a in theirs.arguments
        if not a.is_out
    ]
    assert ours == expected
    assert schema.outputs == (len(theirs.returns) if len(theirs.returns) != 1 else 1)


def test_the_families_cover_the_dropout_clone_cast_and_expand_of_each_form() -> None:
    names = {f.name: f for f in STANDARD}
    assert {"dropout", "clone", "cast", "expand", "sigmoid"} <= set(names)
    copies = {"aten.clone.default", "aten.contiguous.default", "dim_order_ops._clone_dim_order.default"} | {
        f"aten.{op}{copy}.default" for op in ("detach", "alias") for copy in ("", "_copy")
    }
    assert names["clone"].targets == copies
    assert "dim_order_ops._to_dim_order_copy.default" in names["cast"].targets
    assert "self" in names["dropout"].params  # renamed from torch's ``input``, as the other no-ops name it


class Copies(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(x).clone().to(torch.float16).float()
        return torch.sigmoid(y[:, :1].expand(2, 3))


@pytest.mark.parametrize(
    ("form", "bound"),
    [
        ("gm", {"dropout", "clone", "cast", "expand", "sigmoid", "slice"}),
        ("aten", {"dropout", "clone", "cast", "expand", "sigmoid", "slice"}),
        # to_edge drops the eval dropout and spells the copies by dim order
        ("edge", {"clone", "cast", "expand", "sigmoid", "slice"}),
    ],
)
def test_the_families_bind_the_nodes_a_real_program_holds(form: str, bound: set[str]) -> None:
    program = build(Copies().eval(), (torch.randn(2, 3),), form)
    snap = capture(program)
    calls = [n for n in snap.nodes if n.op == "call_function"]
    got = {f.name for f in STANDARD for n in calls if isinstance(f.bind(snap, n), Success)}
    assert got == bound

"""Every spelling fxpure ships a family for (``fxpure.families.STANDARD``) against torch's own
registry: the same parameters in the same order, each keyword-only, optional and defaulted as
torch declares it, and as many outputs. The schemas in ``fxpure.families`` are hand-copied text;
this is the check that the copy is faithful (a wrong name binds nothing, a wrong order binds the
wrong argument)."""

from __future__ import annotations

import re
from pathlib import Path

import executorch.exir  # noqa: F401  (registers the edge dialect's dim_order_ops)
import pytest
import torch
from returns.result import Success

from adapters.snap import capture
from fxpure.families import STANDARD
from fxpure.linear import MATRIX_T, MOVEDIM
from fxpure.schema import SCALAR_TYPES, Schema, parse_schema
from fxpure.snapshot import DTypeArg
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


def test_scalar_type_numbers_are_c10s() -> None:
    # the table a ScalarType default's number is read by, against the enum torch was built with
    # (its installed header): each name torch's (c10 calls a few otherwise: Char is int8)
    header = Path(torch.__file__).parent / "include" / "torch" / "headeronly" / "core" / "ScalarType.h"
    entries = re.findall(r"_\([^,]+,\s*(\w+)\)\s*/\* (\d+) \*/", header.read_text())
    assert [int(i) for _, i in entries] == list(range(len(SCALAR_TYPES)))
    assert [_C10_NAMES.get(c10, c10.lower()) for c10, _ in entries] == list(SCALAR_TYPES)
    assert all(isinstance(getattr(torch, name), torch.dtype) for name in SCALAR_TYPES)


_C10_NAMES = {
    **{"Byte": "uint8", "Char": "int8", "Short": "int16", "Int": "int32", "Long": "int64"},
    **{"Half": "float16", "Float": "float32", "Double": "float64"},
    **{"ComplexHalf": "complex32", "ComplexFloat": "complex64", "ComplexDouble": "complex128"},
}


def test_torchaos_dequantize_affine_defaults_to_float32() -> None:
    import torchao  # noqa: F401  (registers torchao's ops)

    text = str(torch.ops.torchao.dequantize_affine.default._schema).replace("::", ".", 1)
    head, _, rest = text.partition("(")
    schema = parse_schema(f"{head}.default({rest}")
    out = schema.param("output_dtype")
    assert out is not None and out.default == DTypeArg("float32")

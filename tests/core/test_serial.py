"""to_data: the exact JSON-ready form of scalars, sequences, mappings, records, reasons,
functions and anything else (by repr)."""

from __future__ import annotations

import enum
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import pytest
from pyrsistent import pmap
from returns.result import Result, Success

from fxpure import NodeRef, NodeSnapshot
from fxpure.families import family
from fxpure.reasons import Malformed, Reason
from fxpure.schema import parse_schema
from fxpure.serial import JSON, to_data
from fxpure.snapshot import Arg, GraphSnapshot, Opaque, TensorSpec
from fxpure.testing import GraphBuilder


class Colour(enum.Enum):
    RED = 1


@dataclass(frozen=True, kw_only=True)
class FixedCode(Reason):
    """A backend's own reason whose code is fixed (not an ``__init__`` argument)."""

    code: str = field(default="my-code", init=False)


def keep(snap: GraphSnapshot, node: NodeSnapshot, args: Mapping[str, Arg]) -> Result[Mapping[str, Arg], Malformed]:
    """A normaliser to name."""
    return Success(args)


@pytest.mark.parametrize("value", [None, True, False, 0, 3, -2.5, "", "s0"])
def test_scalars_are_themselves(value: JSON) -> None:
    got = to_data(value)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize(
    ("value", "want"),
    [
        ((1, (2, "a"), [None, 2.0]), [1, [2, "a"], [None, 2.0]]),
        ((), []),
        ({"a": (1, 2), 3: None, None: "n"}, {"a": [1, 2], "3": None, "None": "n"}),
        (MappingProxyType({"k": {"x": (True,)}}), {"k": {"x": [True]}}),
        (pmap({"p": 1, "q": "v"}), {"p": 1, "q": "v"}),
    ],
)
def test_sequences_become_lists_and_mappings_dicts_with_string_keys(value: object, want: JSON) -> None:
    assert to_data(value) == want


def test_records_are_tagged_and_nested() -> None:
    node = NodeSnapshot(
        name="c",
        op="call_function",
        target="t",
        args=(NodeRef("x"), (1, 2), Opaque("cpu")),
        kwargs=pmap({"k": NodeRef("y")}),
        spec=(TensorSpec(shape=(2, "s0"), dtype="int8"), None),
    )
    assert to_data(node) == {
        "type": "NodeSnapshot",
        "name": "c",
        "op": "call_function",
        "target": "t",
        "args": [{"type": "NodeRef", "name": "x"}, [1, 2], {"type": "Opaque", "text": "cpu"}],
        "kwargs": {"k": {"type": "NodeRef", "name": "y"}},
        "spec": [{"type": "TensorSpec", "shape": [2, "s0"], "dtype": "int8"}, None],
        "provenance": None,
        "source_fn": None,
    }


def test_derived_fields_are_left_out() -> None:
    schema = parse_schema("aten.relu.default(Tensor self, *, int n=2) -> (Tensor, Tensor)", fixed={"k": 1})
    assert to_data(schema) == {
        "type": "Schema",
        "target": "aten.relu.default",
        "params": [
            {
                "type": "Param",
                "name": "self",
                "kind": "tensor",
                "optional": False,
                "keyword_only": False,
                "has_default": False,
                "default": None,
            },
            {
                "type": "Param",
                "name": "n",
                "kind": "int",
                "optional": False,
                "keyword_only": True,
                "has_default": True,
                "default": 2,
            },
        ],
        "outputs": 2,
        "fixed": {"k": 1},
        "rename": {},
    }


def test_reasons_carry_code_and_message() -> None:
    assert to_data(Malformed(node="n", detail="bad", path="a/b")) == {
        "type": "Malformed",
        "code": "malformed-node",
        "node": "n",
        "path": "a/b",
        "detail": "bad",
        "message": "n: bad",
    }
    # a code that is not an __init__ argument is still carried
    assert to_data(FixedCode(node="m")) == {
        "type": "FixedCode",
        "node": "m",
        "path": "",
        "code": "my-code",
        "message": "m: my-code",
    }


def test_functions_and_classes_are_named() -> None:
    mm = family("mm", "a product", ["aten.mm.default(Tensor self, Tensor mat2) -> Tensor"], normalize=keep)
    data = to_data(mm)
    assert isinstance(data, dict) and data["normalize"] == f"{__name__}.keep"
    assert to_data(parse_schema) == "fxpure.schema.parse_schema"
    assert to_data(GraphBuilder.build) == "fxpure.testing.GraphBuilder.build"
    assert to_data(TensorSpec) == "fxpure.snapshot.TensorSpec"
    assert to_data(Colour) == f"{__name__}.Colour"
    # a builtin method has no module: its qualified name alone
    assert to_data(str.upper) == ".str.upper"


@pytest.mark.parametrize(
    ("value", "want"),
    [
        (Colour.RED, "<Colour.RED: 1>"),
        (functools.partial(int, base=2), "functools.partial(<class 'int'>, base=2)"),
        (frozenset(), "frozenset()"),
    ],
)
def test_anything_else_is_its_repr(value: object, want: str) -> None:
    assert to_data(value) == want


def test_output_is_json() -> None:
    arg: Arg = (NodeRef("x"), 1.5, None)
    value = {"plan": [Malformed(node="n", detail="bad")], "arg": arg, "f": keep}
    data = to_data(value)
    assert json.loads(json.dumps(data)) == data

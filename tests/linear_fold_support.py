"""Helpers shared by the fuse_linear_bn and fold_binary integration tests: stand-ins that let the
upstream NXP and Arm passes import here, and a check that new nodes keep symbolic sizes."""

from __future__ import annotations

import sys
import types
from typing import Any

import torch
from torch.export import ExportedProgram

from fxpure import RewriteReport
from tests.programs import Program


def nxp_stand_in() -> None:
    """NXP's passes import the proprietary eIQ Neutron SDK, not installable here: an empty module
    with the two submodules it imports satisfies them (the passes tested never call it)."""
    if "eiq_neutron_sdk" not in sys.modules:
        sdk = types.ModuleType("eiq_neutron_sdk")
        for sub in ("neutron_converter", "neutron_library_utils"):
            setattr(sdk, sub, types.ModuleType(f"eiq_neutron_sdk.{sub}"))
        sys.modules["eiq_neutron_sdk"] = sdk


class _StandIn(types.ModuleType):
    """A module whose every attribute is another stand-in (callable, usable as a base class)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _StandIn(f"{self.__name__}.{name}")
        setattr(self, name, sub)
        return sub

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


def arm_stand_in() -> None:
    """Arm's passes import the TOSA serializer, not installed here: a stand-in module answering every
    attribute satisfies the import (FoldScalarMulIntoConvPass never calls it)."""
    sys.modules.setdefault("tosa_serializer", _StandIn("tosa_serializer"))


def assert_symbolic(program: Program, report: RewriteReport) -> None:
    """Every new node computed from the (one) input keeps its symbolic batch size."""
    gm = program.graph_module if isinstance(program, ExportedProgram) else program
    added = set(report.after.index) - set(report.before.index)
    (x_node,) = (n for n in gm.graph.nodes if n.op == "placeholder" and n.name in report.after.inputs)
    flows: set[str] = set()
    todo = [x_node]
    while todo:  # the nodes computed from the input
        users = list(todo.pop().users)
        flows.update(u.name for u in users)
        todo.extend(users)
    new = [n for n in gm.graph.nodes if n.name in added and n.name in flows]
    assert len(new) >= 3, sorted(added)
    for n in new:
        val = n.meta["val"]
        assert isinstance(val, torch.Tensor) and not isinstance(val.shape[0], int), n.name

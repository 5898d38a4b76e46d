"""The benchmark's floor is a real rewrite: it leaves a runnable program that computes what the model
does, with the same nodes fxpure leaves and no dead constant (a floor that skipped work would flatter
nothing but itself)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

import adapters
from benchmarks import models
from benchmarks.floor import prepare
from fxpure.rules import RULES
from tests.models import randomize_bn
from tests.programs import Program, assert_sound, run

CASES: dict[str, tuple[Callable[[], torch.nn.Module], tuple[int, ...]]] = {
    "fuse-conv-bn": (lambda: randomize_bn(models.Repeat(3, lambda: models.conv_bn(4))), (1, 4, 8, 8)),
    "split-group-conv": (lambda: models.Repeat(2, lambda: models.grouped(8)), (1, 8, 8, 8)),
    "concat-parallel-linears": (lambda: models.Repeat(2, lambda: models.QKV(8)), (2, 8)),
}


def _targets(program: Program) -> list[str]:
    gm = program.graph_module if isinstance(program, torch.export.ExportedProgram) else program
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("form", ["gm", "edge"])
@pytest.mark.parametrize("rule", sorted(CASES))
def test_the_floor_leaves_the_program_fxpure_leaves(rule: str, form: str) -> None:
    make, shape = CASES[rule]
    torch.manual_seed(0)
    model, x = make().eval(), (torch.randn(shape),)
    with torch.no_grad():
        want = [model(*x)]
    ep = models.export(model, x[0])
    original: Program = ep.module() if form == "gm" else models.edge(model, x[0]).exported_program()
    floor, ours = copy.deepcopy(original), copy.deepcopy(original)
    assert prepare(floor, [RULES[rule]()])() > 0
    assert len(adapters.transform(ours, [RULES[rule]()]).unwrap().report.plans) > 0
    assert_sound(floor, x, want)
    assert _targets(floor) == _targets(ours)
    assert [t.shape for t in run(floor, x)] == [t.shape for t in run(ours, x)]

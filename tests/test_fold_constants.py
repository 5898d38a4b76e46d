"""The outside author's ``fold-constants`` rule (``tests/fold_constants.py``): torch-free, the plan at
the last node of each constant computation and its numbers; on exported programs in every form,
the program computes what the model did with the computations gone and no weight left unread, as
ExecuTorch's ``constant_prop_pass`` leaves an edge program; a returned constant stays computed; the
edge program lowers and runs."""

from __future__ import annotations

import pytest
import torch
from executorch.exir import to_edge
from executorch.exir.passes.constant_prop_pass import constant_prop_pass
from torch import nn
from torch.export import ExportedProgram

import adapters
from adapters.passes import RulesPass
from fxpure import plan
from fxpure.testing import GraphBuilder, evaluate
from tests.fold_constants import RETURNS, fold_constants
from tests.programs import FORMS, assert_close, assert_sound, build, count, run_pte


def test_the_last_node_of_a_constant_computation_is_planned_and_computes_its_value() -> None:
    g = GraphBuilder()
    x, w, s = g.input("x", (3, 2)), g.parameter("w", (4, 2)), g.buffer("s", (4,))
    t = g.call("aten.t.default", self=w, out=(2, 4))
    scaled = g.call("aten.mul.Tensor", name="scaled", self=t, other=s, out=(2, 4))  # (broadcast over rows)
    g.output(g.call("aten.mm.default", self=x, mat2=scaled, out=(3, 4)))
    report = plan(g.build(), [fold_constants])
    (p,) = report.plans
    assert (p.anchor, p.erase, p.prune, report.rejections) == ("scaled", ("scaled",), ("t",), ())
    (c,) = p.constants
    w_values, s_values = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]], [1.0, 10.0, 100.0, 0.5]
    want = [[w_values[j][i] * s_values[j] for j in range(4)] for i in range(2)]  # W.T scaled per column
    assert evaluate(c.expr, {"w": w_values, "s": s_values}).unwrap() == want


def test_a_computation_of_an_activation_or_a_lone_constant_is_no_candidate() -> None:
    g = GraphBuilder()
    x, w = g.input("x", (2,)), g.parameter("w", (2,))
    y = g.call("aten.mul.Tensor", self=x, other=w, out=(2,))  # reads an input
    g.output(g.call("aten.relu.default", self=y, out=(2,)))
    report = plan(g.build(), [fold_constants])
    assert report.plans == () and report.rejections == ()


def test_a_constant_the_program_returns_stays_computed() -> None:
    g = GraphBuilder()
    x, w = g.input("x", (2, 2)), g.parameter("w", (2, 2))
    t = g.call("aten.t.default", self=w, out=(2, 2))
    g.output(g.call("aten.mm.default", self=x, mat2=t, out=(2, 2)), t)
    report = plan(g.build(), [fold_constants])
    (no,) = report.rejections
    assert report.plans == () and (no.node, no.reason.code) == ("t", RETURNS)


class Frozen(nn.Module):
    """Weights the model computes from its parameters and buffers in ``forward``: a merged LoRA's
    ``W + A @ B``, its transpose, a frozen batch norm's scale, a layer scale broadcast."""

    var: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(8, 4, generator=g))
        self.a, self.b = nn.Parameter(torch.randn(8, 2, generator=g)), nn.Parameter(torch.randn(2, 4, generator=g))
        self.gamma = nn.Parameter(torch.randn(8, generator=g))
        self.register_buffer("var", torch.rand(8, generator=g) + 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ (self.w + self.a @ self.b).t()
        return torch.relu(y * (self.gamma * (self.var + 1e-5).rsqrt()) + self.gamma[None, :])


X = (torch.randn(3, 4, generator=torch.Generator().manual_seed(1)),)


@pytest.mark.parametrize("form", FORMS)
def test_the_program_computes_what_the_model_did_with_its_constant_computations_folded(form: str) -> None:
    model = Frozen().eval()
    with torch.no_grad():
        want = [model(*X)]
    program = build(model, X, form)
    outcome = adapters.transform(program, [fold_constants]).unwrap()
    assert len(outcome.report.plans) == 3 and not outcome.report.rejections
    # what is left computes from the input (the product, the scale, the shift and the relu): nothing to fold
    assert count(program, "rsqrt") == 0 and not plan(adapters.capture(program), [fold_constants]).plans
    assert_sound(program, X, want)  # within 1e-5 of the model, no constant left unread, validates


def test_an_edge_program_is_left_as_constant_prop_pass_leaves_it_and_lowers() -> None:
    model = Frozen().eval()
    rules = RulesPass([fold_constants])
    edge = to_edge(torch.export.export(model, X)).transform([rules])
    assert rules.last is not None and len(rules.last.report.plans) == 3
    program, theirs = (
        edge.exported_program(),
        constant_prop_pass(to_edge(torch.export.export(model, X)).exported_program()),
    )

    def calls(p: ExportedProgram) -> list[str]:
        return [str(n.target) for n in p.graph.nodes if n.op == "call_function"]

    assert calls(program) == calls(theirs)
    assert sum(t.numel() for t in program.constants.values()) == sum(t.numel() for t in theirs.constants.values())
    assert not program.state_dict  # (every parameter was only read to compute a folded one)
    with torch.no_grad():
        want = [model(*X)]
    assert_close(run_pte(edge.to_executorch().buffer, X), want)


class Masked(nn.Module):
    """Attention-style masking with a mask computed in ``forward``: ``1 / keep`` is inf where
    ``keep`` is 0, and the softmax gives those columns nothing."""

    keep: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("keep", torch.tensor([1.0, 1.0, 0.0, 1.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x - torch.reciprocal(self.keep), dim=-1)


@pytest.mark.parametrize("form", FORMS)
def test_a_value_the_program_computes_is_folded_also_where_it_is_not_finite(form: str) -> None:
    """The adapter declines a new constant holding an inf a fold brings in (``non-finite-weight``);
    one that is the very value a node the plan removes computed reads what the program read there
    (it was declined, which kept every computed mask of -inf in the program)."""
    model, x = Masked().eval(), (torch.randn(2, 4),)
    with torch.no_grad():
        want = [model(*x)]
    program = build(model, x, form)
    outcome = adapters.transform(program, [fold_constants]).unwrap()
    assert len(outcome.report.plans) == 1 and not outcome.report.rejections
    assert count(program, "reciprocal") == 0
    assert_sound(program, x, want)

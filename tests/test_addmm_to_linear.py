"""The outside author's ``addmm-to-linear`` rule (``tests/addmm_to_linear.py``) on exported programs:
in every form it takes (the GraphModule, the aten program, the decomposed one, and an edge program
that takes ``aten.linear``) each addmm and mm of a transposed weight becomes a linear computing what
the model did, no dead constant is left; an identity permute, ``alpha=0``, a bias that is no vector
or one ``beta`` cannot scale are declined and the program untouched; an edge program without
``aten.linear`` is declined ``op-not-allowed``; the edge program lowers through XNNPACK and runs."""

from __future__ import annotations

import copy

import pytest
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import EdgeCompileConfig, to_edge, to_edge_transform_and_lower
from torch import nn
from torch.export import ExportedProgram

import adapters
from adapters.passes import RulesPass
from tests.addmm_to_linear import addmm_to_linear
from tests.programs import Program, assert_close, assert_sound, count, run, run_pte

LINEAR_OK = EdgeCompileConfig(_core_aten_ops_exception_list=[torch.ops.aten.linear.default])
FORMS = ("gm", "aten", "decomposed", "edge")


def _build(model: nn.Module, x: tuple[torch.Tensor, ...], form: str, config: EdgeCompileConfig = LINEAR_OK) -> Program:
    ep = torch.export.export(copy.deepcopy(model), x)
    if form == "gm":
        return ep.module()
    if form == "aten":
        return ep
    if form == "decomposed":
        decomposed: ExportedProgram = ep.run_decompositions()  # (untyped upstream)
        return decomposed
    return to_edge(ep, compile_config=config).exported_program()


def _products(program: Program) -> int:
    return count(program, "addmm") + count(program, "aten.mm")


def _p(g: torch.Generator, *shape: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape, generator=g))


class Products(nn.Module):
    """A linear (on a matrix and on a sequence), and addmm and mm of a weight's transpose spelled
    by hand: t, transpose with negative dims, a permute, a bias read through a view, beta and alpha."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.fc = nn.Linear(8, 6)
        self.w, self.b, self.b_row = _p(g, 6, 8), _p(g, 6), _p(g, 1, 6)
        self.nan: torch.Tensor
        self.register_buffer("nan", torch.full((6,), float("nan")))  # (beta=0: addmm ignores it)

    def forward(self, x: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            self.fc(x),
            self.fc(s),  # (2, 3, 8): flattened around the product on edge
            torch.addmm(self.b, x, self.w.t(), beta=0.5, alpha=0.3),
            torch.addmm(self.b_row.view(6), x, self.w.permute(1, 0)),
            torch.mm(x, self.w.transpose(-1, 0)),
            torch.addmm(self.nan, x, self.w.t(), beta=0),
        )


def _x(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 8, generator=g).to(dtype), torch.randn(2, 3, 8, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("form", FORMS)
def test_every_addmm_and_mm_of_a_transposed_weight_becomes_a_linear(form: str, dtype: torch.dtype) -> None:
    model, x = Products().eval().to(dtype), _x(dtype)
    program = _build(model, x, form)
    with torch.no_grad():
        want = list(model(*x))
    outcome = adapters.transform(program, [addmm_to_linear]).unwrap()
    # the four spelled by hand everywhere; the two nn.Linear too where export decomposed them
    assert len(outcome.report.plans) == (4 if form in ("gm", "aten") else 6)
    assert not outcome.report.rejections
    assert _products(program) == 0 and count(program, "linear") == 6
    assert sum(count(program, op) for op in ("permute", "transpose", "aten.t.", "aten.t_copy.")) == 0
    assert count(program, "view") == 0  # (fc(s) reads s, 3-D, as it is: the reshapes around it went)
    if dtype == torch.float32:  # within 1e-5 of the model, no dead constant, validates
        assert_sound(program, x, want)
    else:  # (alpha and beta folded into float16 weights round once more than torch's addmm)
        assert_close(run(program, x), want, rel=2e-3)
    got = run(program, x)
    for i in (0, 1, 3, 4, 5):  # no scale folded: the same numbers as the model's
        assert_close([got[i]], [want[i]], rel=1e-6 if dtype == torch.float32 else 1e-3)


class Kept(nn.Module):
    """What must stay: an identity permute, alpha=0 (torch skips the product, a NaN in x stays out),
    a bias per row of the output, beta on a bias computed at run time, a weight that is an input."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w, self.sq, self.b, self.rows = _p(g, 6, 8), _p(g, 8, 8), _p(g, 6), _p(g, 4, 6)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            torch.mm(x, self.sq.permute(0, 1)),
            torch.addmm(self.b, x, self.w.t(), alpha=0),
            torch.addmm(self.rows, x, self.w.t()),
            torch.addmm(torch.relu(self.b), x, self.w.t(), beta=2.0),
            torch.mm(x, y.t()),
        )


@pytest.mark.parametrize("form", FORMS)
def test_what_is_no_linear_is_declined_saying_why_and_the_program_untouched(form: str) -> None:
    model, x = Kept().eval(), (torch.randn(4, 8), torch.randn(5, 8))
    x[0][0, 0] = float("nan")  # (alpha=0: torch's addmm leaves it out, a linear of 0 * W would not)
    program = _build(model, x, form)
    want = run(program, x)
    outcome = adapters.transform(program, [addmm_to_linear]).unwrap()
    assert not outcome.changed and not outcome.report.plans
    codes = sorted((j.reason.code, j.reason.path) for j in outcome.report.rejections)
    assert codes == [
        ("alpha-zero", "lin.alpha"),
        ("bias-not-scalable", "lin.self"),
        ("bias-not-vector", "lin.self"),
        ("not-a-transpose", "lin.mat2/lin_t"),
        ("not-constant", "lin.mat2/lin_t.self"),
    ]
    got = run(program, x)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
    assert not torch.isnan(got[1]).any()


class OwnFlatten(nn.Module):
    """A model's own reshapes around a linear: they stay, the linear reads the flattened input."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.fc(x.reshape(-1, 8)).reshape(-1, 2, 5)
        return y


@pytest.mark.parametrize("form", ["decomposed", "edge"])
def test_a_models_own_reshapes_around_the_product_stay(form: str) -> None:
    model, x = OwnFlatten().eval(), (torch.randn(2, 2, 8),)
    program = _build(model, x, form)
    with torch.no_grad():
        want = [model(*x)]
    outcome = adapters.transform(program, [addmm_to_linear]).unwrap()
    assert len(outcome.report.plans) == 1 and _products(program) == 0 and count(program, "linear") == 1
    assert count(program, "view") == 2
    assert_sound(program, x, want)


class Tied(nn.Module):
    """A weight's transpose another op reads too: the product becomes a linear, the transpose stays."""

    def __init__(self) -> None:
        super().__init__()
        self.w = _p(torch.Generator().manual_seed(0), 6, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.w.t()
        return torch.mm(x, t), t * 2


@pytest.mark.parametrize("form", FORMS)
def test_a_transpose_another_op_reads_stays_for_it(form: str) -> None:
    model, x = Tied().eval(), (torch.randn(4, 8),)
    program = _build(model, x, form)
    with torch.no_grad():
        want = list(model(*x))
    outcome = adapters.transform(program, [addmm_to_linear]).unwrap()
    assert len(outcome.report.plans) == 1 and _products(program) == 0 and count(program, "linear") == 1
    assert count(program, "permute") + count(program, "aten.t") == 1
    assert_sound(program, x, want)


def test_an_edge_program_that_takes_no_linear_declines_every_plan_and_stays() -> None:
    model, x = Products().eval(), _x()
    program = _build(model, x, "edge", EdgeCompileConfig())
    want = run(program, x)
    outcome = adapters.transform(program, [addmm_to_linear]).unwrap()
    assert not outcome.changed and not outcome.report.plans
    assert [j.reason.code for j in outcome.report.rejections] == ["op-not-allowed"] * 6
    assert count(program, "linear") == 0 and all(torch.equal(g, w) for g, w in zip(run(program, x), want, strict=True))


def test_the_edge_program_lowers_through_xnnpack_and_the_runtime_computes_the_same() -> None:
    model, x = Products().eval(), _x()
    with torch.no_grad():
        want = list(model(*x))
    rules = RulesPass([addmm_to_linear])
    edge = to_edge(torch.export.export(model, x), compile_config=LINEAR_OK).transform([rules])
    assert rules.last is not None and len(rules.last.report.plans) == 6
    assert _products(edge.exported_program()) == 0 and count(edge.exported_program(), "linear") == 6
    lowered = edge.to_backend(XnnpackPartitioner())
    assert count(lowered.exported_program(), "linear") == 0  # (each linear runs in the delegate)
    assert_close(run_pte(lowered.to_executorch().buffer, x), want)


def test_as_a_transform_pass_of_to_edge_transform_and_lower_the_products_spelled_by_hand_run_in_xnnpack() -> None:
    # (the partitioner keeps nn.Linear a linear, and so lets the program take the rule's linears)
    model, x = Products().eval(), _x()
    with torch.no_grad():
        want = list(model(*x))
    rules = RulesPass([addmm_to_linear])
    lowered = to_edge_transform_and_lower(
        torch.export.export(model, x), transform_passes=[rules], partitioner=[XnnpackPartitioner()]
    )
    assert rules.last is not None and len(rules.last.report.plans) == 4 and not rules.last.report.rejections
    program = lowered.exported_program()
    assert _products(program) == 0 and count(program, "linear") == 0  # (all in the delegate)
    assert_close(run_pte(lowered.to_executorch().buffer, x), want)


class Spellings(nn.Module):
    """A transpose in each spelling a tensor's method takes, the permute's dims one by one too."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        w = self.w
        return tuple(torch.mm(x, t) for t in (w.permute(1, 0), w.permute((1, 0)), w.t(), w.transpose(0, 1)))


def test_in_a_symbolic_trace_graph_module_every_product_of_a_transpose_is_reported() -> None:
    # ``w.permute(1, 0)`` (its dims one by one) was read as a permute of no list of dims: that
    # product was neither rewritten nor reported, where the other three say ``module-call``
    gm = torch.fx.symbolic_trace(Spellings())
    outcome = adapters.transform(gm, [addmm_to_linear]).unwrap()
    assert not outcome.changed
    assert sorted((j.node, j.reason.code) for j in outcome.report.rejections) == [
        (name, "module-call") for name in ("mm", "mm_1", "mm_2", "mm_3")
    ]

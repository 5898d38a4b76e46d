"""The outside author's ``merge-linears`` rule (``tests/merge_linears.py``, the public kit only, no
adapter code) on real programs: the GraphModule, the aten and the edge program of two linears in a
row, with no bias, one or both, on a matrix or a sequence of vectors, against the original model's
outputs and the weights left behind; a weight another linear reads stays; a shared inner linear and
a bottleneck are declined; the merged edge program lowers to ExecuTorch and runs."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from executorch.exir import to_edge
from torch import nn
from torch.export import ExportedProgram

import adapters
from adapters.passes import RulesPass
from tests.merge_linears import GROWS, merge_linears
from tests.programs import FORMS, assert_close, assert_sound, build, count, run, run_pte


class Chain(nn.Module):
    """Two linears in a row, each with or without its bias."""

    def __init__(self, inner_bias: bool, outer_bias: bool) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16, bias=inner_bias), nn.Linear(16, 4, bias=outer_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.fc2(self.fc1(x))
        return torch.relu(y)


def _x(rank: int = 2) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn((2, 8) if rank == 2 else (2, 3, 8), generator=g),)


def _constants(program: Any) -> set[str]:
    """The tensors the program holds (a GraphModule's parameters and buffers)."""
    if isinstance(program, ExportedProgram):
        return set(program.state_dict) | set(program.constants)
    return {k for k, _ in program.named_parameters()} | {k for k, _ in program.named_buffers()}


def _products(program: Any) -> int:
    return sum(count(program, op) for op in ("linear", "addmm", "aten.mm", "matmul"))


@pytest.mark.parametrize("rank", [2, 3])
@pytest.mark.parametrize(("inner_bias", "outer_bias"), [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("form", FORMS)
def test_two_linears_become_one_that_computes_what_they_did(
    form: str, inner_bias: bool, outer_bias: bool, rank: int
) -> None:
    model, x = Chain(inner_bias, outer_bias).eval(), _x(rank)  # rank 3: a sequence of vectors
    program = build(model, x, form)
    with torch.no_grad():
        want = [model(*x)]
    outcome = adapters.transform(program, [merge_linears]).unwrap()
    assert len(outcome.report.plans) == 1 and outcome.changed
    assert _products(program) == 1
    assert_sound(program, x, want)  # within 1e-5 of the original's outputs, no dead constant, validates
    (got,) = run(program, x)
    assert torch.allclose(got, want[0], atol=1e-5)
    # the two old weights and the inner bias are gone; the outer bias alone is read as it is
    names = _constants(program)
    assert not any(k.startswith("fc1.") for k in names) and "fc2.weight" not in names
    assert ("fc2.bias" in names) == (outer_bias and not inner_bias)


class Shared(nn.Module):
    """The inner linear's weight also read by another linear, on another input: it stays."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fc2(self.fc1(x)), self.fc1(y)


@pytest.mark.parametrize("form", FORMS)
def test_a_weight_another_linear_reads_stays(form: str) -> None:
    model, x = Shared().eval(), (*_x(), torch.randn(3, 8))
    program = build(model, x, form)
    with torch.no_grad():
        want = list(model(*x))
    outcome = adapters.transform(program, [merge_linears]).unwrap()
    assert [p.anchor for p in outcome.report.plans] and _products(program) == 2
    assert_sound(program, x, want)
    names = _constants(program)
    assert {"fc1.weight", "fc1.bias"} <= names and "fc2.weight" not in names and "fc2.bias" not in names


class Branching(nn.Module):
    """A linear whose output two linears read (no merge), and a bottleneck (no merge: larger)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(16, 4)
        self.down, self.up = nn.Linear(8, 2, bias=False), nn.Linear(2, 8, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.fc1(x)
        return self.a(h), self.b(h), self.up(self.down(x))


@pytest.mark.parametrize("form", FORMS)
def test_a_shared_inner_linear_and_a_bottleneck_are_declined_and_the_program_untouched(form: str) -> None:
    model, x = Branching().eval(), _x()
    program = build(model, x, form)
    want = run(program, x)
    outcome = adapters.transform(program, [merge_linears]).unwrap()
    assert not outcome.changed and not outcome.report.plans
    codes = sorted(j.reason.code for j in outcome.report.rejections)
    # a and b read a linear another reads too; up would be larger merged (fc1 and down read an
    # input: no candidates, nothing reported)
    assert codes == sorted(["output-shared", "output-shared", GROWS])
    assert_sound(program, x, want)


class Regrouped(nn.Module):
    """The model's own reshapes before and between the two linears: rows flattened, then regrouped."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.fc2(self.fc1(x.reshape(-1, 8)).reshape(-1, 2, 16))
        return y


@pytest.mark.parametrize("form", FORMS)
def test_linears_around_the_models_own_reshapes(form: str) -> None:
    # on edge, a linear of a 3-D input is itself a reshape, addmm and reshape back: the model's
    # reshape between the linears is read as the outer one's own (the rows only regrouped), and they
    # merge; in an aten program (and its GraphModule) fc2 reads a reshape, no linear: no candidate
    model, x = Regrouped().eval(), (torch.randn(2, 3, 8),)
    program = build(model, x, form)
    with torch.no_grad():
        want = [model(*x)]
    outcome = adapters.transform(program, [merge_linears]).unwrap()
    merged = form == "edge"
    assert len(outcome.report.plans) == merged and _products(program) == 2 - merged
    assert not outcome.report.rejections
    assert_sound(program, x, want)


def test_the_merged_edge_program_lowers_and_the_runtime_computes_the_same() -> None:
    # as a pass of ExecuTorch's own pipeline (RulesPass), then to_executorch and the runtime
    model, x = Chain(True, True).eval(), _x(3)
    with torch.no_grad():
        want = [model(*x)]
    edge = to_edge(torch.export.export(model, x)).transform([RulesPass([merge_linears])])
    assert _products(edge.exported_program()) == 1
    assert_close(run_pte(edge.to_executorch().buffer, x), want)


@pytest.mark.parametrize("outer_scale", [1e-26, 1e-22])
def test_a_merged_weight_float32_cannot_hold_is_declined_and_the_program_untouched(outer_scale: float) -> None:
    # weights of 1e-20 and 1e-26 (or 1e-22): the program's outputs, of an input of 1e30, are about
    # 1e-16, but their product is 1e-45 (flushed to 0) or 1e-41 (a subnormal, about 3 digits)
    model, x = Chain(False, True).eval(), (torch.randn(2, 8, generator=torch.Generator().manual_seed(0)) * 1e30,)
    with torch.no_grad():
        model.fc1.weight.mul_(1e-20)
        model.fc2.weight.mul_(outer_scale)
        model.fc2.bias.zero_()
    program = build(model, x, "aten")
    want = run(program, x)
    outcome = adapters.transform(program, [merge_linears]).unwrap()
    assert not outcome.changed and not outcome.report.plans
    (no,) = [j.reason for j in outcome.report.rejections if j.node == "linear_1"]
    assert no.code == "weight-underflow"
    assert_sound(program, x, want)


@pytest.mark.parametrize(
    ("outer_scale", "merged"), [(1e-165, False), (1e-150, False), (1e-140, True), ("cancelling", True)]
)
def test_a_merged_float64_weight_that_underflows_is_declined(outer_scale: float | str, merged: bool) -> None:
    # found by a hunt: float64 was not checked, so weights of 1e-160 and 1e-165 merged to 0 and the
    # outputs, about 1e-25 for an input of 1e300, were 0; 1e-310 is a subnormal (about 4 digits). A
    # review: the difference of two equal rows, exactly 0, was declined as if it had flushed
    model, x = Chain(False, True).double().eval(), (torch.randn(2, 8, dtype=torch.float64) * 1e300,)
    with torch.no_grad():
        model.fc1.weight.mul_(1e-160)
        if outer_scale == "cancelling":
            model.fc1.weight[1] = model.fc1.weight[0]
            model.fc2.weight.zero_()
            model.fc2.weight[:, 0], model.fc2.weight[:, 1] = 1.0, -1.0
        elif isinstance(outer_scale, float):
            model.fc2.weight.mul_(outer_scale)
        model.fc2.bias.zero_()
    program = build(model, x, "aten")
    want = run(program, x)
    outcome = adapters.transform(program, [merge_linears]).unwrap()
    assert len(outcome.report.plans) == merged
    assert [j.reason.code for j in outcome.report.rejections if j.node == "linear_1"] == (
        [] if merged else ["weight-underflow"]
    )
    assert_sound(program, x, want)


@pytest.mark.parametrize("length", [3, 5, 8])
@pytest.mark.parametrize("form", [*FORMS, "decomposed"])
def test_a_chain_reports_the_merges_it_makes(form: str, length: int) -> None:
    # found by hunts (2026-12-07): after decompositions and on edge every pair was reported merged,
    # though a plan read through the linear the one before replaced, whose merge was dropped unread
    sizes = [8, 16, 12, 10, 6, 9, 7, 5, 4][: length + 1]
    model = nn.Sequential(*(nn.Linear(a, b) for a, b in itertools.pairwise(sizes))).eval()
    x = (torch.randn(2, 3, 8),)
    program = torch.export.export(model, x).run_decompositions() if form == "decomposed" else build(model, x, form)
    with torch.no_grad():
        want = [model(*x)]
    outcome = adapters.transform(program, [merge_linears]).unwrap()
    plans, rejections = outcome.report.plans, outcome.report.rejections
    # (a candidate declined as its pair was taken, which a plan then merged, is not reported)
    assert plans and all(j.reason.code == "plan-conflict" for j in rejections)
    assert _products(program) == length - len(plans)  # each plan reported merged two products
    made = {c.name for p in plans for c in p.constants}
    assert made <= _constants(program)  # what each plan made is in the program
    assert_sound(program, x, want)


class Kept(nn.Module):
    """Two chains: one through an eval dropout (merged, the dropout gone), and one of weights stored
    [in, out], GPT-2's ``Conv1D`` (declined, saying why)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(8, 16), nn.Linear(16, 4), nn.Dropout(0.1)
        self.w1, self.b1 = nn.Parameter(torch.randn(8, 16) * 0.1), nn.Parameter(torch.randn(16))
        self.w2, self.b2 = nn.Parameter(torch.randn(16, 4) * 0.1), nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fc2(self.drop(self.fc1(x))), torch.addmm(self.b2, torch.addmm(self.b1, x, self.w1), self.w2)


@pytest.mark.parametrize("form", FORMS)
def test_a_chain_through_a_dropout_merges_and_one_of_weights_stored_in_out_is_reported(form: str) -> None:
    # found by a hunt (2026-12-07): both were neither merged nor reported
    model, x = Kept().eval(), _x()
    program = build(model, x, form)
    with torch.no_grad():
        want = list(model(*x))
    outcome = adapters.transform(program, [merge_linears]).unwrap()
    assert len(outcome.report.plans) == 1 and count(program, "dropout") == 0
    (no,) = outcome.report.rejections
    assert no.reason.code == "wrong-op" and "not a permute or a transpose" in no.reason.message
    assert_sound(program, x, want)


def test_a_merged_weight_summed_from_terms_below_float32s_normals_is_declined() -> None:
    # found by a hunt (2026-12-07): each of W2 @ W1's 65,537 terms is 1.5 * 2**-149 (a subnormal,
    # rounded on its grid) but one, their sum a normal float32 0.4% off the exact one; the program
    # computes with normal values (x * W1 is about 2**52), so the merge would move its output
    k = 65536
    fc1, fc2 = nn.Linear(1, k + 1, bias=False), nn.Linear(k + 1, 1, bias=False)
    with torch.no_grad():
        fc1.weight.fill_(1.5 * 2.0**-74)
        fc1.weight[-1, 0] = 2.0**-63
        fc2.weight.fill_(2.0**-75)
        fc2.weight[0, -1] = 2.0**-63
    model = nn.Sequential(fc1, fc2).eval()
    x = (torch.full((2, 1), 2.0**126),)
    program = build(model, x, "aten")
    want = run(program, x)
    outcome = adapters.transform(program, [merge_linears]).unwrap()
    assert not outcome.changed and [j.reason.code for j in outcome.report.rejections] == ["weight-underflow"]
    assert_sound(program, x, want)


@pytest.mark.parametrize("form", FORMS)
def test_linears_of_no_input_features_merge(form: str) -> None:
    # found by a hunt (2026-12-07): on edge, a size of 0 was taken for no size given (declined
    # plan-conflict, "computes float32[0, 4], its plan declares [16, 4]")
    model, x = nn.Sequential(nn.Linear(0, 16), nn.Linear(16, 4)).eval(), (torch.randn(2, 0),)
    program = build(model, x, form)
    with torch.no_grad():
        want = [model(*x)]
    outcome = adapters.transform(program, [merge_linears]).unwrap()
    assert len(outcome.report.plans) == 1 and not outcome.report.rejections
    assert_sound(program, x, want)

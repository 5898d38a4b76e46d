"""Per-plan validation: each applied plan checked on its own, so a wrong plan is named; and the
command line's reliability (atomic saves, one-line errors, dynamic shapes)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from executorch.exir import to_edge
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import adapters
from adapters.cli import main
from adapters.validate import check_plans, default_tolerance
from fxpure.families import BATCH_NORM, CONV, MUL, RELU
from fxpure.pattern import Bound, Const, Lit, Op, PatternRule, Planner, Var, quantized_as, rule
from fxpure.plan import NewNode, RewritePlan, plan
from fxpure.rules import RULES, fuse_conv_bn
from fxpure.snapshot import DTypeArg, NodeRef, TensorSpec
from fxpure.weights import Binary, Fill, Reshape, WeightExpr, fold_batch_norm
from tests.models import ResNetish, example, randomize_bn
from tests.programs import build
from tests.quantized import pt2e

_QD = "quantized_decomposed"


def _forgets_gamma(
    p: Planner, bn: Bound, conv: Bound, w: WeightExpr, mean: WeightExpr, var: WeightExpr, beta: WeightExpr | None
) -> RewritePlan:
    # deliberately wrong: folds the batch norm as if gamma were 1
    weight, bias = fold_batch_norm(weight=w, bias=None, mean=mean, var=var, gamma=None, beta=beta, eps=1e-5).unwrap()
    return p.replace(bn, p.respell(conv, weight=p.const(weight, "w_bad"), bias=p.const(bias, "b_bad")))


def wrong_fold() -> PatternRule:
    pattern = Op(
        BATCH_NORM,
        name="bn",
        out=0,
        training=Lit(False),
        input=Op(CONV, name="conv", weight=Const("w"), bias=None, groups=1),
        bias=Const("beta", optional=True),
        running_mean=Const("mean"),
        running_var=Const("var"),
    )
    return rule("wrong-fold", pattern, plan=_forgets_gamma)


def test_a_wrong_plan_is_named_and_the_right_ones_pass() -> None:
    model = randomize_bn(ResNetish())
    program = build(model, example(model), "aten")
    before = adapters.capture(program)
    good = adapters.transform(program, [fuse_conv_bn()], dry_run=True).unwrap().report
    checks = check_plans(program, good)
    assert len(checks) == 5 and all(c.ok for c in checks) and max(c.max_rel for c in checks) < 1e-5
    bad = adapters.transform(program, [wrong_fold()], dry_run=True).unwrap().report
    assert len(bad.plans) == 4  # the stem conv has a bias: not this rule's pattern
    checks = check_plans(program, bad)
    assert [c.ok for c in checks] == [False] * 4
    assert {c.anchor for c in checks} == {p.anchor for p in bad.plans}
    assert all("max relative difference" in c.note for c in checks)
    assert adapters.capture(program) == before  # checking changes nothing


def _clamp(high: float | None, spec: str = "same") -> PatternRule:
    """relu(x) -> clamp(x, 0, high): right with no upper bound; the new node declares ``spec``."""

    def plan(p: Planner, r: Bound, x: NodeRef) -> RewritePlan:
        declared = {"same": r.spec, "none": None, "half": TensorSpec(shape=(2, 64), dtype="float16")}[spec]
        return p.replace(r, p.node("aten.clamp.default", (x, 0.0, high), name="c", spec=declared))

    return rule("relu-to-clamp", Op(RELU, name="r", self=Var("x")), plan=plan)


@pytest.mark.parametrize("form", ["aten", "edge"])
def test_a_plan_wrong_only_for_large_inputs_or_in_its_declared_spec_is_named(form: str) -> None:
    program = build(nn.ReLU(), (torch.randn(2, 64),), form)

    def check(r: PatternRule) -> tuple[bool | None, str]:
        (c,) = check_plans(program, adapters.transform(program, [r], dry_run=True).unwrap().report)
        return c.ok, c.note

    assert check(_clamp(None)) == (True, "")
    ok, note = check(_clamp(5.0))  # differs from relu above 5 only: the inputs reach past it
    assert ok is False and note.startswith("max relative difference")
    # a new value declared of another dtype than the one it stands for, or of none, is declined when planned
    for declared in ("half", "none"):
        report = adapters.transform(program, [_clamp(None, declared)], dry_run=True).unwrap().report
        assert report.plans == () and [r.reason.code for r in report.rejections] == ["plan-conflict"]
    # and check_plans names it in a report made otherwise (by hand, say)
    good = adapters.transform(program, [_clamp(None)], dry_run=True).unwrap().report
    (p,) = good.plans
    for spec, note in (
        (None, "c declares no shape or dtype, and computes (2, 64) float32"),
        (TensorSpec(shape=(2, 64), dtype="float16"), "c declares (2, 64) float16, and computes (2, 64) float32"),
    ):
        made = dataclasses.replace(p, nodes=(dataclasses.replace(p.nodes[0], spec=spec),))
        (c,) = check_plans(program, dataclasses.replace(good, plans=(made,), stages=((made,),)))
        assert (c.ok, c.note) == (False, note)


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    model = randomize_bn(ResNetish())
    path = tmp_path / "resnet.pt2"
    torch.export.save(torch.export.export(model, example(model)), path)
    return path


def test_cli_verify_names_the_wrong_plan(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(RULES, "wrong-fold", wrong_fold)
    code = main(["apply", str(saved), "-o", str(tmp_path / "out.pt2"), "--rules", "wrong-fold", "--verify"])
    out = capsys.readouterr().out
    assert code == 1
    assert out.count("FAILED (max relative difference") == 4 and "plan wrong-fold at batch_norm_1: FAILED" in out
    code = main(["apply", str(saved), "-o", str(tmp_path / "ok.pt2"), "--verify"])
    out = capsys.readouterr().out
    assert code == 0 and out.count(": ok (max rel diff") >= 5


def test_output_may_be_the_input_and_a_failed_save_keeps_the_original(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = saved.read_bytes()

    def half_written(program: object, path: object, **_: object) -> None:
        Path(str(path)).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch.export, "save", half_written)
    assert main(["apply", str(saved), "-o", str(saved)]) == 2
    assert saved.read_bytes() == original and list(saved.parent.iterdir()) == [saved]
    monkeypatch.undo()
    assert main(["apply", str(saved), "-o", str(saved)]) == 0
    assert len(list(torch.export.load(saved).graph.find_nodes(op="placeholder"))) < 20  # fused in place


class TrainingBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.bn(self.conv(x))
        return out


def test_edge_refusal_and_lowering_failure_are_one_line_and_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "train.pt2"
    torch.export.save(torch.export.export(TrainingBN().train(), (torch.randn(2, 3, 8, 8),)), path)
    assert main(["explain", str(path), "--edge"]) == 3  # a lowering that fails, as apply --pte says
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fxpure: error: ") and "to_edge cannot lower" in err[0]
    out, pte = tmp_path / "out.pt2", tmp_path / "out.pte"
    assert main(["apply", str(path), "-o", str(out), "--pte", str(pte)]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing written" in err[0]
    assert not out.exists() and not pte.exists()


def test_a_directory_is_not_reported_as_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_verify_respects_the_declared_range_of_a_dynamic_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = randomize_bn(ResNetish()).eval()
    batch = torch.export.Dim("batch", min=4, max=16)
    ep = torch.export.export(model, (torch.randn(5, 3, 16, 16),), dynamic_shapes=({0: batch},))
    path = tmp_path / "dyn.pt2"
    torch.export.save(ep, path)
    assert main(["apply", str(path), "-o", str(tmp_path / "o.pt2"), "--verify"]) == 0
    assert "verify: max abs diff" in capsys.readouterr().out


Dim = torch.export.Dim


class _Conv1dBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv1d(4, 6, 3), nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.bn(self.conv(x))
        return y


class _Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


@pytest.mark.parametrize("form", ["aten", "edge"])
@pytest.mark.parametrize(("model", "x", "dims", "rule"), [
    (_Conv1dBN, (2, 4, 9), {2: Dim("L", min=5, max=64)}, "fuse-conv-bn"),
    (_Linear, (2, 7, 8), {0: Dim("B", max=8), 1: Dim("T", min=3, max=32)}, "linear-to-conv2d"),
])  # fmt: skip
def test_each_plan_of_a_dynamic_program_is_checked_at_sizes_the_program_declares(
    form: str, model: type[nn.Module], x: tuple[int, ...], dims: dict[int, object], rule: str
) -> None:
    # a symbolic size takes its declared lower bound (it was 2 for all: a kernel-3 conv cannot run
    # on 2, so the plan came back "not checked"), and the size arithmetic an edge program computes its
    # reshapes with (sym_size, mul) is computed from the region's inputs (it was "not checked" too)
    ep = torch.export.export(randomize_bn(model()).eval(), (torch.randn(x),), dynamic_shapes=({**dims},))
    program = ep if form == "aten" else to_edge(ep).exported_program()
    report = adapters.transform(program, [RULES[rule]()], dry_run=True).unwrap().report
    checks = check_plans(program, report)
    assert checks and all((c.ok, c.note) == (True, "") for c in checks), checks


def test_a_half_precision_fold_is_checked_within_its_dtypes_rounding() -> None:
    # folding rounds the weight to float16 once where the program rounds conv and batch norm apart:
    # a few float16 steps off, which a float32 tolerance (1e-4) called wrong
    model = randomize_bn(ResNetish()).half()
    program = build(model, tuple(t.half() for t in example(model)), "aten")
    report = adapters.transform(program, [fuse_conv_bn()], dry_run=True).unwrap().report
    assert report.plans
    assert all(c.ok for c in check_plans(program, report))
    assert not all(c.ok for c in check_plans(program, report, tolerance=1e-4))


def _requantized_off(p: Planner, r: Bound, x: NodeRef, twice: bool) -> RewritePlan:
    # deliberately wrong: relu(x) quantized with the program's next parameters, dequantized one step
    # off (every value one step up), or relu(2x)
    spec, q_next = r.spec, quantized_as(p.match.snap, r.name)
    assert spec is not None and q_next is not None
    scale, zero = q_next.args[1], q_next.args[2]
    assert isinstance(zero, int)
    y = p.call("aten.mul.Tensor", name="twice", spec=spec, self=x, other=2.0) if twice else x
    relu = p.call("aten.relu.default", name="relu2", spec=spec, self=y)
    i8, q8, dq = (
        TensorSpec(shape=spec.shape, dtype="int8"),
        DTypeArg(name="int8"),
        f"{_QD}.dequantize_per_tensor.default",
    )
    common: dict[str, Any] = {"scale": scale, "quant_min": -128, "quant_max": 127, "dtype": q8}
    q = p.call(f"{_QD}.quantize_per_tensor.default", name="rq", spec=i8, input=relu, zero_point=zero, **common)
    return p.replace(r, p.call(dq, name="rdq", spec=spec, input=q, zero_point=zero if twice else zero + 1, **common))


def _off(twice: bool) -> Callable[[Planner, Bound, NodeRef], RewritePlan]:
    return lambda p, r, x: _requantized_off(p, r, x, twice)


@pytest.mark.parametrize("rule_name", ["conv1d-to-conv2d", "linear-to-conv2d"])
def test_plans_of_a_quantized_program_are_checked_where_it_quantizes(rule_name: str) -> None:
    # conv1d-to-conv2d and linear-to-conv2d quantize their conv2d's input and output again (q/dq
    # pairs with the program's parameters): both differ from the float they replace by that
    # rounding, and were failed, where the whole program's outputs are equal
    conv1d = nn.Sequential(nn.Conv1d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv1d(16, 8, 1))
    if rule_name == "conv1d-to-conv2d":
        program = pt2e(conv1d, (torch.randn(2, 8, 20),), per_channel=False)
    else:
        program = pt2e(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)), (torch.randn(4, 16),))
    report = adapters.transform(program, [RULES[rule_name]()], dry_run=True).unwrap().report
    checks = check_plans(program, report)
    assert len(checks) == 2 and all(c.ok for c in checks), checks
    # a wrong plan that quantizes again is still failed there: one step off everywhere, or far off
    program = pt2e(conv1d, (torch.randn(2, 8, 20),), per_channel=False)
    for twice in (False, True):
        wrong = rule(
            "requantized-off",
            Op(RELU, name="r", self=Var("x")),
            plan=_off(twice),
        )
        (check,) = check_plans(program, adapters.transform(program, [wrong], dry_run=True).unwrap().report)
        assert check.ok is False, check


class _FloatConvBesideBfloat16(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 8, 1, bias=False)
        self.register_buffer("g", torch.rand(1, 8, 1, 1) + 0.5)
        self.side = nn.Linear(4, 4).to(torch.bfloat16)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.c(x) * self.g, self.side(z)


def _sloppy(p: Planner, mul: Bound, conv: Bound, w: WeightExpr, g: WeightExpr) -> RewritePlan:
    # deliberately wrong: folds g * 1.03, 3% off
    gain = Binary(op="mul", a=Reshape(x=g, shape=(8, 1, 1, 1)), b=Fill(shape=(1,), value=1.03, dtype="float32"))
    return p.replace(mul, p.respell(conv, weight=p.const(Binary(op="mul", a=w, b=gain), "w_scaled")))


def test_a_float32_plan_is_checked_at_float32s_tolerance_beside_a_bfloat16_branch() -> None:
    # the program's own tolerance is bfloat16's (6%): a float32 plan 3% off passed with it
    pattern = Op(MUL, name="mul", self=Op(CONV, name="conv", weight=Const("w"), bias=None), other=Const("g"))
    program = torch.export.export(
        _FloatConvBesideBfloat16().eval(), (torch.randn(1, 3, 4, 4), torch.randn(2, 4).bfloat16())
    )
    report = adapters.transform(program, [rule("sloppy", pattern, plan=_sloppy)], dry_run=True).unwrap().report
    assert default_tolerance(program) == 8 * torch.finfo(torch.bfloat16).eps
    (check,) = check_plans(program, report)
    assert check.ok is False and 0.02 < check.max_rel < 0.04


@pytest.mark.parametrize("op", ["aten.clone.default", "aten.neg.default"])
def test_a_plan_that_takes_an_inputs_or_a_weights_uses_is_checked(op: str) -> None:
    # the input and the weight are no node of the region: the original's value is the one the
    # replacement reads (before, --verify raised KeyError on them)
    model = randomize_bn(ResNetish())
    program = build(model, example(model), "aten")
    snap = adapters.capture(program)
    conv = next(n for n in snap.nodes if n.target == "aten.conv2d.default")
    plans = []
    for name in (snap.inputs[0], conv.args[1].name):  # type: ignore[union-attr]
        made = NewNode(name=f"{name}_new", target=op, args=(NodeRef(name),), spec=snap.node(name).spec)
        plans.append(RewritePlan(rule="r", anchor=name, nodes=(made,), replace=((name, made.name),)))
    report = plan(snap, [])
    checks = check_plans(program, replace(report, plans=tuple(plans), stages=(tuple(plans),)))
    assert [c.ok for c in checks] == [op == "aten.clone.default"] * 2


class ConvScaleBN(nn.Module):
    """A conv times 2, then a batch norm: a plan of fold-binary and one of fuse-conv-bn."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.bn(self.conv(x) * 2.0)
        return out


@pytest.mark.parametrize("nodata", ["meta", "fake"])
def test_plans_on_weights_without_data_are_not_checked(nodata: str) -> None:
    # found by a hunt: on meta weights a correct fold was FAILED ("the replacement fails where the
    # original ran": a meta weight beside a random cpu input); on fake ones check_plans raised
    x = (torch.randn(1, 3, 8, 8),)
    if nodata == "meta":
        with torch.device("meta"):
            model = ConvScaleBN().eval()
        program = torch.export.export(model, tuple(t.to("meta") for t in x))
    else:
        with FakeTensorMode(allow_non_fake_inputs=True):
            program = torch.export.export(ConvScaleBN().eval(), x)
    report = adapters.transform(program, [RULES["fold-binary"](), fuse_conv_bn()], dry_run=True).unwrap().report
    checks = check_plans(program, report)
    assert [(c.rule, c.ok) for c in checks] == [("fold-binary", None), ("fuse-conv-bn", None)]
    assert all(c.note == "not checked: conv.weight holds no data (on the meta device, or fake)" for c in checks)


class TwoProjections(nn.Module):
    """Two linears of one non-contiguous input: edge gives each its own expand, view and bmm."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(4, 3), nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x.transpose(1, 2)
        return self.q(h), self.k(h)


@pytest.mark.parametrize("form", ["aten", "edge"])
def test_linears_joined_from_equal_views_are_checked_on_one_value(form: str) -> None:
    # found by a hunt: on edge the joined linear reads the first linear's view of the input, the
    # second's own view (pruned) was computed from a value drawn apart from it: a right plan FAILED
    # (0.99 off) where the program it applied was right
    program = build(TwoProjections().eval(), (torch.randn(2, 4, 7),), form)
    report = adapters.transform(program, [RULES["concat-parallel-linears"]()], dry_run=True).unwrap().report
    (check,) = check_plans(program, report)
    assert check.rule == "concat-parallel-linears" and check.ok is True and check.max_rel < 1e-5

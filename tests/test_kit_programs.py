"""What a rule written with the kit makes of a real program: a node a planner writes with its
arguments left to their defaults runs; ``check_plans`` fails a plan whose replacement torch
refuses; an op an edge program's verifier refuses is declined, the program untouched."""

from __future__ import annotations

import dataclasses
import math
import re
import sys

import pytest
import torch
from executorch.exir import EdgeCompileConfig, to_edge
from returns.result import Failure, Success
from torch.export import ExportedProgram

import adapters
from adapters.passes import RulesPass
from adapters.torchnames import OP_LIBRARIES, resolve_target
from adapters.validate import check_plans
from fxpure.families import ADD, CONV, GETITEM, MUL, PERMUTE, RELU, SPLIT
from fxpure.linear import linear_of, linear_root
from fxpure.pattern import ANY, Bound, Const, Match, OneOf, Op, Planner, Scalar, Var, need, rule
from fxpure.plan import RewritePlan, Rule, plan
from fxpure.reasons import Declined, Reason
from fxpure.snapshot import NodeRef, TensorSpec
from fxpure.testing import evaluate
from fxpure.weights import Binary, Cast, Dequantize, Fill, Quantize, Source, SumOver, Unsqueeze, WeightExpr, Within
from tests.models import ScaledConv
from tests.programs import FORMS, assert_close, assert_sound, build, count, run, run_pte, validate
from tests.quantized import pt2e_module


class Relu(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) * 2


def _identity_conv(p: Planner, r: Bound, x: NodeRef) -> RewritePlan:
    # relu(x) -> a depthwise 1x1 conv of ones on relu(x): stride, padding and dilation left out
    w = p.const(Fill(shape=(3, 1, 1, 1), value=1.0, dtype="float32"), "ones")
    conv = p.call("aten.conv2d.default", name="dw", spec=r.node.spec, input=NodeRef(r.name), weight=w, groups=3)
    return p.replace(r, conv)


IDENTITY = rule("identity-conv", Op(RELU, name="r", self=Var("x")), plan=_identity_conv)
X = (torch.randn(1, 3, 4, 4),)


@pytest.mark.parametrize("form", ["gm", "aten"])
def test_a_call_that_leaves_list_arguments_to_their_defaults_runs(form: str) -> None:
    # torch's conv2d takes stride=[1, 1], never 1: the defaults a planner leaves out are filled so
    program, want = build(Relu(), X, form), run(build(Relu(), X, form), X)
    outcome = adapters.transform(program, [IDENTITY])
    assert isinstance(outcome, Success) and count(program, "conv2d") == 1
    assert_sound(program, X, want)


@pytest.mark.parametrize("form", FORMS)
def test_a_new_conv_of_two_dtypes_is_declined_and_the_program_untouched(form: str) -> None:
    # IDENTITY's float32 ones on a bfloat16 relu: applied, the conv would fail when the program runs
    x = (X[0].to(torch.bfloat16),)
    program = build(Relu(), x, form)

    def code() -> str:
        return program.graph_module.code if isinstance(program, torch.export.ExportedProgram) else program.code

    before, want = code(), run(program, x)
    outcome = adapters.transform(program, [IDENTITY]).unwrap()
    (why,) = [j.reason for j in outcome.report.rejections]
    assert not outcome.changed and why.code == "plan-conflict"
    assert f"dtypes bfloat16 ({why.node}) and float32 (ones)" in why.message
    assert code() == before
    assert_sound(program, x, want)


def _with_int_stride(p: RewritePlan) -> RewritePlan:
    """``p`` with its conv's stride as a bare int, as a hand-written plan may write it."""
    conv = p.nodes[0]
    bad = dataclasses.replace(conv, args=(*conv.args[:3], 1, *conv.args[4:]))
    return dataclasses.replace(p, nodes=(bad,))


def test_check_plans_fails_a_plan_whose_replacement_torch_refuses() -> None:
    program = build(Relu(), X, "aten")
    report = plan(adapters.capture(program), [IDENTITY])
    (good,) = check_plans(program, report)
    assert good.ok is True
    bad = _with_int_stride(report.plans[0])
    broken = dataclasses.replace(report, plans=(bad,), stages=((bad,),))
    (checked,) = check_plans(program, broken)
    assert checked.ok is False
    assert checked.note.startswith("the replacement fails where the original ran: RuntimeError")


def _to_linear(p: Planner, lin: Bound, x: NodeRef, b: NodeRef | None = None) -> RewritePlan:
    parts = linear_of(p.match)
    new = p.call("aten.linear.default", name="l", spec=parts.spec, input=x, weight=parts.weight, bias=b)
    return p.replace(parts.outer, new)


TO_LINEAR = rule(
    "to-linear",
    linear_root("lin", bias=Var("b")),
    plan=_to_linear,
    candidate=lambda root, snap: root.node.target != "aten.linear.default",
)


def _edge(preserve: bool) -> torch.export.ExportedProgram:
    model, x = torch.nn.Linear(4, 8).eval(), (torch.randn(2, 4),)
    ep = torch.export.export(model, x)
    if not preserve:
        return to_edge(ep).exported_program()
    config = EdgeCompileConfig(_core_aten_ops_exception_list=[torch.ops.aten.linear.default])
    return to_edge(ep, compile_config=config).exported_program()


def test_an_op_the_edge_programs_verifier_refuses_is_declined_and_the_program_untouched() -> None:
    program = _edge(preserve=False)
    before = program.graph_module.code
    outcome = adapters.transform(program, [TO_LINEAR])
    assert isinstance(outcome, Success) and not outcome.unwrap().changed
    (why,) = [j.reason for j in outcome.unwrap().report.rejections]
    assert (why.code, why.path) == ("op-not-allowed", "plan") and "aten.linear.default" in why.message
    assert why.message.endswith("core-aten-ir).")
    assert program.graph_module.code == before
    validate(program)
    # through executorch's own pass manager too: the pass declines, to_executorch goes on
    manager = to_edge(torch.export.export(torch.nn.Linear(4, 8).eval(), (torch.randn(2, 4),)))
    assert count(manager.transform([RulesPass([TO_LINEAR])]).exported_program(), "linear") == 0


def test_an_edge_program_made_to_allow_the_op_takes_it() -> None:
    program, x = _edge(preserve=True), (torch.randn(2, 4),)
    want = run(program, x)
    assert count(program, "addmm") == 1  # to_edge still decomposed the linear
    assert adapters.transform(program, [TO_LINEAR]).unwrap().changed
    assert count(program, "linear") == 1 and count(program, "addmm") == 0
    assert_sound(program, x, want)


def _widened(p: Planner, mul: Bound, x: NodeRef, c: WeightExpr) -> RewritePlan:
    # the same value, its 0-d operand kept in float32 (it does not promote: the result is float16)
    wide = p.const(Cast(x=c, dtype="float32"), "wide")
    return p.replace(mul, p.call("aten.mul.Tensor", name="mul32", spec=mul.spec, self=x, other=wide))


def _composed(p: Planner, outer: Bound, inner: Bound, x: NodeRef) -> RewritePlan:
    dims = tuple(inner.ints("dims")[i] for i in outer.ints("dims"))  # (an edge program spells it permute_copy)
    return p.replace(outer, p.call("aten.permute.default", name="pp", spec=outer.spec, self=x, dims=dims))


COMPOSE = rule("compose", Op(PERMUTE, name="outer", self=Op(PERMUTE, name="inner", self=Var("x"))), plan=_composed)


def _aliased(p: Planner, outer: Bound, inner: Bound, x: NodeRef) -> RewritePlan:
    # a view op fxpure knows no ``_copy`` spelling of (``as_strided``, here the composed permute's
    # elements as they are laid out): written as given
    pp = _composed(p, outer, inner, x).nodes[0]
    size = p.match.shape("outer")
    stride = tuple(math.prod(size[i + 1 :]) for i in range(len(size)))
    strided = p.node("aten.as_strided.default", (NodeRef(pp.name), size, stride), name="a", spec=outer.spec)
    return p.replace(outer, strided)


class Permuted(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sin().permute(0, 2, 1).permute(1, 0, 2) * 3.0


@pytest.mark.parametrize(
    ("made", "said"),
    [
        (
            rule("widen", Op(MUL, name="mul", self=Var("x"), other=Const("c")), plan=_widened),
            "aten.mul.Tensor of self float16, other float32, __ret_0 float16: its kernels take no such dtypes",
        ),
        (
            rule("alias", Op(PERMUTE, name="outer", self=Op(PERMUTE, name="inner", self=Var("x"))), plan=_aliased),
            "ExecuTorch has no out variant of aten.as_strided.default: to_executorch would fail (the edge "
            "program's spelling: aten.as_strided_copy.default)",
        ),
    ],
    ids=["mixed dtypes", "a view op"],
)
def test_an_edge_op_executorch_cannot_take_is_declined_and_the_program_lowers(made: Rule, said: str) -> None:
    # an outside author: both were applied; the first program then failed ExecuTorch's verifier
    # (``validate``, and ``edge.transform`` raised), the second failed ``to_executorch`` ("Missing
    # out variants: {'aten::permute'}"), though the guide says such a plan is declined
    x = (torch.randn(2, 3, 4, dtype=torch.float16),)
    edge = to_edge(torch.export.export(Permuted(), x))
    before = edge.exported_program().graph_module.code
    outcome = adapters.transform(edge.exported_program(), [made]).unwrap()
    assert not outcome.changed and edge.exported_program().graph_module.code == before
    (why,) = [j.reason for j in outcome.report.rejections if j.reason.code != "wrong-op"]
    assert (why.code, why.path) == ("op-not-allowed", "plan") and why.message.endswith(said)
    lowered = edge.transform([RulesPass([made])])
    validate(lowered.exported_program())
    assert_close(run_pte(lowered.to_executorch().buffer, x), [Permuted()(*x)])


def test_a_planner_writes_a_view_op_in_the_edge_programs_spelling() -> None:
    # (an outside author wrote ``aten.permute`` for every form, and on edge it was declined)
    x = (torch.randn(2, 3, 4, dtype=torch.float16),)
    for form in FORMS:
        program = build(Permuted(), x, form)
        want = run(program, x)
        assert adapters.transform(program, [COMPOSE]).unwrap().changed
        assert count(program, "permute") == 1 and count(program, "permute_copy") == (form == "edge")
        assert_close(run(program, x), want)
    edge = to_edge(torch.export.export(Permuted(), x))
    lowered = edge.transform([RulesPass([COMPOSE])])
    assert count(lowered.exported_program(), "permute_copy") == 1
    assert_close(run_pte(lowered.to_executorch().buffer, x), [Permuted()(*x)])


class Doubled(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(x)
        return y + y


# x + x -> x * 2.0: a number as ``other`` (export writes ``x * 2.0`` so; to_edge lifts it)
NUMBER_OTHER = rule(
    "number-other",
    Op(ADD, name="add", self=Var("x"), other=Var("x"), alpha=1),
    plan=lambda p, add, x: p.replace(add, p.call("aten.mul.Tensor", name="twice", spec=add.spec, self=x, other=2.0)),
)


@pytest.mark.parametrize("form", FORMS)
def test_a_number_as_other_is_taken_but_on_edge_whose_verifier_wants_a_tensor(form: str) -> None:
    # found by an outside author: applied on edge, the program's verifier then refused the mul
    # (a tensor argument not a tensor), and so did executorch's pass manager after the pass
    program, x = build(Doubled(), (torch.randn(3, 8),), form), (torch.randn(3, 8),)
    want = run(program, x)
    outcome = adapters.transform(program, [NUMBER_OTHER]).unwrap()
    if form != "edge":
        assert outcome.changed and count(program, "mul") == 1
        assert_sound(program, x, want) if form == "aten" else assert_close(run(program, x), want)
        return
    (why,) = [j.reason for j in outcome.report.rejections]
    assert (why.code, why.path) == ("malformed-node", "plan") and "2.0 as other" in why.message
    assert not outcome.changed and isinstance(program, ExportedProgram)
    validate(program)


class Scaled(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) * 2.0 + 1.0


# relu(x) * 2 -> relu(x): the mul's uses move to the relu, which stays
DROP = rule(
    "drop-double",
    Op(MUL, name="m", self=Op(RELU, name="r"), other=Var("k")),
    plan=lambda p, m, r: p.replace(m, NodeRef(r.name)),
)


@pytest.mark.parametrize("form", FORMS)
def test_a_plan_that_drops_an_op_for_another_matched_node_applies(form: str) -> None:
    program = build(Scaled(), X, form)
    outcome = adapters.transform(program, [DROP])
    assert outcome.unwrap().changed and count(program, "mul") == 0 and count(program, "relu") == 1
    assert_sound(program, X, [torch.relu(X[0]) + 1.0])


class TimesOne4(torch.nn.Module):
    """Four outputs times one: of a parameter, of the input, of a view of the parameter, of a relu."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.w * 1.0, x * 1.0, self.w.t() * 1.0, torch.relu(x) * 1.0


# y * 1 -> y
TIMES_ONE = rule("times-one", Op(MUL, name="m", self=Var("y"), other=1.0), plan=lambda p, m, y: p.replace(m, y))


@pytest.mark.parametrize("form", ["gm", "aten"])
def test_an_output_moved_to_a_tensor_the_program_holds_or_is_given_is_declined(form: str) -> None:
    # found by an outside author: a rule dropping ``w * 1`` made the program return the parameter
    # itself (or the caller's input, or a view of the parameter): a caller writing into what it got
    # back then changed the model
    x, model = torch.randn(3, 3), TimesOne4()
    program, reference = build(model, (x,), form), build(model, (x,), form)
    outcome = adapters.transform(program, [TIMES_ONE]).unwrap()
    assert [p.anchor for p in outcome.report.plans] == ["mul_3"]
    whys = [j.reason for j in outcome.report.rejections]
    assert [(j.code, j.path) for j in whys] == [("plan-conflict", "plan")] * 3
    assert "holds or is given" in whys[0].message and "a view of" in whys[2].message
    for _ in range(2):
        got, want = run(program, (x,)), run(reference, (x,))
        assert_close(got, want)
        for t in got:
            t.add_(100.0)  # the caller writes into what it got back


class TimesTwo(torch.nn.Module):
    """Returns ``w * two`` (or only reads it) beside ``x @ w``."""

    two: torch.Tensor

    def __init__(self, returned: bool) -> None:
        super().__init__()
        self.w, self.returned = torch.nn.Parameter(torch.ones(2, 2)), returned
        self.register_buffer("two", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.w * self.two
        return (x @ self.w, y) if self.returned else (x @ self.w + y,)


def _folded(via: str, name: str = "k") -> Rule:
    """``w * two`` folded to a new constant ``k`` (or another ``name``), its uses moved to ``k``,
    or ``via`` a view of it: ``k.t().t()``, or the element of ``k.split(2)``."""

    def fold(p: Planner, m: Bound, w: WeightExpr, two: WeightExpr) -> RewritePlan:
        k, spec = p.const(Binary(op="mul", a=w, b=two), name=name), m.node.tensor_spec
        if via == "t":
            k = p.call(
                "aten.t.default", name="kt", spec=spec, self=p.call("aten.t.default", name="k1", spec=spec, self=k)
            )
        elif via == "split":
            parts = p.call("aten.split_with_sizes.default", name="ks", spec=(spec,), self=k, split_sizes=(2,), dim=0)
            k = p.call("getitem", name="k0", spec=spec, self=parts, index=0)
        return p.replace(m, k)

    return rule("fold-times-two", Op(MUL, name="m", self=Const("w"), other=Const("two")), plan=fold)


@pytest.mark.parametrize(
    ("form", "via"), [*((f, "") for f in FORMS), *((f, v) for f in ("gm", "aten") for v in ("t", "split"))]
)
def test_an_output_moved_to_a_constant_the_plan_adds_or_a_view_of_it_is_declined(form: str, via: str) -> None:
    # a fold of ``w * two`` the program returns made it return the new constant itself (or a view of
    # it): a caller writing into its output changed every later call's (102 after an ``add_(100)``)
    x = torch.randn(2, 2)
    for returned in (True, False):
        program, reference = build(TimesTwo(returned), (x,), form), build(TimesTwo(returned), (x,), form)
        outcome = adapters.transform(program, [_folded(via)]).unwrap()
        if not returned:  # (where the program only reads it, the fold applies)
            assert outcome.changed and count(program, "aten.mul") == 0
            assert_close(run(program, (x,)), run(reference, (x,)))
            continue
        assert not outcome.changed and [j.reason.code for j in outcome.report.rejections] == ["plan-conflict"]
        assert "which the program holds (a constant the plan adds)" in outcome.report.rejections[0].reason.message
        for _ in range(2):
            got, want = run(program, (x,)), run(reference, (x,))
            assert_close(got, want)
            got[1].add_(100.0)  # the caller writes into what it got back


class ViewNamedT(TimesTwo):
    """Returns ``w * two`` beside a view of a computed tensor, which export names ``t``."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x * 3.0).t() + 1.0, self.w * self.two


@pytest.mark.parametrize("form", ["gm", "aten"])
def test_a_new_constant_named_as_a_node_is_taken_as_the_plans_own(form: str) -> None:
    # a review: a fold's constant named ``t``, as the program's view ``t`` of ``x * 3`` is, was
    # looked up as that node (a view of no held tensor): the output became the constant itself
    x = torch.randn(2, 2)
    program, reference = build(ViewNamedT(True), (x,), form), build(ViewNamedT(True), (x,), form)
    gm = program.graph_module if isinstance(program, ExportedProgram) else program
    assert isinstance(gm, torch.fx.GraphModule) and "t" in {n.name for n in gm.graph.nodes}
    outcome = adapters.transform(program, [_folded("", name="t")]).unwrap()
    assert not outcome.changed and "would return t itself" in outcome.report.rejections[-1].reason.message
    got = run(program, (x,))
    got[1].add_(100.0)
    assert_close(run(program, (x,)), run(reference, (x,)))


def test_apply_declines_an_op_the_edge_programs_verifier_refuses_as_transform_does() -> None:
    program = _edge(preserve=False)
    before = program.graph_module.code
    plans = plan(adapters.capture(program), [TO_LINEAR]).plans
    assert len(plans) == 1  # the core plans it: only the program's verifier knows the op is refused
    failure = adapters.apply(program, plans).failure()
    assert failure.code == "op-not-allowed" and "aten.linear.default" in failure.message
    assert program.graph_module.code == before
    validate(program)


@pytest.mark.parametrize("form", FORMS)
def test_a_later_rule_naming_its_node_as_a_node_an_earlier_rule_erased_applies(form: str) -> None:
    # found by an outside author: the commit matches the first snapshot's nodes and the last's by
    # name, so a reused name was taken for the node it replaced (apply-failed, two valid rules)
    def _again(p: Planner, r: Bound, x: NodeRef) -> RewritePlan:
        return p.replace(r, p.call("aten.relu.default", name="mul", spec=r.node.spec, self=x))

    respell = rule("respell-relu", Op(RELU, name="r", self=Var("x")), plan=_again)
    program = build(Scaled(), X, form)
    mul = next(n.name for n in program.graph.nodes if "mul" in str(n.target))
    outcome = adapters.transform(program, [DROP, respell])
    assert outcome.unwrap().changed and count(program, "mul") == 0 and count(program, "relu") == 1
    assert mul in outcome.unwrap().report.after.reserved
    assert_sound(program, X, [torch.relu(X[0]) + 1.0])


@pytest.mark.parametrize("target", ["aten.does_not_exist.default", "aten.relu.__call__", "aten.relu.overloads"])
def test_an_op_torch_does_not_have_fails_a_dry_run_as_it_fails_the_transform(target: str) -> None:
    # explain (a dry run) said "will rewrite" where apply failed unknown-op; a name of the op's
    # packet that is no overload (a hunt, forty-eighth session) was written, and the program broken
    bogus = rule(
        "bogus",
        Op(RELU, name="r", self=Var("x")),
        plan=lambda p, r, x: p.replace(r, p.node(target, (x,), name="n", spec=r.node.spec)),
    )
    for dry_run in (True, False):
        program = build(Relu(), X, "aten")
        code = str(program.graph)
        failure = adapters.transform(program, [bogus], dry_run=dry_run).failure()
        assert failure.code == "unknown-op" and target in failure.message
        assert failure.message.endswith("(a plan of rule 'bogus' at relu)")  # (an outside author: say whose)
        assert str(program.graph) == code


def test_an_op_whose_library_does_not_import_is_an_unknown_op_and_the_program_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a hunt (forty-eighth session): the ImportError escaped transform as a traceback
    resolve_target.cache_clear()
    monkeypatch.setitem(sys.modules, OP_LIBRARIES["et_vk"], None)  # (importing it raises ImportError)
    vk = rule(
        "vk",
        Op(RELU, name="r", self=Var("x")),
        plan=lambda p, r, x: p.replace(r, p.node("et_vk.q8ta_add.default", (x,), name="n", spec=r.node.spec)),
    )
    program = build(Relu(), X, "aten")
    code = str(program.graph)
    failure = adapters.transform(program, [vk]).failure()
    monkeypatch.undo()
    assert failure.code == "unknown-op" and f"{OP_LIBRARIES['et_vk']} does not import" in failure.message
    assert str(program.graph) == code


# conv(x * s) -> conv(x): the conv keeps its spec, whatever x is (the check of x's shape forgotten)
READ_X = rule(
    "read-x",
    Op(CONV, name="conv", input=Op(MUL, name="mul", self=Var("x"), other=Var("s"))),
    plan=lambda p, conv, x: p.replace(conv, p.respell(conv, input=x)),
)
SCALE = torch.tensor([0.5, 2.0, 4.0]).reshape(1, 3, 1, 1)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(
    ("x", "why"),
    [
        # (edge's convolution takes no unbatched input at all)
        (
            torch.randn(3, 16, 16),
            r"computes float32\[8, 14, 14\], its plan declares float32\[1, 8, 14, 14\]$|"
            "cannot run: RuntimeError: Expected 4-dimensional input",
        ),
        (torch.randn(2, 1, 16, 16), r"cannot run: RuntimeError: Given groups=1, weight of size \[8, 3, 3, 3\]"),
    ],
)
def test_a_new_node_computing_other_than_its_plan_declares_is_declined(form: str, x: torch.Tensor, why: str) -> None:
    # x * s broadcasts x (adds its batch dim, or its channels): the conv reading x itself returns an
    # unbatched value where the program's readers and meta expect a batched one, or fails to run
    model = ScaledConv(SCALE).eval()
    program = build(model, (x,), form)
    outcome = adapters.transform(program, [READ_X]).unwrap()
    assert outcome.report.plans == () and not outcome.changed
    ((rejection,),) = [outcome.report.rejections]
    assert (rejection.reason.code, rejection.reason.path) == ("plan-conflict", "plan")
    assert re.search(why, rejection.reason.message)
    assert torch.equal(run(program, (x,))[0], model(x))


@pytest.mark.parametrize("form", ["aten", "edge"])
@pytest.mark.parametrize(
    ("x", "dim", "why"),
    [
        (
            torch.randn(2, 1, 16, 16),
            0,
            r"cannot run \(at the sizes the program was exported at\): RuntimeError: Given groups",
        ),
        (
            torch.randn(3, 16, 16),
            1,
            r"computes float32\[8, 14, 14\] \(at the sizes the program was exported at\), "
            r"its plan declares float32\[1, 8, |"
            r"cannot run \(at the sizes the program was exported at\): RuntimeError: Expected 4-dimensional input",
        ),
    ],
)
def test_a_new_node_of_symbolic_sizes_runs_at_the_example_sizes(form: str, x: torch.Tensor, dim: int, why: str) -> None:
    # a dynamic dim left every plan unchecked: the broken conv applied, and the program either
    # failed to run or returned an unbatched value for a batched one
    model = ScaledConv(SCALE).eval()
    ep = torch.export.export(model, (x,), dynamic_shapes=({dim: torch.export.Dim("d", min=2 + 2 * dim, max=64)},))
    program = to_edge(ep).exported_program() if form == "edge" else ep
    outcome = adapters.transform(program, [READ_X]).unwrap()
    assert outcome.report.plans == () and not outcome.changed
    ((rejection,),) = [outcome.report.rejections]
    assert (rejection.reason.code, rejection.reason.path) == ("plan-conflict", "plan")
    assert re.search(why, rejection.reason.message), rejection.reason.message
    bigger = torch.randn(*[8 if i == dim else n for i, n in enumerate(x.shape)])
    assert torch.equal(run(program, (bigger,))[0], model(bigger))


# relu(x) -> x repeated twice along dim 0, declared as relu's value: another size where it is symbolic
TWICE = rule(
    "twice",
    Op(RELU, name="r", self=Var("x")),
    plan=lambda p, r, x: p.replace(r, p.node("aten.repeat.default", (x, (2, 1)), name="t", spec=r.node.spec)),
)


@pytest.mark.parametrize("form", ["aten", "edge"])
def test_a_new_node_of_another_symbolic_size_than_declared_is_declined(form: str) -> None:
    # its declared size is the batch, s0, which a computed 2 * 4 did not contradict: the program
    # returned twice the rows
    ep = torch.export.export(Relu(), (torch.randn(4, 6),), dynamic_shapes=({0: torch.export.Dim("b", max=64)},))
    program = to_edge(ep).exported_program() if form == "edge" else ep
    outcome = adapters.transform(program, [TWICE]).unwrap()
    assert outcome.report.plans == () and not outcome.changed
    ((rejection,),) = [outcome.report.rejections]
    assert rejection.reason.code == "plan-conflict"
    assert re.search(
        r"computes float32\[8, 6\] .*declares float32\[s\d+, 6\] \(float32\[4, 6\] there\)$", rejection.reason.message
    )
    x = torch.randn(5, 6)
    assert torch.equal(run(program, (x,))[0], torch.relu(x) * 2)


def test_a_new_node_computing_what_its_plan_declares_plans() -> None:
    program = build(ScaledConv(SCALE).eval(), (torch.randn(2, 3, 16, 16),), "aten")
    report = adapters.transform(program, [READ_X], dry_run=True).unwrap().report
    assert [p.anchor for p in report.plans] == ["conv2d"] and report.rejections == ()


def test_a_new_in_place_node_is_not_run_on_the_programs_own_fake_values() -> None:
    # transpose_ run on x's fake value would turn the program's meta of x (2, 3) into (3, 2)
    program = build(Relu(), (torch.randn(2, 3),), "aten")
    in_place = rule(
        "in-place",
        Op(RELU, name="r", self=Var("x")),
        plan=lambda p, r, x: p.replace(r, p.node("aten.t_.default", (x,), name="t", spec=r.spec)),
    )
    adapters.transform(program, [in_place], dry_run=True).unwrap()
    (x,) = [n for n in program.graph.nodes if n.op == "placeholder"]
    assert tuple(x.meta["val"].shape) == (2, 3)


class Halves(torch.nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, dim=-1) if self.how == "chunk" else torch.split(x, 4, dim=-1)
        return a * torch.sigmoid(b)


def _to_slice(p: Planner, item: Bound, split: Bound, x: NodeRef) -> RewritePlan:
    i, sizes = item.int("index"), split.ints("split_sizes")
    start, end = sum(sizes[:i]), sum(sizes[: i + 1])
    dim = split.int("dim")
    target = "aten.slice_copy.Tensor" if p.dialect == "edge" else "aten.slice.Tensor"
    return p.replace(item, p.call(target, name="s", spec=item.spec, self=x, dim=dim, start=start, end=end))


SLICES = rule(
    "slices", Op(GETITEM, name="item", self=Op(SPLIT, name="split", users=ANY, self=Var("x"))), plan=_to_slice
)


@pytest.mark.parametrize("how", ["chunk", "split"])
@pytest.mark.parametrize("form", FORMS)
def test_every_spelling_of_a_split_is_one(form: str, how: str) -> None:
    # found by an outside author: an aten program's chunk and split.Tensor were declined wrong-op
    program, x = build(Halves(how), (torch.randn(3, 8),), form), (torch.randn(3, 8),)
    want = run(program, x)
    outcome = adapters.transform(program, [SLICES]).unwrap()
    assert len(outcome.report.plans) == 2 and outcome.report.rejections == ()
    assert_close(run(program, x), want)


def test_a_convert_pt2e_module_s_constants_have_their_tensors_specs() -> None:
    # found by a hunt: convert_pt2e's get_attr nodes carry no meta["val"], so their nodes had no
    # spec, and a kit rule reading the int8 weight through Var declined malformed-node ("input has no
    # known dtype") where GraphBuilder(lifted=False), and the same module exported, plan
    gm = pt2e_module(torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3)), (torch.randn(1, 4, 8, 8),))
    snap = adapters.capture(gm)
    held = [n for n in snap.nodes if n.op == "get_attr" and n.name in snap.constants]
    assert len(held) >= 4 and all(n.spec == snap.constants[n.name].spec for n in held)


class TimesOne(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) * 1.0 + torch.relu(x) * 3.0


def _one(match: Match) -> Reason | None:
    return None if match.values("k") == (1.0,) else Declined(code="not-one", node="mul", detail="not times one")


# x * 1.0 -> x, the number as the program holds it: a Python number, or a 0-d tensor on edge
TIMES_ONE = rule(
    "times-one",
    Op(MUL, name="mul", commute=True, self=Var("x"), other=OneOf(Scalar("k"), Const("k"))),
    need.check(_one, codes=("not-one",)),
    plan=lambda p, mul, x: p.replace(mul, x),
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("form", FORMS)
def test_a_rule_reads_the_number_an_edge_program_lifts_as_a_tensor(form: str, dtype: torch.dtype) -> None:
    # found by a hunt: on edge, the 1.0 of x * 1.0 is a lifted 0-d tensor whose value no rule could
    # read (Match.values gave None), so a rule removing it fired on aten and never on edge; and (a
    # later hunt) in a float16 edge program, where the float32 1.0 is cast to float16
    x = (torch.randn(2, 3, dtype=dtype),)
    program = build(TimesOne().eval(), x, form)
    want = run(program, x)
    outcome = adapters.transform(program, [TIMES_ONE]).unwrap()
    assert len(outcome.report.plans) == 1
    assert [r.reason.code for r in outcome.report.rejections] == ["not-one"]
    assert count(program, "mul") == 1
    assert_close(run(program, x), want)


class _AddWeight(torch.nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(w, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.w)


def _within_rule() -> Rule:
    """``x + w`` read through a new constant ``Within(w, -1, 1)``: applied where every value of ``w``
    lies in [-1, 1], declined ``value-range`` elsewhere."""

    def checked(p: Planner, add: Bound, w: WeightExpr) -> RewritePlan:
        return p.replace(add, p.respell(add, other=p.const(Within(x=w, low=-1, high=1), "w_checked")))

    pattern = Op(ADD, name="add", self=Var("x"), other=Const("w"))
    return rule("checked-add", pattern, plan=checked, codes=("value-range",))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(("poke", "span"), [(None, None), (2.5, "2.5 to 2.5"), (float("nan"), "NaN")])
def test_a_within_holds_or_its_plan_is_declined_value_range(form: str, poke: float | None, span: str | None) -> None:
    w = torch.linspace(-1, 1, 6)
    if poke is not None:
        w[4] = poke
    x = (torch.randn(2, 6),)
    model = _AddWeight(w)
    program = build(model, x, form)
    before = run(program, x)
    code = program.graph_module.code if isinstance(program, ExportedProgram) else program.code
    for dry_run in (True, False):
        outcome = adapters.transform(program, [_within_rule()], dry_run=dry_run).unwrap()
        if span is None:
            assert len(outcome.report.plans) == 1 and outcome.report.rejections == ()
            continue
        (r,) = outcome.report.rejections
        assert (r.reason.code, r.reason.path) == ("value-range", "plan.w_checked") and not outcome.report.plans
        assert r.reason.message.endswith(f"w_checked needs values in [-1, 1]; 1 of them are {span}")
        assert not outcome.changed
    if span is not None:  # plans made apart and applied: apply checks them as transform does
        failed = adapters.apply(program, plan(adapters.capture(program), [_within_rule()]))
        assert isinstance(failed, Failure) and failed.failure().code == "value-range"
    if span is None:
        assert_close(run(program, x), before)
    else:
        assert (program.graph_module.code if isinstance(program, ExportedProgram) else program.code) == code
        assert torch.equal(run(program, x)[0].isnan(), before[0].isnan())


def test_a_within_compares_values_as_numbers_whatever_their_dtype() -> None:
    # found by a review: torch cast an int bound to the value's dtype (-1 to 255 for uint8) and
    # declined a range every value lay in; a bound past int64 failed the whole transform
    w = torch.arange(6, dtype=torch.float32)

    def cast(p: Planner, add: Bound, w: WeightExpr) -> RewritePlan:
        inside = Within(x=Cast(x=w, dtype="uint8"), low=-1, high=2**70)
        return p.replace(add, p.respell(add, other=p.const(Cast(x=inside, dtype="float32"), "w_checked")))

    r = rule("cast-add", Op(ADD, name="add", self=Var("x"), other=Const("w")), plan=cast, codes=("value-range",))
    x = (torch.randn(2, 6),)
    program = build(_AddWeight(w), x, "aten")
    before = run(program, x)
    outcome = adapters.transform(program, [r]).unwrap()
    assert len(outcome.report.plans) == 1 and outcome.report.rejections == ()
    assert_close(run(program, x), before)  # (0..5 survive the cast to uint8)


@pytest.mark.parametrize(
    ("values", "low", "high", "declined"),
    [
        ([0, 5, 2**62], -10, 2**62, False),
        ([0, 5, 2**62 + 1], -10, 2**62, True),
        ([-(2**63), 0, 5], -(2**63), 9, False),
        ([-(2**63), 0, 5], -(2**63) + 1, 9, True),
    ],
)
def test_a_within_compares_int64_values_exactly(values: list[int], low: int, high: int, declined: bool) -> None:
    """Past 2**53, float64 rounds an int64: ``2**62 + 1`` compared as a float64 lay in ``[-10, 2**62]``,
    and the plan was applied (a wrapped nibble, say, written silently). ``evaluate`` agrees."""

    def checked(p: Planner, add: Bound, w: WeightExpr) -> RewritePlan:
        return p.replace(add, p.respell(add, other=p.const(Within(x=w, low=low, high=high), "w_checked")))

    r = rule("checked-add", Op(ADD, name="add", self=Var("x"), other=Const("w")), plan=checked, codes=("value-range",))
    program = build(_AddWeight(torch.tensor(values, dtype=torch.int64)), (torch.randn(2, 3),), "aten")
    outcome = adapters.transform(program, [r]).unwrap()
    assert [rej.reason.code for rej in outcome.report.rejections] == (["value-range"] if declined else [])
    assert len(outcome.report.plans) == (0 if declined else 1)
    w = Source(key="w", spec=TensorSpec(shape=(3,), dtype="int64"))
    assert isinstance(evaluate(Within(x=w, low=low, high=high), {"w": values}), Failure) is declined


def _to_int8(how: str, w: WeightExpr) -> WeightExpr:
    """``w`` made int8 and back to float32, three ways: a cast of ``w * 100``, a sum (which casts
    first) of it over a dim of one, and a quantization of ``w`` by 0.01 (which clamps)."""
    scaled = Binary(op="mul", a=w, b=Fill(shape=(), value=100.0, dtype="float32"))
    if how == "cast":
        return Cast(x=Cast(x=scaled, dtype="int8"), dtype="float32")
    if how == "plain":
        return Cast(x=Cast(x=w, dtype="int8"), dtype="float32")
    if how == "wrapped":  # an int32 made int8 wraps, as defined: no float is cast out of range
        return Cast(x=Cast(x=Cast(x=w, dtype="int32"), dtype="int8"), dtype="float32")
    if how == "packed":  # int4 values: the cast is computed first, and fails first
        five = Binary(op="mul", a=w, b=Fill(shape=(), value=5.0, dtype="float32"))
        return Cast(x=Within(x=Cast(x=five, dtype="int8"), low=-8, high=7), dtype="float32")
    if how == "sum":
        return Cast(x=SumOver(x=Unsqueeze(x=scaled, dim=0), dims=(0,), dtype="int8"), dtype="float32")
    scale = Fill(shape=(), value=0.0 if how == "zero-scale" else 0.01, dtype="float32")
    zero = Fill(shape=(), value=0, dtype="int32")
    q = Quantize(x=w, scale=scale, zero_point=zero, axis=None, quant_min=-128, quant_max=127, dtype="int8")
    return Dequantize(x=q, scale=scale, zero_point=zero, axis=None)


CAST = "values a cast to int8 holds, [-128, 127] once truncated"


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(
    ("how", "poke", "needs"),
    [
        ("cast", None, None),
        ("cast", 2.5, f"{CAST}; 1 of them are 250 to 250"),
        ("cast", float("nan"), f"{CAST}; 1 of them are NaN"),
        ("sum", 2.5, f"{CAST}; 1 of them are 250 to 250"),
        ("quantize", 2.5, None),  # (clamped to 127)
        ("plain", 127.5, None),  # (127 once truncated)
        ("plain", -128.9, None),
        ("plain", 128.0, f"{CAST}; 1 of them are 128 to 128"),
        ("plain", -129.0, f"{CAST}; 1 of them are -129 to -129"),
        ("wrapped", 200.0, None),
        ("packed", 3.0, "values in [-8, 7]; 1 of them are 15 to 15"),
        ("packed", 30.0, f"{CAST}; 1 of them are 150 to 150"),
        ("quantize", float("nan"), "numbers to quantize, no NaN; 1 of them are NaN"),
        ("zero-scale", 0.5, None),  # (w / 0: infinities, clamped)
        ("zero-scale", 0.0, "numbers to quantize, no NaN; 1 of them are NaN"),  # (0 / 0)
    ],
)
def test_a_float_made_an_integer_it_does_not_fit_is_declined_value_range(
    form: str, how: str, poke: float | None, needs: str | None
) -> None:
    """torch leaves a float cast to an integer dtype that cannot hold it undefined (300.0 as int8 is
    what the CPU makes of it, NaN too; a quantization clamps, but casts a NaN so): a plan computing
    one is declined, as ``evaluate`` refuses it."""

    def rounded(p: Planner, add: Bound, w: WeightExpr) -> RewritePlan:
        return p.replace(add, p.respell(add, other=p.const(_to_int8(how, w), "w_int8")))

    r = rule("int8-add", Op(ADD, name="add", self=Var("x"), other=Const("w")), plan=rounded, codes=("value-range",))
    w = torch.linspace(-1, 1, 6)
    if poke is not None:
        w[4] = poke
    x = (torch.randn(2, 6),)
    program = build(_AddWeight(w), x, form)
    outcome = adapters.transform(program, [r]).unwrap()
    if needs is None:
        assert len(outcome.report.plans) == 1 and outcome.report.rejections == ()
        return
    (no,) = outcome.report.rejections
    assert (no.reason.code, no.reason.path) == ("value-range", "plan.w_int8") and not outcome.changed
    assert no.reason.message.endswith(f"w_int8 needs {needs}")
    failed = adapters.apply(program, plan(adapters.capture(program), [r]))
    assert isinstance(failed, Failure) and failed.failure().code == "value-range"

"""Rules whose replacement has other strides than the value it replaces (linear-to-conv2d on a rank 3
or 4 input, conv1d-to-conv2d, concat-parallel-linears' slices) leave alone a value an ``aten.view``
merges dims of: the view needs the value's own strides and fails at run time on others. Found by a
composed-rule fuzzer: before, each program here was transformed and then failed to run in the aten
forms. A view that only splits dims still lets the rule apply, and edge (``view_copy``) always does."""

from __future__ import annotations

import pytest
import torch

import adapters
from fxpure.rules import RULES
from tests.programs import FORMS, assert_close, assert_sound, build, dead_constants, run, validate


class TransposedLinear(torch.nn.Module):
    """A linear on a transposed input, its output flattened by a view (merging) or split into heads."""

    def __init__(self, merge: bool) -> None:
        super().__init__()
        self.merge = merge
        self.q = torch.nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.q(x.transpose(1, 2))
        return y.view(y.shape[0], -1) if self.merge else y.view(y.shape[0], y.shape[1], 2, 3)


class TransposedConv1d(torch.nn.Module):
    """A conv1d on a (batch, time, channels) input moved to channels first, its output flattened."""

    def __init__(self, merge: bool) -> None:
        super().__init__()
        self.merge = merge
        self.conv = torch.nn.Conv1d(4, 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.conv(x.transpose(1, 2))
        return y.view(y.shape[0], -1) if self.merge else y.view(y.shape[0], 2, 3, -1)


class ViewedKV(torch.nn.Module):
    """Two linears on one input; K flattened by a view (merging) or split into heads."""

    def __init__(self, merge: bool) -> None:
        super().__init__()
        self.merge = merge
        self.k = torch.nn.Linear(8, 4)
        self.v = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.k(x)
        return (k.view(-1) if self.merge else k.view(2, 3, 2, 2)), self.v(x)


CASES = {
    "linear-to-conv2d": (TransposedLinear, (2, 8, 3)),
    "conv1d-to-conv2d": (TransposedConv1d, (2, 7, 4)),
    "concat-parallel-linears": (ViewedKV, (2, 3, 8)),
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("merge", [True, False], ids=["merging-view", "splitting-view"])
@pytest.mark.parametrize("rule", CASES)
def test_a_view_that_needs_the_values_strides_keeps_it_and_the_program_runs(rule: str, merge: bool, form: str) -> None:
    make, shape = CASES[rule]
    model = make(merge).eval()
    x = (torch.randn(*shape),)
    want = run(build(model, x, "aten"), x)
    for rules in ([RULES[rule]()], [m() for m in RULES.values()]):
        program = build(model, x, form)
        report = adapters.transform(program, rules).unwrap().report
        ours = [p for p in report.plans if p.rule == rule]
        declined = [j for j in report.rejections if j.rule == rule and j.reason.code == "layout-sensitive-reader"]
        if merge and form != "edge":
            assert not ours and len(declined) == 1 and "by its strides" in declined[0].reason.message
        else:  # (edge spells a linear on a transposed input as a bmm: converted too)
            assert not declined and ours
        assert_sound(program, x, want)


class Behind(torch.nn.Module):
    """A linear on a transposed input, then a relu, then a merging view or a read by strides (which
    read other values, with no error, before)."""

    def __init__(self, strided: bool) -> None:
        super().__init__()
        self.strided = strided
        self.q = torch.nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.q(x.transpose(1, 2)))
        return torch.as_strided(y, (2, 3, 6), (18, 6, 1)) if self.strided else y.view(2, -1)


class ContiguousMerge(torch.nn.Module):
    """Swin's window_reverse: two linears' outputs permuted, made contiguous, then merged by a view."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x).permute(0, 2, 1, 3).contiguous().view(2, 6, 32)
        z = self.b(x).permute(0, 2, 1, 3).contiguous().view(2, 6, 32)
        out: torch.Tensor = y + z
        return out


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rule", ["linear-to-conv2d", "concat-parallel-linears"])
def test_a_view_after_contiguous_takes_any_strides(rule: str, form: str) -> None:
    # found by a hunt on Swin: the view was taken to need the linears' strides, and both rules
    # declined layout-sensitive-reader; contiguous() lays its result out afresh, whatever it reads
    model, x = ContiguousMerge().eval(), (torch.randn(2, 4, 6, 8),)
    program = build(model, x, form)
    want = run(program, x)
    report = adapters.transform(program, [RULES[rule]()]).unwrap().report
    assert len(report.plans) == (2 if rule == "linear-to-conv2d" else 1) and report.rejections == ()
    assert_sound(program, x, want)


class ChannelsLastGroups(torch.nn.Module):
    """A grouped conv read by strides: on a channels-last input its output is channels last, the
    split's cat is not."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(8, 6, 3, padding=1, groups=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.conv(x)
        return torch.as_strided(y, y.shape, (120, 20, 5, 1))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("strided", [False, True], ids=["view", "as_strided"])
def test_a_reader_behind_a_relu_keeps_the_value_too(strided: bool, form: str) -> None:
    model, x = Behind(strided).eval(), (torch.randn(2, 8, 3),)
    program = build(model, x, form)
    want = run(program, x)
    report = adapters.transform(program, [m() for m in RULES.values()]).unwrap().report
    # (edge spells this linear as a bmm; its view_copy reads values, its as_strided strides)
    declined = [j.reason.code for j in report.rejections if j.rule == "linear-to-conv2d"]
    assert declined == (["layout-sensitive-reader"] if form != "edge" or strided else [])
    assert_sound(program, x, want)


@pytest.mark.parametrize("form", FORMS)
def test_a_grouped_conv_read_by_strides_is_not_split(form: str) -> None:
    model = ChannelsLastGroups().eval()
    x = (torch.randn(2, 8, 4, 5).contiguous(memory_format=torch.channels_last),)
    program = build(model, x, form)
    want = run(program, x)  # (edge reads by its own layout: compared with itself)
    report = adapters.transform(program, [RULES["split-group-conv"]()]).unwrap().report
    assert not report.plans and [j.reason.code for j in report.rejections] == ["layout-sensitive-reader"]
    assert_sound(program, x, want)


class ViewedInBranch(torch.nn.Module):
    """Two linears on one input; K merged by a view inside a ``torch.cond`` branch, or inside a
    ``torch.no_grad()`` region (which export makes a graph of its own)."""

    def __init__(self, cond: bool) -> None:
        super().__init__()
        self.cond = cond
        self.k, self.v = torch.nn.Linear(8, 6), torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.k(x)
        if self.cond:
            flat: torch.Tensor = torch.cond(x.sum() > 0, lambda a: a.view(-1) + 1, lambda a: a.view(-1) - 1, (k,))
        else:
            with torch.no_grad():
                flat = k.view(-1)
        return flat, self.v(x)


@pytest.mark.parametrize("form", ["gm", "aten"])
@pytest.mark.parametrize("cond", [True, False], ids=["cond", "no-grad"])
def test_a_value_a_graph_of_its_own_reads_keeps_its_strides_and_the_program_runs(cond: bool, form: str) -> None:
    model, x = ViewedInBranch(cond).eval(), (torch.randn(5, 8),)
    program = build(model, x, form)
    want = run(build(model, x, "aten"), x)
    report = adapters.transform(program, [RULES["concat-parallel-linears"]()]).unwrap().report
    (declined,) = [j.reason for j in report.rejections if j.reason.code == "layout-sensitive-reader"]
    assert "in a graph of its own" in declined.message and not report.plans
    assert_sound(program, x, want)


class WindowReverse(torch.nn.Module):
    """Swin's window reverse after the output projection: a view splitting the (dynamic) batch of
    windows into the batch and the window grid."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        y = self.proj(o).view(b, h // 2, w // 2, 2, 2, c)
        out: torch.Tensor = y.permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c) + x
        return out


def test_a_view_splitting_a_symbolic_product_takes_any_strides() -> None:
    model, x = WindowReverse().eval(), (torch.randn(2 * 4, 4, 8), torch.randn(2, 4, 4, 8))
    batch = torch.export.Dim("B", min=1, max=16)
    ep = torch.export.export(model, x, dynamic_shapes={"o": {0: 4 * batch}, "x": {0: batch}})
    outcome = adapters.transform(ep, [RULES["linear-to-conv2d"]()]).unwrap()
    assert len(outcome.report.plans) == 1 and outcome.report.rejections == ()
    for n in (2, 3):
        y = (torch.randn(4 * n, 4, 8), torch.randn(n, 4, 4, 8))
        assert_close(run(ep, y), run(torch.export.export(model, y), y))


class ReadAs(torch.nn.Module):
    """A conv1d on a transposed input whose output is read by another view that needs its strides."""

    def __init__(self, reader: str) -> None:
        super().__init__()
        self.reader = reader
        self.conv = torch.nn.Conv1d(4, 6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.conv(x.transpose(1, 2))
        return y.view_as(torch.empty(y.numel())) if self.reader == "view_as" else y.view(torch.int16)


@pytest.mark.parametrize(
    ("reader", "form"),
    [*(("view_as", form) for form in FORMS), ("view.dtype", "gm"), ("view.dtype", "aten")],  # (no edge op)
)
def test_other_views_that_need_the_values_strides_keep_it_too(reader: str, form: str) -> None:
    # found by a hunt: view_as and a view as a dtype of another size are no aten.view, and the
    # conv1d was converted; the program then failed to run ("view size is not compatible")
    model, x = ReadAs(reader).eval(), (torch.randn(2, 3, 4),)
    program = build(model, x, form)
    want = run(program, x)
    report = adapters.transform(program, [RULES["conv1d-to-conv2d"]()]).unwrap().report
    if form != "edge":  # (edge spells views as copies)
        assert [j.reason.code for j in report.rejections] == ["layout-sensitive-reader"] and not report.plans
    assert_sound(program, x, want)


class MethodReaders(torch.nn.Module):
    """Two linears of one rank-3 input and a conv1d, as a ``symbolic_trace`` graph keeps aten calls,
    their results read by a tensor method of their strides (``how``): ``view`` merging dims, or
    ``as_strided``; or through a method passing the strides on first (``relu().view``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.q, self.k = torch.nn.Parameter(torch.randn(6, 8)), torch.nn.Parameter(torch.randn(4, 8))
        self.c = torch.nn.Parameter(torch.randn(6, 4, 3))

    def read(self, y: torch.Tensor) -> torch.Tensor:
        if self.how == "view":
            return y.view(-1)
        if self.how == "relu().view":
            return y.relu().view(-1)
        return y.as_strided((y.numel(),), (1,))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        aten = torch.ops.aten
        q, k = aten.linear.default(x, self.q), aten.linear.default(x, self.k)
        return self.read(q), self.read(k), self.read(aten.conv1d.default(c, self.c))


@pytest.mark.parametrize("how", ["view", "relu().view", "as_strided"])
def test_a_traced_graphs_method_reading_strides_is_a_layout_sensitive_reader(how: str) -> None:
    # found by a hunt: in a symbolic_trace graph ``q.view(-1)`` was no reader of strides, so the
    # linears were joined (or made convs): the view then failed, and as_strided read other values
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    x = (torch.randn(2, 5, 8), torch.randn(2, 4, 9))
    model = MethodReaders(how)
    gm = torch.fx.symbolic_trace(model)
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*x)
    rules = [RULES[r]() for r in ("concat-parallel-linears", "linear-to-conv2d", "conv1d-to-conv2d")]
    outcome = adapters.transform(gm, rules).unwrap()
    assert not outcome.changed
    codes = {(j.rule, j.node): j.reason.code for j in outcome.report.rejections}
    for r, node in [("linear-to-conv2d", "linear_default"), ("conv1d-to-conv2d", "conv1d_default")]:
        assert codes[(r, node)] == "layout-sensitive-reader"
    assert_close(run(gm, x), run(torch.fx.symbolic_trace(model), x))


class EmptyCache(torch.nn.Module):
    """Q, K and V linears, and a cache of length 0 flattened by a merging view elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.q(x), self.k(x), self.v(x), cache.view(-1, 4)


@pytest.mark.parametrize("decomposed", [False, True], ids=["aten", "decomposed"])
def test_a_merging_view_of_an_empty_tensor_takes_any_strides(decomposed: bool) -> None:
    # a view of no elements works whatever the strides: the check of which views need them divided
    # by the empty size, and every rule's transform raised ZeroDivisionError (found by a hunt)
    model, x = EmptyCache().eval(), (torch.randn(2, 3, 4), torch.randn(2, 0, 4))
    ep = torch.export.export(model, x)
    program = ep.run_decompositions() if decomposed else ep
    with torch.no_grad():
        want = list(model(*x))
    outcome = adapters.transform(program, [make() for make in RULES.values()]).unwrap()
    assert [p.rule for p in outcome.report.plans] == ["concat-parallel-linears", "linear-to-conv2d"]
    got = run(program, x)
    assert_close(got[:3], want[:3])
    assert got[3].shape == want[3].shape == (0, 4)
    assert dead_constants(program) == []
    validate(program)


class Methods(torch.nn.Module):
    """Tensor methods given their list one value at a time, and ones that take more than a list."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.permute(1, 0), x.view(-1), x.amax(1, True), x.roll(1, 0), x.split_with_sizes([2, 2], 1)[0]


def test_a_traced_method_is_read_as_its_aten_op_with_its_arguments() -> None:
    # ``w.permute(1, 0)`` was read as a permute of no list (a product of it went unreported); the
    # first reading of it packed every op's values after ``self`` (``x.amax(1, True)``: dim (1, True))
    from adapters.snap import _traced, capture_program

    view = _traced(capture_program(torch.fx.symbolic_trace(Methods()))).view
    assert view is not None
    read = {n.name: (n.target, n.args[1:]) for n in view.nodes if n.op == "call_function"}
    assert read == {
        "permute": ("aten.permute.default", ((1, 0),)),
        "view": ("aten.view.default", ((-1,),)),
        "amax": ("aten.amax.default", (1, True)),
        "roll": ("aten.roll.default", (1, 0)),
        "split_with_sizes": ("aten.split_with_sizes.default", ((2, 2), 1)),
        "getitem": ("getitem", (0,)),
    }

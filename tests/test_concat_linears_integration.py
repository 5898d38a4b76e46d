"""concat_parallel_linears end to end: attention blocks (Q/K/V, GQA), MLP and multi-head models in
every program form, numerics against eager, the ExecuTorch runtime, dynamic shapes, declines."""

from __future__ import annotations

import copy
import math
import operator

import pytest
import torch
from executorch.exir import EdgeCompileConfig, EdgeProgramManager, to_edge
from torch import nn
from torch.export import ExportedProgram
from torch.nn import functional as F

import adapters
from adapters.passes import RulesPass
from fxpure.reasons import NotConstant
from fxpure.rules.concat_parallel_linears import concat_parallel_linears
from tests.programs import Program, assert_close, assert_sound, run, run_pte
from tests.quantized import pt2e, pt2e_module

FORMS = ("gm", "aten", "edge", "edge-linear")
# a linear's product in every spelling (the oracle for "how many linears are left")
PRODUCTS = ("aten.linear.default", "aten.addmm.default", "aten.mm.default")


class Attention(nn.Module):
    """Self-attention: Q/K/V projections (GQA: ``kv_heads`` < ``heads`` gives smaller K/V), softmax
    attention, an output projection. ``bias``: for q, k, v."""

    def __init__(
        self, dim: int = 32, heads: int = 4, kv_heads: int = 4, bias: tuple[bool, bool, bool] = (True, True, True)
    ) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, heads * self.hd, bias=bias[0])
        self.k = nn.Linear(dim, kv_heads * self.hd, bias=bias[1])
        self.v = nn.Linear(dim, kv_heads * self.hd, bias=bias[2])
        self.o = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q = self.q(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(self.hd), dim=-1)
        out: torch.Tensor = self.o((att @ v).transpose(1, 2).reshape(b, t, d))
        return out


class SwiGLU(nn.Module):
    """Gate and up projections of one input (no bias), as in Llama's MLP."""

    def __init__(self, dim: int = 32, hidden: int = 48) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(F.silu(self.gate(x)) * self.up(x))
        return out


class Block(nn.Module):
    """Pre-norm transformer block: GQA attention (q bias only) and a SwiGLU MLP."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads=4, kv_heads=2, bias=(True, False, False))
        self.mlp = SwiGLU(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.n1(x))
        out: torch.Tensor = x + self.mlp(self.n2(x))
        return out


class Heads(nn.Module):
    """Four classifier heads of different sizes on one (batch, features) input, mixed bias."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(24, n, bias=i % 2 == 0) for i, n in enumerate((3, 5, 1, 7)))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(torch.relu(h(x)) if i == 1 else h(x) for i, h in enumerate(self.heads))


class Pair(nn.Module):
    """Two linears with bias on a rank-2 input (two addmm on edge)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 12), nn.Linear(16, 20)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.a(x).sum(-1, keepdim=True) * self.b(x)
        return out


class Computed(nn.Module):
    """K's weight is computed at run time from the input, so k cannot join; q and v (``lonely``:
    only q) can. (A weight computed from constants alone, ``self.wk * 2.0``, is a constant.)"""

    def __init__(self, lonely: bool = False) -> None:
        super().__init__()
        self.q, self.wk = nn.Linear(16, 8), nn.Parameter(torch.randn(6, 16))
        self.v = nn.ModuleList([] if lonely else [nn.Linear(16, 4, bias=False)])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (self.q(x), F.linear(x, self.wk * x.mean()), *(v(x) for v in self.v))


class Tied(nn.Module):
    """One weight read by two linears of x (one with bias) and by a linear of another input."""

    def __init__(self) -> None:
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(8, 16)), nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.w), F.linear(x, self.w, self.b), F.linear(y, self.w)


class Nested(nn.Module):
    """Two linears of x, and two linears of the first one's output (a group inside a group)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 12), nn.Linear(16, 8, bias=False)
        self.c, self.d = nn.Linear(12, 6, bias=False), nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a = self.a(x)
        return self.b(x), torch.relu(self.c(a)), self.d(a)


class HandWritten(nn.Module):
    """Projections written ``x @ W`` on weights stored (in, out), one with a bias added, beside an
    ``nn.Linear`` of the same input: one group of four."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.wq, self.wk = nn.Parameter(torch.randn(16, 16, generator=g)), nn.Parameter(torch.randn(16, 8, generator=g))
        self.wv, self.bv = nn.Parameter(torch.randn(16, 8, generator=g)), nn.Parameter(torch.randn(8, generator=g))
        self.g = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x @ self.wq, torch.relu(x @ self.wk), torch.addmm(self.bv, x, self.wv), self.g(x)


# name -> (model, input shape, linears joined per group)
MODELS: dict[str, tuple[type[nn.Module], tuple[int, ...], tuple[int, ...]]] = {
    "mha": (Attention, (2, 5, 32), (3,)),
    "block": (Block, (2, 5, 32), (3, 2)),
    "heads": (Heads, (6, 24), (4,)),
    "pair": (Pair, (6, 16), (2,)),
}
VARIANTS: dict[str, nn.Module] = {
    "mha_no_bias": Attention(bias=(False, False, False)),
    "gqa": Attention(heads=4, kv_heads=1, bias=(True, False, True)),
}


def model_of(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...], tuple[int, ...]]:
    torch.manual_seed(0)
    if name in VARIANTS:
        return copy.deepcopy(VARIANTS[name]).eval(), (torch.randn(2, 5, 32),), (3,)
    cls, shape, groups = MODELS[name]
    return cls().eval(), (torch.randn(*shape),), groups


def edge(model: nn.Module, x: tuple[torch.Tensor, ...], form: str, **export: object) -> EdgeProgramManager:
    ep = torch.export.export(copy.deepcopy(model), x, **export)  # type: ignore[arg-type]
    keep = EdgeCompileConfig(preserve_ops=[torch.ops.aten.linear.default]) if form == "edge-linear" else None
    return to_edge(ep, compile_config=keep)


def program(model: nn.Module, x: tuple[torch.Tensor, ...], form: str, **export: object) -> Program:
    """``gm``: unlifted GraphModule; ``aten``: torch.export; ``edge``: to_edge; ``edge-linear``:
    to_edge with aten.linear preserved."""
    if form in ("edge", "edge-linear"):
        return edge(model, x, form, **export).exported_program()
    ep = torch.export.export(copy.deepcopy(model), x, **export)  # type: ignore[arg-type]
    return ep.module() if form == "gm" else ep


def graph(p: Program) -> torch.fx.Graph:
    return p.graph_module.graph if isinstance(p, ExportedProgram) else p.graph


def products(p: Program) -> int:
    """Linears left, in whatever spelling (an edge op prints as ``<EdgeOpOverload: aten...>``)."""
    names = [str(n.target) for n in graph(p).nodes if n.op == "call_function"]
    return sum(1 for t in names for op in PRODUCTS if t == op or t.startswith(f"<EdgeOpOverload: {op}>"))


def eager(model: nn.Module, x: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    with torch.no_grad():
        out = model(*x)
    return list(out) if isinstance(out, tuple) else [out]


# every model in the cheap forms; on edge (lowered and run in ExecuTorch), one of each shape:
# GQA (rank 3, q with bias, k and v smaller), 4 heads (rank 2, mixed bias), 2 linears with bias (rank 2)
CASES = [(name, form) for name in [*MODELS, *VARIANTS] for form in ("gm", "aten")] + [
    ("gqa", "edge"),
    ("gqa", "edge-linear"),
    ("heads", "edge"),
    ("pair", "edge"),
]


@pytest.mark.parametrize(("name", "form"), CASES)
def test_joins_every_group_keeps_numerics_and_runs_in_executorch(name: str, form: str) -> None:
    model, x, groups = model_of(name)
    manager = edge(model, x, form) if form.startswith("edge") else None
    p = manager.exported_program() if manager is not None else program(model, x, form)
    before = products(p)
    outcome = adapters.transform(p, [concat_parallel_linears()]).unwrap()
    assert outcome.report.rejections == ()
    assert len(outcome.report.plans) == len(groups)
    assert products(p) == before - sum(n - 1 for n in groups)
    want = eager(model, x)
    assert_sound(p, x, want)
    if manager is not None:
        assert_close(run_pte(manager.to_executorch().buffer, x), want)


@pytest.mark.parametrize("form", ["gm", "aten", "edge"])
def test_projections_on_weights_stored_in_out_join_with_a_linear(form: str) -> None:
    # x @ W and addmm(b, x, W) with W (in, out): the joined weight holds their transposes
    torch.manual_seed(0)
    model, x = HandWritten().eval(), (torch.randn(6, 16),)
    manager = edge(model, x, form) if form == "edge" else None
    p = manager.exported_program() if manager is not None else program(model, x, form)
    outcome = adapters.transform(p, [concat_parallel_linears()]).unwrap()
    assert outcome.report.rejections == () and len(outcome.report.plans) == 1
    assert [n.meta["val"].shape[-1] for n in parts(p)] == [16, 8, 8, 4]
    want = eager(model, x)
    assert_sound(p, x, want)
    if manager is not None:
        assert_close(run_pte(manager.to_executorch().buffer, x), want)


def parts(p: Program) -> list[torch.fx.Node]:
    return [n for n in graph(p).nodes if n.name.endswith("_part")]


def test_each_linear_gets_its_columns_back() -> None:
    model, x, _ = model_of("gqa")
    p = program(model, x, "aten")
    adapters.transform(p, [concat_parallel_linears()]).unwrap()
    # q: 4 heads x 8 columns, k and v: 1 head x 8 (GQA), sliced off the last dim of one (2, 5, 48) output
    assert [n.args[1:] for n in parts(p)] == [(2, 0, 32), (2, 32, 40), (2, 40, 48)]
    assert [tuple(n.meta["val"].shape) for n in parts(p)] == [(2, 5, 32), (2, 5, 8), (2, 5, 8)]
    assert_sound(p, x, eager(model, x))


def test_split_spelling_lowers_and_runs_in_executorch() -> None:
    model, x, _ = model_of("heads")
    manager = edge(model, x, "edge")
    adapters.transform(manager.exported_program(), [concat_parallel_linears(split=True)]).unwrap()
    (split,) = (n for n in graph(manager.exported_program()).nodes if "split_with_sizes_copy" in str(n.target))
    assert split.args[1:] == ([3, 5, 1, 7], 1) and len(parts(manager.exported_program())) == 4
    want = eager(model, x)
    assert_sound(manager.exported_program(), x, want)
    assert_close(run_pte(manager.to_executorch().buffer, x), want)


@pytest.mark.parametrize("form", FORMS)
def test_dynamic_batch_and_sequence_keep_working(form: str) -> None:
    # edge: as a pass in EdgeProgramManager.transform (which re-verifies the program); aten: then to_edge
    model, x, _ = model_of("gqa")
    dims = ({0: torch.export.Dim("batch", min=1, max=4), 1: torch.export.Dim("seq", min=2, max=8)},)
    rule = concat_parallel_linears()
    manager = edge(model, x, form, dynamic_shapes=dims) if form.startswith("edge") else None
    if manager is not None and form == "edge":
        manager = manager.transform([RulesPass([rule])])
    p = manager.exported_program() if manager else program(model, x, form, dynamic_shapes=dims)
    if form != "edge":
        assert len(adapters.transform(p, [rule]).unwrap().report.plans) == 1
    assert len(parts(p)) == 3
    for n in parts(p):
        assert not isinstance(n.meta["val"].shape[0], int) and not isinstance(n.meta["val"].shape[1], int)
    shapes = [(torch.randn(*shape),) for shape in ((1, 3, 32), (4, 8, 32))]
    for other in shapes:
        assert_sound(p, other, eager(model, other))
    if form == "aten":
        assert isinstance(p, ExportedProgram)
        manager = to_edge(p)
    buffer = manager.to_executorch().buffer if manager is not None else b""
    for other in shapes if buffer else ():
        assert_close(run_pte(buffer, other), eager(model, other))


class ChannelsLast(nn.Module):
    """Three linears of a permuted rank 4 input (a ConvNeXt block's pointwise MLP reads one so)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 4), nn.Linear(3, 4, bias=False), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x.permute(0, 2, 3, 1)
        return self.a(y) * self.b(y), self.c(y)


@pytest.mark.parametrize("form", ["decomposed", "edge"])
def test_linears_of_a_permuted_rank_4_input_join_as_bmms(form: str) -> None:
    # found by a hunt: run_decompositions() and to_edge give each such linear its own expand, clone and
    # view of the input, then a bmm; the linears were no candidates (neither joined nor reported)
    torch.manual_seed(0)
    model, x = ChannelsLast().eval(), (torch.randn(2, 3, 4, 5),)
    manager = edge(model, x, form) if form == "edge" else None
    p = manager.exported_program() if manager is not None else torch.export.export(model, x).run_decompositions()
    outcome = adapters.transform(p, [concat_parallel_linears()]).unwrap()
    assert len(outcome.report.plans) == 1 and outcome.report.rejections == ()
    assert sum(1 for n in graph(p).nodes if n.op == "call_function" and "bmm" in str(n.target)) == 1
    assert_sound(p, x, eager(model, x))
    if manager is not None:
        assert_close(run_pte(manager.to_executorch().buffer, x), eager(model, x))


@pytest.mark.parametrize("form", ["gm", "aten", "edge"])
def test_a_linear_that_cannot_join_is_rejected_and_the_rest_join(form: str) -> None:
    model, x = Computed().eval(), (torch.randn(3, 16),)
    p = program(model, x, form)
    outcome = adapters.transform(p, [concat_parallel_linears()]).unwrap()
    assert len(outcome.report.plans) == 1
    (rejection,) = outcome.report.rejections
    assert isinstance(rejection.reason, NotConstant) and "mul" in rejection.reason.source  # w * x.mean()
    assert products(p) == 2  # q and v as one, k as it was
    assert_sound(p, x, eager(model, x))


@pytest.mark.parametrize("form", ["aten", "edge-linear"])
def test_too_few_joinable_linears_leave_the_program_untouched(form: str) -> None:
    model, x = Computed(lonely=True).eval(), (torch.randn(3, 16),)
    p = program(model, x, form)
    code = graph(p).python_code("self").src
    outcome = adapters.transform(p, [concat_parallel_linears()]).unwrap()
    assert not outcome.changed and outcome.report.plans == ()
    assert sorted(r.reason.code for r in outcome.report.rejections) == ["not-constant", "too-few-linears"]
    assert graph(p).python_code("self").src == code
    assert_sound(p, x, eager(model, x))


class Scaled(nn.Module):
    """Two ``addmm(b, x, W, alpha=2)`` of one input (weights stored (in, out)), beside a plain linear
    of it (``plain``)."""

    def __init__(self, plain: bool) -> None:
        super().__init__()
        self.w, self.b = (
            nn.ParameterList(torch.randn(16, n) for n in (8, 4)),
            nn.ParameterList(torch.randn(n) for n in (8, 4)),
        )
        self.lin = nn.ModuleList([nn.Linear(16, 6)] if plain else [])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        scaled = (torch.addmm(b, x, w, alpha=2) for w, b in zip(self.w, self.b, strict=True))
        return (*scaled, *(lin(x) for lin in self.lin))


@pytest.mark.parametrize("form", ["gm", "aten", "edge"])
@pytest.mark.parametrize("plain", [False, True])
def test_linears_scaled_by_alpha_are_reported_and_the_program_left_as_it_was(form: str, plain: bool) -> None:
    # each addmm with alpha 2 reads x and cannot join (arg-mismatch): they were neither joined nor reported
    model, x = Scaled(plain).eval(), (torch.randn(3, 16),)
    p = program(model, x, form)
    code = graph(p).python_code("self").src
    outcome = adapters.transform(p, [concat_parallel_linears()]).unwrap()
    assert not outcome.changed and outcome.report.plans == ()
    codes = sorted((r.reason.code, r.reason.path) for r in outcome.report.rejections)
    assert codes == [("arg-mismatch", "lin.alpha")] * 2 + [("too-few-linears", "")]
    assert graph(p).python_code("self").src == code
    assert_sound(p, x, eager(model, x))


@pytest.mark.parametrize("form", ["gm", "aten", "edge"])
def test_a_pt2e_models_projections_are_reported_not_joined(form: str) -> None:
    # PT2E gives each projection its own dequantize of x and of its int8 weight: the linears were no
    # candidates (neither joined nor reported); joined, the weights would have become float ones
    model, x = Attention(dim=16, heads=2, kv_heads=2).eval(), (torch.randn(2, 5, 16),)
    p: Program = pt2e_module(model, x) if form == "gm" else pt2e(model, x)
    if form == "edge" and isinstance(p, ExportedProgram):
        p = to_edge(p).exported_program()
    code, want = graph(p).python_code("self").src, run(p, x)
    outcome = adapters.transform(p, [concat_parallel_linears()]).unwrap()
    assert not outcome.changed and outcome.report.plans == ()
    codes = sorted(r.reason.code for r in outcome.report.rejections)
    assert codes == ["not-constant"] * 3 + ["too-few-linears"]
    assert graph(p).python_code("self").src == code
    assert_close(run(p, x), want)


@pytest.mark.parametrize("form", ["gm", "edge"])
def test_a_weight_read_elsewhere_is_left_as_it_was(form: str) -> None:
    model, x = Tied().eval(), (torch.randn(3, 16), torch.randn(3, 16))
    p = program(model, x, form)
    w = model.w.detach().clone()
    outcome = adapters.transform(p, [concat_parallel_linears()]).unwrap()
    assert len(outcome.report.plans) == 1
    assert_sound(p, x, eager(model, x))
    kept = [t for t in (p.state_dict if isinstance(p, ExportedProgram) else dict(p.named_parameters())).values()]
    assert any(t.shape == w.shape and torch.equal(t, w) for t in kept)  # the third linear's weight, unchanged


@pytest.mark.parametrize("form", ["aten", "edge"])
def test_nested_groups_join_in_one_pass(form: str) -> None:
    # the inner group reads a, whose uses the outer group's part for a takes: both join in one run
    model, x = Nested().eval(), (torch.randn(2, 3, 16),)
    manager = edge(model, x, form) if form == "edge" else None
    p = manager.exported_program() if manager is not None else program(model, x, form)
    outcome = adapters.transform(p, [concat_parallel_linears()]).unwrap()
    assert len(outcome.report.plans) == 2 and outcome.report.rejections == ()
    assert products(p) == 2 and len(parts(p)) == 4
    want = eager(model, x)
    assert_sound(p, x, want)
    if manager is not None:
        assert_close(run_pte(manager.to_executorch().buffer, x), want)


def test_new_nodes_carry_meta_of_the_linear_they_stand_for() -> None:
    model, x, _ = model_of("mha")
    p = program(model, x, "aten")
    adapters.transform(p, [concat_parallel_linears()]).unwrap()
    modules = [list(n.meta["nn_module_stack"].values())[-1][0] for n in parts(p)]
    assert modules == ["q", "k", "v"]
    assert [n.meta["source_fn_stack"][-1][1] for n in parts(p)] == [operator.getitem] * 3  # y[..., a:b]
    for n in graph(p).nodes:
        if n.op == "call_function":
            assert n.meta.get("val") is not None and n.meta.get("stack_trace"), n.name


def test_run_on_its_own_output_finds_nothing_more() -> None:
    model, x, _ = model_of("block")
    p = program(model, x, "aten")
    adapters.transform(p, [concat_parallel_linears()]).unwrap()
    again = adapters.transform(p, [concat_parallel_linears()]).unwrap()
    assert again.report.plans == () and again.report.rejections == () and not again.changed
    assert_close(run(p, x), eager(model, x))


class PinnedFlatten(nn.Module):
    """Two linears of a flatten whose size the model pins: with ``Dim.AUTO`` on the last dim, export
    keeps the features (4 * 3) as a SymInt of value 12."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(12, 4), nn.Linear(12, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x.flatten(1)
        return self.q(h), self.k(h)


@pytest.mark.parametrize("form", ["gm", "aten"])
def test_a_size_export_pins_to_a_number_is_that_number(form: str) -> None:
    torch.manual_seed(0)
    model, x = PinnedFlatten().eval(), (torch.randn(2, 4, 3),)
    dims = ({0: torch.export.Dim("batch"), 2: torch.export.Dim.AUTO},)
    ep = torch.export.export(model, x, dynamic_shapes=dims)
    p: Program = ep.module() if form == "gm" else ep
    outcome = adapters.transform(p, [concat_parallel_linears()]).unwrap()
    assert len(outcome.report.plans) == 1 and outcome.report.rejections == ()
    for batch in (2, 5):
        other = (torch.randn(batch, 4, 3),)
        assert_close(run(p, other), list(model(*other)))


class WrittenInput(nn.Module):
    """Q, K and V of a value written in place (a position embedding added with ``+=``): on edge each
    reads its own ``view_copy`` chain of it. ``views``: they read two views of it, made apart
    (``"flatten"``: two ``h.flatten(0, 1)``, which an aten program keeps as ``flatten.using_ints``)."""

    def __init__(self, views: str | None = None) -> None:
        super().__init__()
        self.views = views
        self.inp, self.q, self.k, self.v = (
            nn.Linear(3, 8),
            nn.Linear(8, 8),
            nn.Linear(8, 4, bias=False),
            nn.Linear(8, 4),
        )
        self.pos = nn.Parameter(torch.randn(5, 8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.inp(x)
        h += self.pos
        if self.views == "flatten":
            a, b = h.flatten(0, 1), h.flatten(0, 1)
            return self.q(a), self.k(b), self.v(a)
        if self.views:
            a, b = h.view(-1, 8), h.view(-1, 8)
            return self.q(a), self.k(b), self.v(a)
        return self.q(h), self.k(h), self.v(h)


def dead(p: Program) -> list[str]:
    """Ops nothing reads."""
    return [n.name for n in graph(p).nodes if n.op == "call_function" and not n.users]


@pytest.mark.parametrize("views", [None, "view", "flatten"])
@pytest.mark.parametrize("form", FORMS)
def test_linears_reading_equal_views_of_one_value_join(form: str, views: str | None) -> None:
    torch.manual_seed(0)
    model, x = WrittenInput(views).eval(), (torch.randn(2, 5, 3),)
    manager = edge(model, x, form) if form.startswith("edge") else None
    p = manager.exported_program() if manager is not None else program(model, x, form)
    before = products(p)
    outcome = adapters.transform(p, [concat_parallel_linears()]).unwrap()
    assert outcome.report.rejections == () and len(outcome.report.plans) == 1
    assert products(p) == before - 2
    assert dead(p) == []  # the views the others read are gone
    want = eager(model, x)
    assert_sound(p, x, want)
    if manager is not None:
        assert_close(run_pte(manager.to_executorch().buffer, x), want)


class ViewsAroundWrite(nn.Module):
    """Two equal views of one value, written in place between them through a third view: Q reads
    the value before the write, K and V after (``flatten``: the two are ``h.flatten(0, 1)``;
    ``shared``: views of one view of ``h``, which is written directly)."""

    def __init__(self, how: str = "view") -> None:
        super().__init__()
        self.how = how
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)

    def read(self, h: torch.Tensor) -> torch.Tensor:
        return h.flatten(0, 1) if self.how == "flatten" else h.view(-1, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = x * 2
        hv = h.view(h.shape) if self.how == "shared" else h
        q = self.q(self.read(hv))
        if self.how == "shared":
            h.add_(1)  # (recorded at h, not at hv)
        else:
            h.view(-1).add_(1)
        after = self.read(hv)
        return q, self.k(after), self.v(after)


@pytest.mark.parametrize("how", ["view", "flatten", "shared"])
@pytest.mark.parametrize("form", ["gm", "aten", "edge"])
def test_views_of_a_value_written_between_them_are_other_values(form: str, how: str) -> None:
    # aten: the two views are of one node, whose storage is written between them; only K and V,
    # which read one view, join (shared: found by a review, the views of hv were one input, and Q
    # read h after the write)
    torch.manual_seed(0)
    model, x = ViewsAroundWrite(how).eval(), (torch.randn(2, 5, 8),)
    p = program(model, x, form)
    outcome = adapters.transform(p, [concat_parallel_linears()]).unwrap()
    assert len(outcome.report.plans) == 1 and outcome.report.rejections == ()
    assert products(p) == 2
    assert_sound(p, x, eager(model, x))


class _TwoOfATranspose(nn.Module):
    """Two linear modules of one non-contiguous input: after ``run_decompositions()`` each is
    ``expand`` + ``bmm``, its bias added after."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o = x.transpose(1, 2)
        return self.fc(o) + self.fc2(o)  # type: ignore[no-any-return]


class _TwoSequentials(nn.Module):
    """Two blocks, each a linear then a relu, of one input."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Sequential(nn.Linear(4, 3), nn.ReLU()), nn.Sequential(nn.Linear(4, 5), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x)[..., :3]  # type: ignore[no-any-return]


class _Projections(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2), dim=-1)


class _BesideAttention(nn.Module):
    """A linear beside an attention module's projections, all of one input."""

    def __init__(self) -> None:
        super().__init__()
        self.attn, self.side = _Projections(), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x).sum(-1, keepdim=True) * self.side(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("model", [_TwoSequentials, _BesideAttention])
@pytest.mark.parametrize("decompose", [False, True])
def test_a_merge_of_linears_of_different_modules_unflattens(model: type[nn.Module], decompose: bool) -> None:
    # found by a review: the second linear's part went after the first's, inside the first module's
    # call, still tagged with its own module: unflatten raised (the first module cut in two)
    torch.manual_seed(0)
    m, x = model().eval(), (torch.randn(2, 6, 4),)
    ep = torch.export.export(m, x)
    ep = ep.run_decompositions() if decompose else ep
    outcome = adapters.transform(ep, [concat_parallel_linears()]).unwrap()
    assert len(outcome.report.plans) == 1 and products(ep) == 1
    want = eager(m, x)
    assert_close(run(ep, x), want)
    with torch.no_grad():
        assert_close([torch.export.unflatten(ep)(*x)], want)


@pytest.mark.parametrize("decompose", [False, True])
def test_a_merge_leaves_each_module_call_in_one_piece_for_unflatten(decompose: bool) -> None:
    # found by a hunt: after decompositions the merged product and its parts went between fc's own
    # nodes (the reshape and bias add each linear keeps), the part for fc2 tagged fc2: unflatten then
    # called fc and fc2 twice each, and returned a tensor of the wrong shape, or raised
    model, x = _TwoOfATranspose().eval(), (torch.randn(2, 4, 5),)
    ep = torch.export.export(model, x)
    ep = ep.run_decompositions() if decompose else ep
    outcome = adapters.transform(ep, [concat_parallel_linears()]).unwrap()
    assert len(outcome.report.plans) == 1
    want = eager(model, x)
    assert_close(run(ep, x), want)
    with torch.no_grad():
        assert_close([torch.export.unflatten(ep)(*x)], want)
    # each module's nodes in one run (the nodes of the call graph, which are all inside the root)
    stacks = [tuple(n.meta["nn_module_stack"]) for n in ep.graph.nodes if n.meta.get("nn_module_stack")]
    for module in {k for s in stacks for k in s[1:]}:
        inside = [i for i, s in enumerate(stacks) if module in s]
        assert inside == list(range(inside[0], inside[-1] + 1)), module

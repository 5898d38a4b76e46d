"""linear_to_conv2d end to end: MLPs and attention blocks with rank 2, 3 and 4 linears in every
program form (edge with and without ``linear`` preserved), dynamic batch and sequence, tied
weights, declines, a PT2E-quantized MLP (int8 outputs bit for bit), lowering to ExecuTorch, and
Qualcomm's ConvertLinearToConv2d on the same programs."""

from __future__ import annotations

import copy
import re
from typing import Any

import executorch.kernels.quantized  # type: ignore[import-untyped]  # noqa: F401  (the quantize ops' out variants)
import pytest
import torch
from executorch.backends.qualcomm._passes.convert_linear_to_conv2d import (  # type: ignore[import-untyped]
    ConvertLinearToConv2d,
)
from executorch.exir import EdgeCompileConfig, EdgeProgramManager, to_edge
from torch import nn
from torch.export import Dim, ExportedProgram

import adapters
from adapters.torchnames import target_name
from fxpure.rules.linear_to_conv2d import linear_to_conv2d
from tests.int8_ties import assert_int8_equal
from tests.programs import Program, assert_close, assert_sound, build, count, dead_constants, run, run_pte
from tests.quantized import pt2e

KEEP_LINEAR = EdgeCompileConfig(preserve_ops=[torch.ops.aten.linear.default])
FORMS = ("gm", "aten", "edge", "edge-linear")


class MLP(nn.Module):
    """A classifier head on [N, 16] features: rank-2 linears, one without bias."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8, bias=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        return out


class AttentionBlock(nn.Module):
    """A pre-norm transformer block on [B, T, 16]: q/k/v/out projections and an MLP, all rank 3."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def split(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(*t.shape[:-1], self.heads, -1).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        q, k, v = self.split(self.q(h)), self.split(self.k(h)), self.split(self.v(h))
        attn = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)
        x = x + self.out((attn @ v).transpose(1, 2).flatten(-2))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class ConvNeXtBlock(nn.Module):
    """A depthwise conv, then channels-last LayerNorm and a pointwise MLP: rank-4 linears [B, H, W, C]."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.dw = nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.norm = nn.LayerNorm(c)
        self.pw1, self.pw2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.dw(x).permute(0, 2, 3, 1))
        h = self.pw2(nn.functional.gelu(self.pw1(h)))
        out: torch.Tensor = x + h.permute(0, 3, 1, 2)
        return out


class TiedLM(nn.Module):
    """Token embedding and LM head sharing one weight; the head is a rank-3 linear."""

    def __init__(self, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.norm(self.embed(tokens)))
        return out


class FlattenHead(nn.Module):
    """A model's own flatten before a linear and reshape after (not the linear's: kept around it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4 * 3 * 3, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(x.flatten(1)).reshape(-1, 3, 4)
        return out


class Conv1D(nn.Module):
    """transformers' GPT-2 ``Conv1D``: a linear whose weight is stored (in, out), ``addmm(b, x, W)``."""

    def __init__(self, out: int, features: int) -> None:
        super().__init__()
        self.out = out
        self.weight = nn.Parameter(torch.randn(features, out) * 0.2)
        self.bias = nn.Parameter(torch.randn(out) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return y.view(*x.size()[:-1], self.out)


class GPT2Block(nn.Module):
    """A GPT-2 block on [B, T, 16]: Conv1D projections (q, k, v in one, out, MLP), and a head
    ``x @ W`` on a weight stored (in, out)."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.d, self.heads = d, heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = Conv1D(3 * d, d), Conv1D(d, d)
        self.c_fc, self.mlp_proj = Conv1D(4 * d, d), Conv1D(d, 4 * d)
        self.head = nn.Parameter(torch.randn(d, 8) * 0.2)

    def split(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(*t.shape[:-1], self.heads, -1).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (self.split(t) for t in self.c_attn(self.ln1(x)).split(self.d, dim=2))
        attn = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)
        x = x + self.c_proj((attn @ v).transpose(1, 2).flatten(-2))
        x = x + self.mlp_proj(nn.functional.gelu(self.c_fc(self.ln2(x))))
        return x @ self.head


class OddRanks(nn.Module):
    """Linears on a rank-1 and a rank-5 input (declined) beside a rank-2 one (converted)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 4), nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.a(x[0]), self.b(x.reshape(2, 1, 1, 1, 8)), self.c(x)


BATCH = Dim("batch", min=1, max=8)
SEQ = Dim("seq", min=2, max=32)
# model -> (example input, dynamic shapes, sizes to run it at afterwards, linears it has)
CASES: dict[type[nn.Module], tuple[tuple[int, ...], Any, list[tuple[int, ...]], int]] = {
    MLP: ((4, 16), ({0: BATCH},), [(3, 16), (8, 16)], 3),
    AttentionBlock: ((2, 6, 16), ({0: BATCH, 1: SEQ},), [(3, 9, 16), (1, 32, 16)], 6),
    ConvNeXtBlock: ((2, 8, 5, 5), ({0: BATCH},), [(3, 8, 5, 5)], 2),
    TiedLM: ((2, 6), ({0: BATCH, 1: SEQ},), [(3, 11)], 1),
    FlattenHead: ((2, 4, 3, 3), ({0: BATCH},), [(5, 4, 3, 3)], 1),
    # (to_edge specializes this model's batch to the example's: other sequences only)
    GPT2Block: ((2, 6, 16), ({0: BATCH, 1: SEQ},), [(2, 9, 16), (2, 32, 16)], 5),
}


def case(cls: type[nn.Module]) -> tuple[tuple[int, ...], Any, list[tuple[int, ...]], int]:
    """A model's example shape and dynamic shapes (static (2, 8) for the small ones)."""
    return CASES.get(cls, ((2, 8), None, [], 0))


def make(cls: type[nn.Module]) -> nn.Module:
    """The model, in eval mode, with the same parameters every time."""
    torch.manual_seed(0)
    return cls().eval()


def inputs(cls: type[nn.Module], shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(sum(shape))
    if cls is TiedLM:
        return (torch.randint(0, 32, shape, generator=g),)
    return (torch.randn(shape, generator=g),)


def eager(cls: type[nn.Module], x: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    with torch.no_grad():
        out = make(cls)(*x)
    return [t.detach() for t in (out if isinstance(out, tuple) else (out,))]


_EDGE: dict[tuple[type[nn.Module], str, bool], EdgeProgramManager] = {}


def edge(cls: type[nn.Module], form: str = "edge", *, dynamic: bool = True) -> EdgeProgramManager:
    """A fresh copy of the model's edge program (to_edge runs once per model and form)."""
    key = (cls, form, dynamic)
    if key not in _EDGE:
        shape, shapes, _, _ = case(cls)
        ep = torch.export.export(make(cls), inputs(cls, shape), dynamic_shapes=shapes if dynamic else None)
        _EDGE[key] = to_edge(ep, compile_config=KEEP_LINEAR if form == "edge-linear" else None)
    return copy.deepcopy(_EDGE[key])


def program(cls: type[nn.Module], form: str, *, dynamic: bool = True) -> Program:
    if form.startswith("edge"):
        return edge(cls, form, dynamic=dynamic).exported_program()
    shape, shapes, _, _ = case(cls)
    ep = torch.export.export(make(cls), inputs(cls, shape), dynamic_shapes=shapes if dynamic else None)
    return ep.module() if form == "gm" else ep


def targets(p: Program) -> list[str]:
    gm = p.graph_module if isinstance(p, ExportedProgram) else p
    return [target_name(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def linears_left(p: Program) -> int:
    """Linear products left (aten.linear, addmm, mm; not the attention's bmm)."""
    return sum(t in ("aten.linear.default", "aten.addmm.default", "aten.mm.default") for t in targets(p))


def unused(p: Program) -> list[str]:
    """Computations nothing reads (the size arithmetic of a removed reshape, say)."""
    gm = p.graph_module if isinstance(p, ExportedProgram) else p
    return [n.name for n in gm.graph.nodes if n.op == "call_function" and not n.users]


def convs(p: Program) -> int:
    return sum(t in ("aten.conv2d.default", "aten.convolution.default") for t in targets(p))


def test_the_snapshot_holds_the_least_sizes_the_program_declares() -> None:
    class Masked(nn.Module):
        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return x[mask].reshape(-1, 4)

    x = torch.randn(2, 5, 8)
    shapes = ({0: Dim("b", min=1), 1: Dim("t", min=3)},)
    ep = torch.export.export(nn.Flatten(0, 1), (x,), dynamic_shapes=shapes)
    b, t = (str(d) for d in next(n for n in ep.graph.nodes if n.op == "placeholder").meta["val"].shape[:2])
    least = adapters.capture(ep).least_sizes
    assert (least[b], least[t], least[next(k for k in least if "*" in k)]) == (1, 3, 3)
    assert adapters.capture(ep.module()).least_sizes == {}  # a GraphModule declares none
    masked = torch.export.export(Masked(), (x, torch.ones(2, 5, dtype=torch.bool)))
    for p in (masked, masked.module()):  # a data-dependent size: its range, from 0
        assert list(adapters.capture(p).least_sizes.values())[:1] == [0]


@pytest.mark.parametrize("form", ["aten", "gm"])
def test_a_sequence_that_may_be_empty_is_declined(form: str) -> None:
    # Dim("seq") lets the sequence be 0, where a linear returns an empty tensor and a 1x1 conv2d
    # with an empty spatial dim fails; a GraphModule declares no ranges at all (SEQ's minimum of 2
    # is the exported program's, not the GraphModule's)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    seq = {"aten": Dim("seq", max=32), "gm": SEQ}[form]
    ep = torch.export.export(model, (torch.randn(2, 6, 16),), dynamic_shapes=({1: seq},))
    p = ep.module() if form == "gm" else ep
    outcome = adapters.transform(p, [linear_to_conv2d()]).unwrap()
    assert outcome.report.plans == () and not outcome.changed
    reasons = [r.reason for r in outcome.report.rejections]
    assert [(r.code, r.path) for r in reasons] == [("zero-size", "lin.input")] * 2
    assert re.search(r"\(2, '(s\d+)', 16\) is empty when \1 is 0", reasons[0].message)
    whose = "a GraphModule, which checks no range, holds" if form == "gm" else "the program declares"
    assert f"({whose} no minimum of 1 for it)" in reasons[0].message
    program = ep.module() if form == "aten" else p  # what transform left runs at 0
    assert program(torch.randn(2, 0, 16)).shape == (2, 0, 4)


@pytest.mark.parametrize(
    ("cls", "form"),
    [
        *((MLP, form) for form in FORMS),
        (AttentionBlock, "aten"),
        (AttentionBlock, "edge"),
        (ConvNeXtBlock, "aten"),
        (ConvNeXtBlock, "edge-linear"),
    ],
)
def test_every_linear_becomes_a_1x1_conv_with_dynamic_shapes(cls: type[nn.Module], form: str) -> None:
    _, _, sizes, linears = CASES[cls]
    p = program(cls, form)
    before = convs(p)
    outcome = adapters.transform(p, [linear_to_conv2d()]).unwrap()
    assert len(outcome.report.plans) == linears and outcome.report.rejections == ()
    assert linears_left(p) == 0 and convs(p) == before + linears and unused(p) == []
    for shape in sizes:  # batch (and sequence) other than the example's
        x = inputs(cls, shape)
        assert_sound(p, x, eager(cls, x))


@pytest.mark.parametrize("form", ["aten", "edge"])
def test_gpt2s_conv1d_and_a_product_with_a_weight_stored_in_out_become_1x1_convs(form: str) -> None:
    # addmm(b, x, W) and x @ W with W (in, out): the conv's weight is W's transpose, reshaped
    _, _, sizes, linears = CASES[GPT2Block]
    p = program(GPT2Block, form)
    assert isinstance(p, ExportedProgram)
    outcome = adapters.transform(p, [linear_to_conv2d()]).unwrap()
    assert outcome.report.rejections == () and len(outcome.report.plans) == linears and linears_left(p) == 0
    # in aten, c_fc's output reaches mlp_proj's view(-1, 64) through a GELU: a view merging dims of a
    # value whose strides the conv would change (aten.view fails on them), until mlp_proj is a conv
    # too, reading it through a permute; c_fc converts in the rule's second run
    runs = [sorted(p.anchor for p in stage) for stage in outcome.report.stages if stage]
    assert runs == ([["addmm", "addmm_1", "addmm_3", "matmul_2"], ["addmm_2"]] if form == "aten" else [runs[0]])
    assert sorted(tuple(t.shape) for t in p.state_dict.values() if t.dim() == 4) == sorted(
        [(48, 16, 1, 1), (16, 16, 1, 1), (8, 16, 1, 1), (16, 64, 1, 1), (64, 16, 1, 1)]
    )
    for shape in sizes:
        x = inputs(GPT2Block, shape)
        assert_sound(p, x, eager(GPT2Block, x))


@pytest.mark.parametrize(("cls", "form"), [(AttentionBlock, "edge"), (MLP, "edge-linear"), (GPT2Block, "edge")])
def test_edge_programs_lower_and_run_in_executorch(cls: type[nn.Module], form: str) -> None:
    manager = edge(cls, form)
    adapters.transform(manager.exported_program(), [linear_to_conv2d()]).unwrap()
    buffer = manager.to_executorch().buffer
    for shape in [case(cls)[0], *case(cls)[2]]:
        x = inputs(cls, shape)
        assert_close(run_pte(buffer, x), eager(cls, x))


@pytest.mark.parametrize("decomposed", [True, False], ids=["decomposed", "training-ir"])
def test_after_run_decompositions_the_conv_is_a_core_aten_op(decomposed: bool) -> None:
    # until 2026-12-06 aten.conv2d, which is no Core ATen op, in a program of Core ATen ops; a
    # program as torch.export.export makes it keeps conv2d (a PT2E quantizer annotates that)
    ep = torch.export.export(make(MLP), inputs(MLP, case(MLP)[0]))
    p = ep.run_decompositions() if decomposed else ep
    assert adapters.capture(p).decomposed is decomposed
    adapters.transform(p, [linear_to_conv2d()]).unwrap()
    calls = [n.target for n in p.graph.nodes if n.op == "call_function"]
    assert [str(t) for t in calls if "conv" in str(t)] == [
        "aten.convolution.default" if decomposed else "aten.conv2d.default"
    ] * 3
    assert all(torch.Tag.core in t.tags for t in calls) is decomposed
    x = inputs(MLP, case(MLP)[0])
    assert_sound(p, x, eager(MLP, x))


class OneInput(nn.Module):
    """GPT-2's ``Conv1D`` (``addmm(b, x, W)``) and ``x @ W``, ``W`` stored (in, out), of one input feature."""

    def __init__(self) -> None:
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(1, 10)), nn.Parameter(torch.randn(10))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.addmm(self.b, x, self.w), x @ (self.w * 2.0)


def test_a_weight_of_one_input_feature_runs_in_executorch() -> None:
    # found by a hunt: its (10, 1, 1, 1) weight, W (1, 10) transposed and reshaped, kept the view's
    # strides (1, 10, 10, 10): torch calls that contiguous, ExecuTorch read it as dim order (1, 2, 3, 0),
    # and its portable conv refused it when the .pte ran (error 0x12)
    model, x = OneInput().eval(), (torch.randn(4, 1),)
    manager = to_edge(torch.export.export(model, x))
    outcome = adapters.transform(manager.exported_program(), [linear_to_conv2d()]).unwrap()
    assert len(outcome.report.plans) == 2
    assert_close(run_pte(manager.to_executorch().buffer, x), list(model(*x)))


@pytest.mark.parametrize("form", ["aten", "edge"])
def test_tied_embedding_keeps_its_weight_and_the_head_gets_a_reshaped_one(form: str) -> None:
    p = program(TiedLM, form)
    assert isinstance(p, ExportedProgram)
    outcome = adapters.transform(p, [linear_to_conv2d()]).unwrap()
    assert len(outcome.report.plans) == 1
    shapes = sorted(tuple(t.shape) for t in p.state_dict.values() if t.dim() >= 2)
    assert shapes == [(32, 16), (32, 16, 1, 1)]  # the embedding still reads the (V, D) original
    x = inputs(TiedLM, (3, 11))
    assert_sound(p, x, eager(TiedLM, x))


def test_weight_shared_by_two_linears_is_reshaped_once() -> None:
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.a(torch.relu(self.a(x)))
            return out

    p = edge(Shared, dynamic=False).exported_program()
    outcome = adapters.transform(p, [linear_to_conv2d()]).unwrap()
    assert len(outcome.report.plans) == 2
    weights = {n.args[1].name for n in p.graph.nodes if n.op == "call_function" and "convolution" in str(n.target)}
    assert len(weights) == 1 and [tuple(t.shape) for t in p.state_dict.values() if t.dim() > 1] == [(8, 8, 1, 1)]
    x = inputs(Shared, (2, 8))
    assert_sound(p, x, eager(Shared, x))


def test_a_models_own_flatten_stays_around_a_rank_2_conv() -> None:
    p = edge(FlattenHead).exported_program()
    outcome = adapters.transform(p, [linear_to_conv2d()]).unwrap()
    assert len(outcome.report.plans) == 1 and linears_left(p) == 0
    assert targets(p).count("aten.view_copy.default") == 2  # the model's flatten and unflatten
    x = inputs(FlattenHead, (5, 4, 3, 3))
    assert_sound(p, x, eager(FlattenHead, x))


@pytest.mark.parametrize("form", ["aten", "edge-linear"])
def test_rank_1_and_5_are_declined_with_reasons(form: str) -> None:
    p = program(OddRanks, form, dynamic=False)
    outcome = adapters.transform(p, [linear_to_conv2d()]).unwrap()
    assert len(outcome.report.plans) == 1
    reasons = sorted((r.reason.code, r.reason.message.split(" has ")[1]) for r in outcome.report.rejections)
    assert reasons == [
        ("unsupported-rank", "1 input dims, the rule handles (2, 3, 4)"),
        ("unsupported-rank", "5 input dims, the rule handles (2, 3, 4)"),
    ]
    assert linears_left(p) == 2
    x = inputs(OddRanks, (2, 8))
    assert_sound(p, x, eager(OddRanks, x))


class Empty(nn.Module):
    """A linear of no input features (its output is its bias), one of no output features, and one
    on an empty sequence: conv2d drops the bias of the first and fails on the other two."""

    def __init__(self) -> None:
        super().__init__()
        self.none_in, self.none_out, self.seq = nn.Linear(0, 4), nn.Linear(8, 0), nn.Linear(8, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.none_in(a), self.none_out(b), self.seq(c)


@pytest.mark.parametrize("form", ["gm", "aten", "edge"])
def test_empty_channels_and_sequences_are_declined_zero_size(form: str) -> None:
    model, x = Empty().eval(), (torch.randn(3, 0), torch.randn(3, 8), torch.randn(2, 0, 8))
    want = [t.clone() for t in model(*x)]
    ep = torch.export.export(copy.deepcopy(model), x)
    p: Program = ep.module() if form == "gm" else ep if form == "aten" else to_edge(ep).exported_program()
    outcome = adapters.transform(p, [linear_to_conv2d()]).unwrap()
    assert not outcome.changed
    assert sorted(r.reason.code for r in outcome.report.rejections) == ["zero-size"] * 3
    got = run(p, x)
    assert [t.shape for t in got] == [t.shape for t in want] and torch.equal(got[0], want[0])


def test_program_untouched_when_everything_declines() -> None:
    class Rank5(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.fc(x)
            return out

    p = torch.export.export(Rank5(), (torch.randn(1, 2, 1, 2, 8),))
    before = p.graph_module.code
    outcome = adapters.transform(p, [linear_to_conv2d()]).unwrap()
    assert not outcome.changed and [r.reason.code for r in outcome.report.rejections] == ["unsupported-rank"]
    assert p.graph_module.code == before and dead_constants(p) == []


# --- a PT2E-quantized MLP ------------------------------------------------------------------------------


class TokenMLP(nn.Module):
    """A transformer MLP on [B, T, 16] tokens, to quantize: rank-3 linears."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 48), nn.Linear(48, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(torch.relu(self.up(x)))
        return out


_QUANTIZED: list[ExportedProgram] = []


def quantized() -> ExportedProgram:
    """The PT2E-quantized (XNNPACKQuantizer, per-channel) aten program, made once; copies."""
    if not _QUANTIZED:
        _QUANTIZED.append(pt2e(make(TokenMLP), inputs(TokenMLP, (2, 6, 16)), dynamic=({0: BATCH, 1: SEQ},)))
    return copy.deepcopy(_QUANTIZED[0])


@pytest.mark.parametrize("form", ["aten", "edge", "edge-linear"])
def test_quantized_mlp_int8_outputs_equal_the_originals(form: str) -> None:
    manager = (
        None if form == "aten" else to_edge(quantized(), compile_config=KEEP_LINEAR if form == "edge-linear" else None)
    )
    p = quantized() if manager is None else manager.exported_program()
    original = copy.deepcopy(p)
    outcome = adapters.transform(p, [linear_to_conv2d()]).unwrap()
    assert len(outcome.report.plans) == 2 and outcome.report.rejections == ()
    assert linears_left(p) == 0 and dead_constants(p) == []
    for conv in (n for n in p.graph.nodes if n.op == "call_function" and "conv" in str(n.target)):
        dq = conv.args[1]  # a new dequantize of the (O, I, 1, 1) int8 weight, per channel on axis 0
        assert "dequantize_per_channel" in str(dq.target) and dq.args[3] == 0
        assert dq.args[0].meta["val"].dtype == torch.int8 and dq.args[0].meta["val"].dim() == 4
        assert dq.args[1].meta["val"].shape == (dq.args[0].meta["val"].shape[0],)  # one scale per output
    ties = sum(assert_int8_equal(original, p, inputs(TokenMLP, s)) for s in [(2, 6, 16), (5, 13, 16), (3, 7, 16)])
    assert ties <= 2  # of 3 x 1000-odd int8 values: float32 rounding ties only (see assert_int8_equal)
    if manager is not None:
        x = inputs(TokenMLP, (2, 6, 16))
        assert_close(run_pte(manager.to_executorch().buffer, x), run(p, x))


def static_quantized() -> torch.fx.GraphModule:
    """The quantized program of static sizes as a GraphModule (it declares no ranges of dynamic ones)."""
    return pt2e(make(TokenMLP), inputs(TokenMLP, (2, 6, 16))).module()


def test_on_a_graph_module_the_new_int8_weights_are_buffers_it_saves_and_moves() -> None:
    gm = static_quantized()
    outcome = adapters.transform(gm, [linear_to_conv2d()]).unwrap()
    assert len(outcome.added) == 2
    buffers, state = dict(gm.named_buffers()), gm.state_dict()
    assert all(name in buffers and state[name].dtype == torch.int8 for name in outcome.added)
    x = inputs(TokenMLP, (2, 6, 16))
    want = run(gm, x)
    again = static_quantized()
    adapters.transform(again, [linear_to_conv2d()]).unwrap()
    for name in outcome.added:  # the saved weights are what the copy runs on
        getattr(again, name).zero_()
    again.load_state_dict(state)
    assert_close(run(again, x), want)


# --- Qualcomm's ConvertLinearToConv2d on the same programs --------------------------------------------


def qualcomm(manager: EdgeProgramManager) -> ExportedProgram:
    return manager.transform([ConvertLinearToConv2d(manager.exported_program())]).exported_program()


def test_qualcomm_raises_on_rank_1_and_5() -> None:
    with pytest.raises(Exception, match="ConvertLinearToConv2d"):
        qualcomm(edge(OddRanks, "edge-linear", dynamic=False))


def test_qualcomm_bakes_the_example_batch_into_its_reshapes() -> None:
    """Its view_copy sizes are the example's SymInts, not graph values: the program cannot run."""
    upstream = qualcomm(edge(MLP, "edge-linear"))
    x = inputs(MLP, (3, 16))
    with pytest.raises(NameError, match=r"^name 's\d+' is not defined$"):  # a SymInt of the example batch
        run(upstream, x)
    ours = edge(MLP, "edge-linear").exported_program()
    adapters.transform(ours, [linear_to_conv2d()]).unwrap()
    assert_sound(ours, x, eager(MLP, x))


def test_qualcomm_leaves_the_unreshaped_weights_behind() -> None:
    upstream = qualcomm(edge(MLP, "edge-linear"))
    assert convs(upstream) == 3
    assert {"body.0.weight", "body.2.weight", "body.4.weight"} <= set(dead_constants(upstream))
    ours = edge(MLP, "edge-linear").exported_program()
    adapters.transform(ours, [linear_to_conv2d()]).unwrap()
    assert convs(ours) == 3 and dead_constants(ours) == []


def test_qualcomm_converts_only_the_preserved_linear_spelling() -> None:
    upstream = qualcomm(edge(MLP, "edge"))  # plain to_edge: permute_copy + addmm/mm
    assert convs(upstream) == 0 and linears_left(upstream) == 3
    ours = edge(MLP, "edge").exported_program()
    adapters.transform(ours, [linear_to_conv2d()]).unwrap()
    assert convs(ours) == 3 and linears_left(ours) == 0


def test_a_dynamically_quantized_linear_is_declined_and_the_program_still_lowers_to_xnnpack() -> None:
    # its q/dq pair after the views read choose_qparams' outputs: XNNPACK's partitioner then found
    # a dependency cycle, where the original lowers
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    x = (torch.randn(4, 16),)
    program = pt2e(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)), x, dynamic_quant=True)
    outcome = adapters.transform(program, [linear_to_conv2d()]).unwrap()
    assert not outcome.changed
    assert [(r.node, r.reason.code) for r in outcome.report.rejections] == [
        ("linear", "dynamic-quantization"),
        ("linear_1", "dynamic-quantization"),
    ]
    to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch()


class _ViewsAndConvs(nn.Module):
    """A linear on a rank 3 input, a conv1d and a transposed conv1d: the rules add views and convs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 6)
        self.conv = nn.Conv1d(6, 4, 3)
        self.up = nn.ConvTranspose1d(4, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.up(self.conv(self.lin(x).transpose(1, 2)))
        return y


def test_new_views_and_convs_name_their_own_function_in_source_fn_stack() -> None:
    # a strict export records which user-level function made each node; a partitioner grouping a
    # model's linears (or conv1ds) by it must not find the views that now feed a conv2d among them
    from fxpure.rules.conv1d_to_conv2d import conv1d_to_conv2d

    model, x = _ViewsAndConvs().eval(), (torch.randn(2, 5, 8),)
    p = torch.export.export(model, x, strict=True)
    before = {n.name for n in p.graph.nodes}
    assert adapters.transform(p, [conv1d_to_conv2d(), linear_to_conv2d()]).unwrap().changed
    fns = {
        torch.ops.aten.permute.default: torch.permute,
        torch.ops.aten.unsqueeze.default: torch.unsqueeze,
        torch.ops.aten.squeeze.dims: torch.squeeze,
        torch.ops.aten.conv2d.default: torch.conv2d,
        torch.ops.aten.conv_transpose2d.input: torch.conv_transpose2d,
    }
    new = [n for n in p.graph.nodes if n.op == "call_function" and n.name not in before]
    # the linear: permute, unsqueeze, conv2d, squeeze, permute; each conv1d: unsqueeze, conv2d, squeeze
    assert len(new) == 11
    assert [(n.name, *n.meta["source_fn_stack"][-1]) for n in new] == [(n.name, n.name, fns[n.target]) for n in new]


class TensorQuantized(nn.Module):
    """A linear statically quantized with its parameters given as 0-d constant tensors
    (``quantize_per_tensor.tensor``, ``dequantize_per_tensor.tensor``), its weight too."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("wq", torch.randint(-127, 128, (6, 8), generator=g, dtype=torch.int8))
        for name, value in (("ws", 0.0123), ("xs", 0.0311), ("os", 0.0517)):
            self.register_buffer(name, torch.tensor(value, dtype=torch.float64))
        for name, zero in (("wz", 0), ("xz", 3), ("oz", -2)):
            self.register_buffer(name, torch.tensor(zero))
        self.b = nn.Parameter(torch.randn(6, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, dq = (
            torch.ops.quantized_decomposed.quantize_per_tensor.tensor,
            torch.ops.quantized_decomposed.dequantize_per_tensor.tensor,
        )
        w = dq(self.wq, self.ws, self.wz, -127, 127, torch.int8)
        xd = dq(q(x, self.xs, self.xz, -128, 127, torch.int8), self.xs, self.xz, -128, 127, torch.int8)
        y = torch.nn.functional.linear(xd, w, self.b)
        out: torch.Tensor = dq(q(y, self.os, self.oz, -128, 127, torch.int8), self.os, self.oz, -128, 127, torch.int8)
        return out


@pytest.mark.parametrize("form", ["gm", "aten"])
def test_a_linear_quantized_with_constant_tensor_parameters_converts(form: str) -> None:
    # found by a review: declined dynamic-quantization ("scale and zero point are computed"), its
    # parameters being nodes; before the .tensor overloads were a dequantize, not-constant
    model, x = TensorQuantized().eval(), (torch.randn(2, 5, 8),)
    program = build(model, x, form)
    want = run(program, x)
    report = adapters.transform(program, [linear_to_conv2d()]).unwrap().report
    assert len(report.plans) == 1 and report.rejections == ()
    assert count(program, "linear") == 0 and count(program, "conv") == 1
    assert torch.equal(run(program, x)[0], want[0])

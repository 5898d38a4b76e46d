"""fuse_linear_bn end to end on real exported programs: the unlifted GraphModule, the aten program,
the edge program (plain ``to_edge``: permute_copy + addmm/mm, view-wrapped for rank 3; and with
``linear`` preserved); dynamic batch; shared weights; the ExecuTorch runtime; and upstream's
XNNPACK ``FuseBatchNormPass`` and NXP ``FuseBatchNormWithLinearPass`` on the same programs."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from executorch.exir import EdgeCompileConfig, EdgeProgramManager, to_edge
from torch import nn
from torch.export import Dim, ExportedProgram

import adapters
from fxpure.rules.fuse_linear_bn import fuse_linear_bn
from tests.linear_fold_support import assert_symbolic, nxp_stand_in
from tests.models import randomize_bn
from tests.programs import Program, assert_close, assert_sound, count, run, run_pte
from tests.programs import build as build_form

FORMS = ("gm", "aten", "edge", "edge-linear")


class MLPHead(nn.Module):
    """A classifier head: linear-BN-ReLU, linear(no bias)-BN(no affine)-ReLU, linear."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.b1 = nn.Linear(16, 32), nn.BatchNorm1d(32)
        self.l2, self.b2 = nn.Linear(32, 8, bias=False), nn.BatchNorm1d(8, affine=False)
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.out(torch.relu(self.b2(self.l2(torch.relu(self.b1(self.l1(x)))))))
        return y


class SeqBlock(nn.Module):
    """A [B, T, D] sequence block (transformer / conformer feed-forward style) whose projections are
    normalised over D: "transpose to channels, BN, transpose back" (as transpose and as permute)."""

    def __init__(self, d: int = 12) -> None:
        super().__init__()
        self.q, self.bq = nn.Linear(d, d), nn.BatchNorm1d(d)
        self.v, self.bv = nn.Linear(d, d, bias=False), nn.BatchNorm1d(d)
        self.o = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.bq(self.q(x).transpose(1, 2)).transpose(1, 2)
        v = self.bv(self.v(x).permute(0, 2, 1)).permute(0, 2, 1)
        out: torch.Tensor = self.o(torch.relu(q) * v)
        return out


class Declines(nn.Module):
    """Every batch norm here must be declined, each for another reason."""

    def __init__(self, t: int = 6) -> None:
        super().__init__()
        self.a, self.ba = nn.Linear(4, t), nn.BatchNorm1d(t)  # BatchNorm1d(T) on [B, T, F] with T == F
        self.b, self.bb = nn.Linear(4, 6), nn.BatchNorm1d(6)  # the linear's output is also used
        self.bc = nn.BatchNorm1d(4)  # after a mean, not a linear

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = self.ba(self.a(x))
        z = self.b(x.mean(dim=1))
        return y, self.bb(z) + z, self.bc(x.mean(dim=1))


class Tied(nn.Module):
    """One linear weight used twice: once into a BN (fused), once plain (must keep its numbers)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn = nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.bn(self.a(x)) + nn.functional.linear(x, self.a.weight)
        return out


class Rank3(nn.Module):
    """BatchNorm1d(T) applied straight to a [B, T, F] linear output, T == F: it normalises T."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn = nn.Linear(4, 6), nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.bn(self.a(x))
        return out


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], int]] = {  # model, input shape, BNs fused
    "mlp": (MLPHead, (6, 16), 2),
    "seq": (SeqBlock, (2, 5, 12), 2),
    "tied": (Tied, (4, 8), 1),
    "declines": (Declines, (3, 6, 4), 0),
    "rank3": (Rank3, (2, 6, 4), 0),
}
# the sequence model is exported with a dynamic batch and sequence length
DYNAMIC = {"seq": ({0: Dim("batch", max=64), 1: Dim("seq", max=64)},)}
PRESERVE = EdgeCompileConfig(preserve_ops=[torch.ops.aten.linear.default])


@functools.cache
def example(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The model (same weights on every call; do not modify it) and its example input."""
    make, shape, _ = MODELS[name]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = randomize_bn(make())
    return model, (torch.randn(shape, generator=torch.Generator().manual_seed(0)),)


@functools.cache
def _edge(name: str, form: str) -> EdgeProgramManager:
    model, x = example(name)
    ep = torch.export.export(copy.deepcopy(model), x, dynamic_shapes=DYNAMIC.get(name))
    return to_edge(ep, compile_config=PRESERVE) if form == "edge-linear" else to_edge(ep)


def edge_manager(name: str, form: str) -> EdgeProgramManager:
    """A fresh copy of the model's edge program (``to_edge`` is the slow step: it runs once)."""
    return copy.deepcopy(_edge(name, form))


def build(name: str, form: str) -> Program:
    """``gm``, ``aten``, ``edge`` (plain to_edge) or ``edge-linear`` (linear preserved)."""
    if form.startswith("edge"):
        return edge_manager(name, form).exported_program()
    model, x = example(name)
    ep = torch.export.export(copy.deepcopy(model), x, dynamic_shapes=DYNAMIC.get(name))
    return ep.module() if form == "gm" else ep


CASES = [*((n, f) for n in ("mlp", "seq") for f in FORMS), ("tied", "gm"), ("tied", "aten")]


@pytest.mark.parametrize(("name", "form"), CASES)
def test_fuses_keeps_numerics_and_runs(name: str, form: str) -> None:
    model, x = example(name)
    want = [model(*x).detach()]
    edge = edge_manager(name, form) if form.startswith("edge") else None
    program = edge.exported_program() if edge is not None else build(name, form)
    bns = count(program, "batch_norm")
    outcome = adapters.transform(program, [fuse_linear_bn()]).unwrap()
    assert len(outcome.report.plans) == MODELS[name][2] == bns
    assert outcome.report.rejections == ()
    assert count(program, "batch_norm") == 0
    assert_sound(program, x, want)
    if name in DYNAMIC:
        assert_symbolic(program, outcome.report)
        for shape in ((7, 3, 12), (1, 9, 12)):
            xs = (torch.randn(shape),)
            assert_close(run(program, xs), [model(*xs).detach()])
    if edge is not None:  # the edge program lowers, and the runtime computes the same
        assert_close(run_pte(edge.to_executorch().buffer, x), want)


@pytest.mark.parametrize("form", ["gm", "aten", "edge"])
def test_declines_with_typed_reasons_and_leaves_the_program_untouched(form: str) -> None:
    model, x = example("declines")
    program = build("declines", form)
    before = adapters.capture(program)
    outcome = adapters.transform(program, [fuse_linear_bn()]).unwrap()
    codes = sorted(r.reason.code for r in outcome.report.rejections)
    assert codes == ["bn-axis-mismatch", "linear-output-shared", "producer-not-linear"]
    assert not outcome.changed and adapters.capture(program) == before
    assert_close(run(program, x), [t.detach() for t in model(*x)])


@pytest.mark.parametrize("form", ["gm", "aten"])
def test_training_mode_bn_is_declined(form: str) -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6)).train()
    ep = torch.export.export(model, (torch.randn(8, 4),))
    program = ep.module() if form == "gm" else ep
    before = adapters.capture(program)
    outcome = adapters.transform(program, [fuse_linear_bn()]).unwrap()
    assert [r.reason.code for r in outcome.report.rejections] == ["bn-training-mode"]
    assert not outcome.changed and adapters.capture(program) == before


def test_shared_weight_keeps_its_numbers() -> None:
    model, x = example("tied")
    program = build("tied", "aten")
    assert isinstance(program, ExportedProgram)
    original = program.state_dict["a.weight"].clone()
    adapters.transform(program, [fuse_linear_bn()]).unwrap()
    assert torch.equal(program.state_dict["a.weight"], original)  # still read by the plain linear
    assert_close(run(program, x), [model(*x).detach()])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_folds_in_float32(dtype: torch.dtype) -> None:
    with torch.random.fork_rng():  # fixed values: the half-dtype fold below is checked to differ on them
        torch.manual_seed(0)
        lin, bn = nn.Linear(6, 8), nn.BatchNorm1d(8)
    model = randomize_bn(nn.Sequential(lin, bn)).to(dtype)  # converts lin and bn in place
    x = (torch.randn(4, 6).to(dtype),)
    program = torch.export.export(model, x)
    want = [model(*x).detach()]
    adapters.transform(program, [fuse_linear_bn()]).unwrap()
    assert_close(run(program, x), want, rel=2e-2)
    assert {k: t.dtype for k, t in program.state_dict.items()} == {"linear_bn_weight": dtype, "linear_bn_bias": dtype}

    def fold(compute: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Written out here, in ``compute``, and cast once: ``s = gamma * rsqrt(var + eps)``."""
        assert bn.running_mean is not None and bn.running_var is not None
        w, b, mean, var, gamma, beta = (
            t.detach().to(compute) for t in (lin.weight, lin.bias, bn.running_mean, bn.running_var, bn.weight, bn.bias)
        )
        s = torch.rsqrt(var + bn.eps) * gamma
        return (w * s[:, None]).to(dtype), ((b - mean) * s + beta).to(dtype)

    # bit for bit the float32 fold rounded once; the fold in the half dtype differs on these values
    weight, bias = fold(torch.float32)
    own_weight, own_bias = fold(dtype)
    assert not torch.equal(own_weight, weight) and not torch.equal(own_bias, bias)
    assert torch.equal(program.state_dict["linear_bn_weight"], weight)
    assert torch.equal(program.state_dict["linear_bn_bias"], bias)


# --- upstream on the same programs -----------------------------------------------------------------


def nxp_pass() -> Any:
    nxp_stand_in()
    from executorch.backends.nxp.aten_passes.fuse_batch_norm_with_linear_pass import (  # type: ignore[import-untyped]
        FuseBatchNormWithLinearPass,
    )

    return FuseBatchNormWithLinearPass()


def xnnpack(edge: EdgeProgramManager) -> ExportedProgram:
    from executorch.backends.xnnpack._passes.fuse_batch_norm import FuseBatchNormPass  # type: ignore[import-untyped]

    out: ExportedProgram = edge.transform([FuseBatchNormPass(edge.exported_program())]).exported_program()
    return out


def max_error(program: Program, x: tuple[torch.Tensor, ...], want: torch.Tensor) -> float:
    return float((run(program, x)[0] - want).abs().max())


def test_nxp_corrupts_a_shared_weight_fxpure_does_not() -> None:
    # NXP writes the fused weight back into the weight's attribute: the plain linear reading the
    # same weight changes too (latent bug by reading, rules-research A1)
    model, x = example("tied")
    want = model(*x).detach()
    upstream, ours = build("tied", "gm"), build("tied", "gm")
    assert nxp_pass()(upstream).modified
    assert max_error(upstream, x, want) > 1e-2
    assert len(adapters.transform(ours, [fuse_linear_bn()]).unwrap().report.plans) == 1
    assert_close(run(ours, x), [want])


def test_nxp_folds_a_training_mode_bn_fxpure_declines() -> None:
    # a train-mode BN normalises with batch statistics; folding running statistics changes outputs
    model = randomize_bn(nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))).train()
    x = (torch.randn(8, 4, generator=torch.Generator().manual_seed(0)),)
    want = copy.deepcopy(model)(*x).detach()
    upstream, ours = torch.export.export(model, x).module(), torch.export.export(model, x).module()
    assert nxp_pass()(upstream).modified
    assert max_error(upstream, x, want) > 1e-1
    outcome = adapters.transform(ours, [fuse_linear_bn()]).unwrap()
    assert [r.reason.code for r in outcome.report.rejections] == ["bn-training-mode"] and not outcome.changed
    assert max_error(ours, x, want) < 1e-5


def test_xnnpack_folds_a_rank3_bn_on_the_wrong_axis_fxpure_declines() -> None:
    # rules-research A1, "latent (by reading)": confirmed here
    model, x = example("rank3")
    want = model(*x).detach()
    upstream = xnnpack(edge_manager("rank3", "edge-linear"))
    assert count(upstream, "batch_norm") == 0
    assert max_error(upstream, x, want) > 1e-1
    ours = build("rank3", "edge-linear")
    outcome = adapters.transform(ours, [fuse_linear_bn()]).unwrap()
    assert [r.reason.code for r in outcome.report.rejections] == ["bn-axis-mismatch"] and not outcome.changed
    assert max_error(ours, x, want) < 1e-5


def test_plain_edge_and_non_affine_bn_fuse_where_xnnpack_does_not() -> None:
    # XNNPACK matches edge `linear` only (not permute_copy + addmm/mm) and needs a BN weight
    upstream_plain = xnnpack(edge_manager("mlp", "edge"))
    upstream_linear = xnnpack(edge_manager("mlp", "edge-linear"))
    assert count(upstream_plain, "batch_norm") == 2  # neither BN fused
    assert count(upstream_linear, "batch_norm") == 1  # the non-affine BN is left
    for form in ("edge", "edge-linear"):
        ours = build("mlp", form)
        assert len(adapters.transform(ours, [fuse_linear_bn()]).unwrap().report.plans) == 2
        assert count(ours, "batch_norm") == 0


def test_transposed_sequence_bn_fuses_where_nxp_does_not() -> None:
    # NXP matches a rank-2 linear right before the BN only
    model, x = example("seq")
    upstream = build("seq", "gm")
    assert isinstance(upstream, torch.fx.GraphModule) and not nxp_pass()(upstream).modified
    ours = build("seq", "gm")
    assert len(adapters.transform(ours, [fuse_linear_bn()]).unwrap().report.plans) == 2
    assert_close(run(ours, x), [model(*x).detach()])


class FlatBN(nn.Module):
    """A linear on a sequence (transposed or not), its output flattened to [N, F] for a
    BatchNorm1d over the features (``wide``: flattened to [B, T * F], the batch norm over those)."""

    def __init__(self, transposed: bool, bias: bool, wide: bool = False) -> None:
        super().__init__()
        self.transposed, self.wide = transposed, wide
        self.lin = nn.Linear(8, 6, bias=bias)
        self.bn = randomize_bn(nn.BatchNorm1d(30 if wide else 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.lin(x.transpose(1, 2) if self.transposed else x)
        out: torch.Tensor = self.bn(y.reshape(y.shape[0], -1) if self.wide else y.reshape(-1, 6))
        return out


@pytest.mark.parametrize("form", ["gm", "aten", "decomposed", "edge"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
def test_a_batch_norm_over_a_flattened_linear_output_is_fused(transposed: bool, bias: bool, form: str) -> None:
    # found by a hunt: declined producer-not-linear, "self of reshape comes from linear (...), not a
    # matrix product plus bias" (the flatten keeps each row one output's features: it fuses)
    model, x = FlatBN(transposed, bias).eval(), (torch.randn(2, 8, 5) if transposed else torch.randn(2, 5, 8),)
    ep = torch.export.export(copy.deepcopy(model), x)
    program: Program = ep.module() if form == "gm" else ep if form == "aten" else ep.run_decompositions()
    if form == "edge":
        program = to_edge(ep).exported_program()
    want = run(program, x)
    report = adapters.transform(program, [fuse_linear_bn()]).unwrap().report
    assert len(report.plans) == 1 and report.rejections == ()
    assert count(program, "batch_norm") == 0
    assert_sound(program, x, want)


@pytest.mark.parametrize("form", ["aten", "edge"])
def test_a_batch_norm_over_a_flatten_that_mixes_features_is_declined(form: str) -> None:
    model, x = FlatBN(False, True, wide=True).eval(), (torch.randn(2, 5, 8),)
    ep = torch.export.export(model, x)
    program = ep if form == "aten" else to_edge(ep).exported_program()
    report = adapters.transform(program, [fuse_linear_bn()]).unwrap().report
    assert report.plans == ()
    assert [r.reason.code for r in report.rejections] == ["bn-axis-mismatch"]
    assert "a reshape of the linear's output (2, 5, 6)" in report.rejections[0].reason.message


class FlattenBN(nn.Module):
    """A BatchNorm1d of ``channels`` on ``linear(x).flatten(*dims)``, which an aten program (and its
    GraphModule) keeps as ``aten.flatten.using_ints`` (decompositions and ``to_edge`` make it a view);
    ``transposed``: the linear reads ``x.transpose(1, 2)``."""

    def __init__(self, dims: tuple[int, int], channels: int = 6, transposed: bool = False, bias: bool = True) -> None:
        super().__init__()
        self.dims, self.transposed = dims, transposed
        self.lin = nn.Linear(8, 6, bias=bias)
        self.bn = randomize_bn(nn.BatchNorm1d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.lin(x.transpose(1, 2) if self.transposed else x)
        out: torch.Tensor = self.bn(y.flatten(*self.dims))
        return out


def flatten_program(model: nn.Module, x: tuple[torch.Tensor, ...], form: str) -> Program:
    """``model`` exported, as ``form`` holds it (``gm``: the unlifted GraphModule), its flatten kept."""
    ep = torch.export.export(copy.deepcopy(model), x)
    program: Program = ep.module() if form == "gm" else ep
    assert count(program, "aten.flatten.using_ints") == 1
    return program


@pytest.mark.parametrize("form", ["gm", "aten"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("dims", [(0, 1), (0, -2)], ids=["0,1", "0,-2"])
def test_a_batch_norm_over_a_flatten_of_the_leading_dims_is_fused(
    dims: tuple[int, int], transposed: bool, bias: bool, form: str
) -> None:
    # found by a review: an aten program keeps y.flatten(0, 1) as aten.flatten.using_ints, no view:
    # declined producer-not-linear there while the edge program (a view_copy) fused
    model = FlattenBN(dims, transposed=transposed, bias=bias).eval()
    x = (torch.randn(2, 8, 5) if transposed else torch.randn(2, 5, 8),)
    program = flatten_program(model, x, form)
    want = run(program, x)
    assert_close(want, [model(*x).detach()])
    report = adapters.transform(program, [fuse_linear_bn()]).unwrap().report
    assert len(report.plans) == 1 and report.rejections == ()
    assert count(program, "batch_norm") == 0
    assert count(program, "aten.flatten.using_ints") == 1  # the flatten re-emitted on the new linear
    assert_sound(program, x, want)


@pytest.mark.parametrize("form", ["gm", "aten"])
@pytest.mark.parametrize("dims", [(0, 0), (1, 1), (-1, -1)], ids=["0,0", "1,1", "-1,-1"])
def test_a_batch_norm_over_a_flatten_that_merges_nothing_is_fused_on_n_f(dims: tuple[int, int], form: str) -> None:
    # start_dim == end_dim: the [N, F] output as it is
    model, x = FlattenBN(dims).eval(), (torch.randn(10, 8),)
    program = flatten_program(model, x, form)
    want = run(program, x)
    report = adapters.transform(program, [fuse_linear_bn()]).unwrap().report
    assert len(report.plans) == 1 and report.rejections == ()
    assert count(program, "batch_norm") == 0
    assert_sound(program, x, want)


@pytest.mark.parametrize("form", ["gm", "aten"])
@pytest.mark.parametrize(
    ("dims", "channels", "merged"),
    [((1, 2), 30, "1 to 2"), ((-2, -1), 30, "1 to 2"), ((1, 1), 5, "1 to 1")],
    ids=["1,2", "-2,-1", "1,1"],
)
def test_a_batch_norm_over_a_flatten_that_leaves_the_features_off_dim_1_is_declined(
    dims: tuple[int, int], channels: int, merged: str, form: str
) -> None:
    # flatten(1, 2) merges the features into [B, T * F]; flatten(1, 1) leaves [B, T, F], dim 1 T
    model, x = FlattenBN(dims, channels).eval(), (torch.randn(2, 5, 8),)
    program = flatten_program(model, x, form)
    want = run(program, x)
    report = adapters.transform(program, [fuse_linear_bn()]).unwrap().report
    assert report.plans == ()
    assert [r.reason.code for r in report.rejections] == ["bn-axis-mismatch"]
    message = report.rejections[0].reason.message
    assert "a reshape of the linear's output (2, 5, 6)" in message and f"(its dims {merged} merged)" in message
    assert count(program, "batch_norm") == 1
    assert_close(run(program, x), want)  # left as it was


class LevitMLP(nn.Module):
    """LeViT's MLPLayerWithBN: a batch norm of the linear's flattened output, reshaped as the output."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.bn = nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.linear(h)
        out: torch.Tensor = self.bn(h.flatten(0, 1)).reshape_as(h)
        return out


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("form", ["gm", "aten", "edge"])
def test_a_batch_norm_reshaped_as_the_linears_output_fuses(form: str, dynamic: bool) -> None:
    # found by a hunt of Hugging Face models: every LeViT linear + batch norm was declined
    # linear-output-shared in the aten forms, reshape_as reading the linear's output for its sizes
    # only (edge spells it view_copy of literal sizes, and fused)
    model, x = randomize_bn(LevitMLP()).eval(), (torch.randn(2, 5, 8),)
    shapes = ({0: Dim("B", min=1, max=8)},) if dynamic else None
    ep = torch.export.export(model, x, dynamic_shapes=shapes)
    program: Program = ep if form == "aten" else ep.module() if form == "gm" else to_edge(ep).exported_program()
    outcome = adapters.transform(program, [fuse_linear_bn()]).unwrap()
    assert len(outcome.report.plans) == 1 and outcome.report.rejections == ()
    assert count(program, "batch_norm") == 0
    for batch in (2, 3) if dynamic else (2,):
        y = (torch.randn(batch, 5, 8),)
        assert_close(run(program, y), [model(*y)])


class _DroppedThenMoved(nn.Module):
    """A linear on [B, T, F], its dropout (or a copy), then moved to [B, F, T] or flattened, then BatchNorm1d."""

    def __init__(self, how: str, between: str) -> None:
        super().__init__()
        self.lin, self.bn, self.how = nn.Linear(5, 6), nn.BatchNorm1d(6), how
        self.between = nn.Dropout(0.2, inplace=between == "inplace") if between != "copy" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        y = self.between(y) if self.between is not None else y.clone()
        out: torch.Tensor = self.bn(y.transpose(1, 2) if self.how == "transpose" else y.flatten(0, 1))
        return out


@pytest.mark.parametrize("form", ["gm", "aten", "edge"])
@pytest.mark.parametrize("between", ["dropout", "inplace", "copy"])
@pytest.mark.parametrize("how", ["transpose", "flatten"])
def test_a_dropout_or_copy_before_the_permute_or_flatten_fuses(how: str, between: str, form: str) -> None:
    # found by a review: linear -> dropout -> transpose -> BatchNorm1d (a common ordering) was declined
    model, x = randomize_bn(_DroppedThenMoved(how, between)).eval(), (torch.randn(2, 4, 5),)
    want = [model(*x).detach()]
    ep = torch.export.export(copy.deepcopy(model), x)
    program: Program = ep.module() if form == "gm" else ep if form == "aten" else to_edge(ep).exported_program()
    report = adapters.transform(program, [fuse_linear_bn()]).unwrap().report
    assert len(report.plans) == 1 and report.rejections == ()
    assert count(program, "batch_norm") == 0 and count(program, "dropout") == 0
    assert_sound(program, x, want)


class LoRAInForward(nn.Module):
    """A linear whose weight is merged with its low-rank adapter in forward, ``W + B @ A`` (a
    ``matmul`` of two parameters in an aten program, ``mm`` on edge), then a batch norm."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w, self.b = nn.Parameter(torch.randn(6, 8, generator=g)), nn.Parameter(torch.randn(6, generator=g))
        self.lora_a, self.lora_b = (
            nn.Parameter(torch.randn(2, 8, generator=g)),
            nn.Parameter(torch.randn(6, 2, generator=g)),
        )
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.bn(nn.functional.linear(x, self.w + self.lora_b @ self.lora_a, self.b))
        return y


@pytest.mark.parametrize("form", ["gm", "aten", "edge"])
def test_a_weight_merged_with_its_lora_in_forward_is_a_constant_folded(form: str) -> None:
    model, x = randomize_bn(LoRAInForward()), (torch.randn(3, 8),)
    program = build_form(model, x, form)
    want = run(program, x)
    outcome = adapters.transform(program, [fuse_linear_bn()]).unwrap()
    assert len(outcome.report.plans) == 1 and not outcome.report.rejections
    # the product and the sum that computed the weight are folded into it, their parameters gone
    assert sum(count(program, op) for op in ("aten.mm.", "aten.matmul.", "aten.add.")) == 0
    assert_sound(program, x, want)
    held = program.state_dict if isinstance(program, ExportedProgram) else dict(program.named_parameters())
    assert not {"w", "lora_a", "lora_b"} & set(held)

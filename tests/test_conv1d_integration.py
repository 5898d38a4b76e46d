"""conv1d_to_conv2d end to end on audio models: every program form with dynamic batch and length,
declines, shared weights, PT2E-quantized weights, composition with split_group_conv, lowering to
ExecuTorch, and upstream (ExecuTorch ConvertConv1dToConv2dPass, XNNPACK Conv1dUnsqueezePass) on
the same programs."""

from __future__ import annotations

import copy
import sys
import types
from typing import Any

import executorch.kernels.quantized  # type: ignore[import-untyped]  # noqa: F401  (the quantize ops' out variants)
import pytest
import torch
from executorch.backends.transforms.convert_conv1d_to_conv2d_pass import (  # type: ignore[import-untyped]
    ConvertConv1dToConv2dPass,
)
from executorch.backends.xnnpack._passes.conv1d_unsqueeze_pass import (  # type: ignore[import-untyped]
    Conv1dUnsqueezePass,
)
from executorch.exir import EdgeProgramManager, to_edge
from torch import nn
from torch.export import Dim, ExportedProgram

import adapters
from fxpure.rules import split_group_conv
from fxpure.rules.conv1d_to_conv2d import conv1d_to_conv2d
from tests.int8_ties import assert_int8_equal
from tests.programs import Program, assert_close, assert_sound, build, dead_constants, run, run_pte
from tests.quantized import pt2e


class AudioEncoder(nn.Module):
    """A 1D conv front end: plain, strided grouped, dilated "same", and "valid" pointwise convs."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv1d(4, 16, 5, padding=2),
            nn.ReLU(),
            nn.Conv1d(16, 16, 3, stride=2, padding=1, groups=4),
            nn.ReLU(),
            nn.Conv1d(16, 32, 4, dilation=2, padding="same"),  # even kernel: asymmetric padding
            nn.ReLU(),
            nn.Conv1d(32, 24, 1, padding="valid", bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        return out


class AudioAutoencoder(nn.Module):
    """The encoder, then a transposed-conv decoder back to the input's rate (one grouped)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = AudioEncoder()
        self.decoder = nn.Sequential(
            nn.ConvTranspose1d(24, 16, 4, stride=2, padding=1),
            nn.ReLU(),
            nn.ConvTranspose1d(16, 8, 3, padding=1, groups=2, bias=False),
            nn.ReLU(),
            nn.ConvTranspose1d(8, 4, 3, stride=2, padding=1, output_padding=1, dilation=1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.decoder(self.encoder(x))
        return out


class GroupedTCN(nn.Module):
    """A temporal conv net of grouped conv1d (in split_group_conv's policy)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Conv1d(4, 16, 3, padding=1)
        self.blocks = nn.ModuleList(
            [nn.Conv1d(16, 16, 3, padding=d, dilation=d, groups=g) for d, g in ((1, 2), (2, 4))]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + torch.relu(block(x))
        return x


class TiedConvs(nn.Module):
    """Two conv1d layers sharing one weight (a weight-tied stack)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv1d(8, 8, 3, padding=1)
        self.b = nn.Conv1d(8, 8, 3, padding=1)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b(torch.relu(self.a(x)))
        return out


class WeightAlsoRead(nn.Module):
    """A conv1d whose weight another op also reads (a weight statistic, as in weight norm)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 6, 3, padding=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv(x), self.conv.weight.mean(-1)


class ComputedWeight(nn.Module):
    """One conv1d with a weight computed at run time (from the input), one with a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scaled = nn.functional.conv1d(x, self.conv.weight * x.mean(), padding=1)
        out: torch.Tensor = self.conv(scaled)
        return out


class GainWeight(nn.Module):
    """One conv1d with a weight the graph computes from constants (a parameter times a gain)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3, padding=1)
        self.gain = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = nn.functional.conv1d(x, self.conv.weight * self.gain, padding=1)
        return out


LENGTH = Dim("length", min=4, max=64)
DYNAMIC = ({0: Dim("batch", min=1, max=8), 2: 4 * LENGTH},)  # lengths 16, 20, ..., 256


def make(cls: type[nn.Module]) -> nn.Module:
    """The model, in eval mode, with the same parameters every time."""
    torch.manual_seed(0)
    return cls().eval()


def example(cls: type[nn.Module], batch: int = 2, length: int = 32) -> tuple[torch.Tensor, ...]:
    first = next(m for m in make(cls).modules() if isinstance(m, nn.Conv1d | nn.ConvTranspose1d))
    g = torch.Generator().manual_seed(batch * 1000 + length)
    return (torch.randn(batch, first.in_channels, length, generator=g),)


_EDGE: dict[tuple[type[nn.Module], bool, bool], EdgeProgramManager] = {}


def edge(cls: type[nn.Module], *, dynamic: bool = True, quantized: bool = False) -> EdgeProgramManager:
    """A fresh copy of the model's edge program (to_edge runs once per model and kind)."""
    key = (cls, dynamic, quantized)
    if key not in _EDGE:
        model, shapes = make(cls), DYNAMIC if dynamic else None
        ep = (
            pt2e(model, example(cls), dynamic=shapes)
            if quantized
            else torch.export.export(model, example(cls), dynamic_shapes=shapes)
        )
        _EDGE[key] = to_edge(ep)
    return copy.deepcopy(_EDGE[key])


def export(cls: type[nn.Module], form: str, *, dynamic: bool = True) -> Program:
    if form == "edge":
        return edge(cls, dynamic=dynamic).exported_program()
    ep = torch.export.export(make(cls), example(cls), dynamic_shapes=DYNAMIC if dynamic else None)
    return ep.module() if form == "gm" else ep


def eager(cls: type[nn.Module], x: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """The model's outputs in eager mode."""
    with torch.no_grad():
        out = make(cls)(*x)
    return [t.detach() for t in (out if isinstance(out, tuple) else (out,))]


def conv_weight_ranks(program: Program) -> list[int]:
    """The weight rank of every convolution left in the program (3: a 1D conv)."""
    gm = program.graph_module if isinstance(program, ExportedProgram) else program
    return [
        n.args[1].meta["val"].dim()
        for n in gm.graph.nodes
        if n.op == "call_function" and "conv" in str(n.target) and isinstance(n.args[1], torch.fx.Node)
    ]


@pytest.mark.parametrize("form", ["gm", "aten", "edge"])
def test_audio_autoencoder_all_convs_2d_with_dynamic_batch_and_length(form: str) -> None:
    program = export(AudioAutoencoder, form)
    outcome = adapters.transform(program, [conv1d_to_conv2d()]).unwrap()
    assert len(outcome.report.plans) == 7 and outcome.report.rejections == ()
    assert conv_weight_ranks(program) == [4] * 7
    for batch, length in ((3, 40), (8, 256)):  # sizes other than the example's
        x = example(AudioAutoencoder, batch, length)
        assert_sound(program, x, eager(AudioAutoencoder, x))


def test_edge_program_lowers_and_runs_in_executorch() -> None:
    manager = edge(AudioAutoencoder)
    adapters.transform(manager.exported_program(), [conv1d_to_conv2d()]).unwrap()
    buffer = manager.to_executorch().buffer
    for batch, length in ((2, 32), (3, 48)):
        x = example(AudioAutoencoder, batch, length)
        assert_close(run_pte(buffer, x), eager(AudioAutoencoder, x))


def test_weight_shared_by_two_convs_becomes_one_constant() -> None:
    program = export(TiedConvs, "aten")
    assert isinstance(program, ExportedProgram)
    outcome = adapters.transform(program, [conv1d_to_conv2d()]).unwrap()
    assert len(outcome.report.plans) == 2
    convs = [n for n in program.graph.nodes if n.op == "call_function" and "conv" in str(n.target)]
    (weight,) = {n.args[1].name for n in convs}
    target = program.graph_signature.inputs_to_parameters[weight]
    assert program.state_dict[target].shape == (8, 8, 1, 3)
    assert "a.weight" not in program.state_dict  # the 3D original is gone with its last reader
    x = example(TiedConvs, 3, 20)
    assert_sound(program, x, eager(TiedConvs, x))


def test_weight_read_by_another_op_stays_for_it() -> None:
    program = edge(WeightAlsoRead, dynamic=False).exported_program()
    outcome = adapters.transform(program, [conv1d_to_conv2d()]).unwrap()
    assert len(outcome.report.plans) == 1
    assert program.state_dict["conv.weight"].shape == (6, 4, 3)  # untouched for the mean
    x = example(WeightAlsoRead)
    assert_sound(program, x, eager(WeightAlsoRead, x))


def test_declines_computed_weight_and_converts_the_rest() -> None:
    program = export(ComputedWeight, "aten")
    outcome = adapters.transform(program, [conv1d_to_conv2d()]).unwrap()
    (rejection,) = outcome.report.rejections
    assert (rejection.reason.code, rejection.reason.path) == ("not-constant", "conv.weight")
    assert rejection.node == "conv1d"
    assert len(outcome.report.plans) == 1 and sorted(conv_weight_ranks(program)) == [3, 4]
    x = example(ComputedWeight, 2, 24)
    assert_sound(program, x, eager(ComputedWeight, x))


def test_program_untouched_when_everything_declines() -> None:
    class OnlyComputed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.conv1d(x, self.w.flip(-1))

    program = torch.export.export(OnlyComputed(), (torch.randn(1, 4, 8),))
    before = program.graph_module.code
    outcome = adapters.transform(program, [conv1d_to_conv2d()]).unwrap()
    assert not outcome.changed and [r.reason.code for r in outcome.report.rejections] == ["not-constant"]
    assert program.graph_module.code == before


@pytest.mark.parametrize("form", ["gm", "aten", "edge"])
def test_split_group_conv_then_conv1d_converts_the_split_convs(form: str) -> None:
    """ET PR #22213: upstream's conv1d pass stopped converting grouped conv1d once a grouped-conv
    split made their weights graph-local slices. fxpure's split weights are derived constants."""
    manager = edge(GroupedTCN) if form == "edge" else None
    program = manager.exported_program() if manager is not None else export(GroupedTCN, form)
    outcome = adapters.transform(program, [split_group_conv(), conv1d_to_conv2d()]).unwrap()
    rules = [p.rule for p in outcome.report.plans]
    assert rules.count("split-group-conv") == 2 and rules.count("conv1d-to-conv2d") == 1 + 2 + 4
    assert outcome.report.rejections == ()
    assert conv_weight_ranks(program) == [4] * 7
    x = example(GroupedTCN, 3, 24)
    assert_sound(program, x, eager(GroupedTCN, x))
    if manager is not None:
        assert_close(run_pte(manager.to_executorch().buffer, x), eager(GroupedTCN, x))


def _weights(ep: ExportedProgram) -> list[Any]:
    return [n.args[1] for n in ep.graph.nodes if n.op == "call_function" and "convolution" in str(n.target)]


def weight_axes(ep: ExportedProgram) -> list[int | None]:
    """Per conv, the axis of the per-channel dequantize its weight comes from (None: a float weight)."""
    return [w.args[3] if "dequantize_per_channel" in str(w.target) else None for w in _weights(ep)]


def weight_dtypes(ep: ExportedProgram) -> list[torch.dtype]:
    """Per conv, the dtype of its stored weight (behind the dequantize, if any)."""
    return [(w.args[0] if "dequantize" in str(w.target) else w).meta["val"].dtype for w in _weights(ep)]


def test_quantized_conv1d_weights_behind_dequantize_convert_and_int8_outputs_match() -> None:
    manager = edge(AudioAutoencoder, quantized=True)
    ep = manager.exported_program()
    original = copy.deepcopy(ep)
    axes = weight_axes(original)
    assert sum(a is not None for a in axes) == 6  # XNNPACK's quantizer leaves the grouped transposed conv float
    outcome = adapters.transform(ep, [conv1d_to_conv2d()]).unwrap()
    assert len(outcome.report.plans) == 7 and outcome.report.rejections == ()
    assert conv_weight_ranks(ep) == [4] * 7
    # each int8 weight is now 4D behind a new dequantize, its axis still on the output channels
    assert weight_axes(ep) == axes and weight_dtypes(ep) == weight_dtypes(original)
    assert dead_constants(ep) == []
    ties = sum(assert_int8_equal(original, ep, example(AudioAutoencoder, b, n)) for b, n in ((2, 32), (3, 44)))
    assert ties <= 2  # float32 rounding ties only (see assert_int8_equal)
    x = example(AudioAutoencoder, 2, 36)
    assert_close(run_pte(manager.to_executorch().buffer, x), run(ep, x))
    # upstream's common pass leaves every conv whose weight sits behind a dequantize 1D
    upstream = edge(AudioAutoencoder, quantized=True)
    upstream = upstream.transform([ConvertConv1dToConv2dPass(upstream.exported_program())])
    assert conv_weight_ranks(upstream.exported_program()) == [3 if a is not None else 4 for a in axes]


def test_the_graph_module_convert_pt2e_returns_converts() -> None:
    # convert_pt2e's weight dequantize has no meta["val"] and reads a get_attr int8 tensor: its value
    # is computed from that tensor, made fake with its own static sizes (a fresh symbol per size
    # before, which the new conv's weight could not be made from: apply-failed KeyError 's93')
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    model = nn.Sequential(nn.Conv1d(8, 16, 3, padding=1), nn.ReLU()).eval()
    x = (torch.randn(1, 8, 20),)
    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True))
    prepared = prepare_pt2e(torch.export.export(model, x).module(), quantizer)
    prepared(*x)
    gm = convert_pt2e(prepared)
    want = gm(*x)
    outcome = adapters.transform(gm, [conv1d_to_conv2d()]).unwrap()
    assert [p.anchor for p in outcome.report.plans] == ["conv1d"] and outcome.changed
    (dq,) = [n for n in gm.graph.nodes if n.target == torch.ops.quantized_decomposed.dequantize_per_channel.default]
    assert dq.meta["val"].shape == (16, 8, 1, 3)
    assert torch.equal(gm(*x), want)


# --- upstream on the same programs ----------------------------------------------------------------


def _upstream(cls: type[nn.Module], upstream_pass: Any) -> ExportedProgram:
    manager = edge(cls, dynamic=False)
    return manager.transform([upstream_pass(manager.exported_program())]).exported_program()


def test_upstream_skips_a_weight_another_op_reads() -> None:
    assert conv_weight_ranks(_upstream(WeightAlsoRead, ConvertConv1dToConv2dPass)) == [3]  # silently, no reason
    ours = edge(WeightAlsoRead, dynamic=False).exported_program()
    adapters.transform(ours, [conv1d_to_conv2d()]).unwrap()
    assert conv_weight_ranks(ours) == [4]


def test_upstream_xnnpack_corrupts_a_weight_another_op_reads() -> None:
    """XNNPACK unsqueezes the parameter in place: the other reader silently gets the 4D weight."""
    x = example(WeightAlsoRead)
    got, want = run(_upstream(WeightAlsoRead, Conv1dUnsqueezePass), x), eager(WeightAlsoRead, x)
    assert got[1].shape == (6, 4, 3) and want[1].shape == (6, 4)  # mean(-1) now averages a unit dim
    ours = edge(WeightAlsoRead, dynamic=False).exported_program()
    adapters.transform(ours, [conv1d_to_conv2d()]).unwrap()
    assert_sound(ours, x, want)


def test_upstream_xnnpack_fails_on_tied_convs() -> None:
    """XNNPACK makes the shared weight 4D for the first conv and leaves the second 1D conv on it."""
    with pytest.raises(Exception, match="Conv1dUnsqueezePass") as info:
        _upstream(TiedConvs, Conv1dUnsqueezePass)
    assert "4-dimensional weight" in str(info.value.__cause__)
    ours = edge(TiedConvs, dynamic=False).exported_program()
    assert len(adapters.transform(ours, [conv1d_to_conv2d()]).unwrap().report.plans) == 2
    x = example(TiedConvs)
    assert_sound(ours, x, eager(TiedConvs, x))


def test_upstream_xnnpack_raises_on_a_computed_weight() -> None:
    with pytest.raises(Exception, match="Conv1dUnsqueezePass") as info:
        _upstream(ComputedWeight, Conv1dUnsqueezePass)
    assert isinstance(info.value.__cause__, AssertionError)
    ours = edge(ComputedWeight, dynamic=False).exported_program()
    outcome = adapters.transform(ours, [conv1d_to_conv2d()]).unwrap()
    assert [r.reason.code for r in outcome.report.rejections] == ["not-constant"]


def test_upstream_xnnpack_raises_on_a_weight_computed_from_constants_which_fxpure_converts() -> None:
    with pytest.raises(Exception, match="Conv1dUnsqueezePass"):
        _upstream(GainWeight, Conv1dUnsqueezePass)
    ours = edge(GainWeight, dynamic=False).exported_program()
    outcome = adapters.transform(ours, [conv1d_to_conv2d()]).unwrap()
    assert len(outcome.report.plans) == 1 and outcome.report.rejections == ()
    assert conv_weight_ranks(ours) == [4] and "gain" not in str(ours.state_dict.keys())
    x = example(GainWeight)
    assert_sound(ours, x, eager(GainWeight, x))


class _StandIn(types.ModuleType):
    """Any attribute is another stand-in: enough for the module-level names Arm's passes import
    from the proprietary TOSA serializer (only to import them here; nothing of it runs)."""

    def __getattr__(self, name: str) -> _StandIn:
        if name.startswith("__"):
            raise AttributeError(name)
        return _StandIn(f"{self.__name__}.{name}")

    def __call__(self, *args: object, **kwargs: object) -> _StandIn:
        return _StandIn(self.__name__)

    def __mro_entries__(self, bases: tuple[type, ...]) -> tuple[type, ...]:
        return (object,)


def test_upstream_arm_split_then_common_pass_leaves_the_split_convs_1d() -> None:
    """ET PR #22213 as it happens upstream: Arm's grouped-conv split slices the weight in the graph,
    and the common conv1d pass skips graph-local weights unless a backend allow-lists them."""
    sys.modules.setdefault("tosa_serializer", _StandIn("tosa_serializer"))
    from executorch.backends.arm._passes.decompose_grouped_conv_pass import (  # type: ignore[import-untyped]
        DecomposeGroupedConvPass,
    )

    split = edge(GroupedTCN).transform([DecomposeGroupedConvPass()])
    result = split.transform([ConvertConv1dToConv2dPass(split.exported_program())]).exported_program()
    ranks = conv_weight_ranks(result)
    assert ranks.count(3) == 2 + 4 and ranks.count(4) == 1  # only the ungrouped input conv
    ours = edge(GroupedTCN).exported_program()
    adapters.transform(ours, [split_group_conv(), conv1d_to_conv2d()]).unwrap()
    assert conv_weight_ranks(ours) == [4] * 7


class WeightNormed(nn.Module):
    """A vocoder's conv1d under weight normalisation: its weight is ``g * v / ||v||``, computed in
    forward (aten: ``_weight_norm``; edge: ``pow``, ``sum``, ``pow``, ``div``, ``mul``)."""

    def __init__(self, dim: int = 0) -> None:
        super().__init__()
        self.conv = torch.nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 6, 3, padding=1), dim=dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.conv(x)
        return out


@pytest.mark.parametrize("dim", [0, 1])  # dim 1: the norm per input channel (edge computes it through a permute)
@pytest.mark.parametrize("form", ["gm", "aten", "edge"])
def test_a_weight_normalised_conv_has_a_constant_weight_and_converts(form: str, dim: int) -> None:
    torch.manual_seed(0)
    model, x = WeightNormed(dim).eval(), (torch.randn(2, 4, 16),)
    p = build(model, x, form)
    want = run(p, x)
    outcome = adapters.transform(p, [conv1d_to_conv2d()]).unwrap()
    assert len(outcome.report.plans) == 1 and outcome.report.rejections == ()
    assert conv_weight_ranks(p) == [4]
    assert_sound(p, x, want)

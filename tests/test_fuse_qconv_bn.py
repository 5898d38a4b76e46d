"""The outside author's ``fuse-qconv-bn`` (``tests/fuse_qconv_bn.py``) on real PT2E programs
(XNNPACKQuantizer, per-channel symmetric int8; the quantizer's own conv + bn fold switched off, so
that the batch norm stays after the quantized conv): the batch norm goes, the new int8 weight
reproduces the folded float weight to within half a step of its new scale per channel (where
Cadence's original scales would clip), the program computes what it did, leaves no dead constant,
and lowers through XNNPACK and runs."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torchao.quantization.pt2e.quantize_pt2e as quantize_pt2e
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
    XNNPACKQuantizer,
    get_symmetric_quantization_config,
)
from executorch.exir import to_edge
from torch import nn
from torch.export import ExportedProgram

import adapters
from adapters.passes import RulesPass
from tests.fuse_qconv_bn import TINY, fuse_qconv_bn
from tests.programs import count, dead_constants, run, run_pte, validate
from tests.quantized import tensor

qd = torch.ops.quantized_decomposed


class ConvBn(nn.Module):
    """Two conv + bn blocks: one with a bias and an affine bn whose |gamma / sigma| spans 0.2 to 8,
    some negative; one with no conv bias and a bn with no affine."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 4, 1, bias=False), nn.BatchNorm2d(4, affine=False)
        with torch.no_grad():
            sign = torch.tensor([1.0, -1.0] * 4)
            self.bn1.weight.copy_(sign * torch.tensor([0.2, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 8.0]))
            self.bn1.bias.copy_(torch.randn(8, generator=g))
            for bn in (self.bn1, self.bn2):
                c = bn.num_features
                assert bn.running_mean is not None and bn.running_var is not None
                bn.running_mean.copy_(torch.randn(c, generator=g) * 0.1)
                bn.running_var.copy_(torch.rand(c, generator=g) * 0.5 + 0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return out


def _x() -> tuple[torch.Tensor, ...]:
    return (torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1)),)


@pytest.fixture
def unfused(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """prepare_pt2e without its conv + bn fold (a stand-in for a quantizer that keeps the batch norm)."""
    monkeypatch.setattr(quantize_pt2e, "_fuse_conv_bn_", lambda model: None)
    yield


def _pt2e(model: nn.Module, x: tuple[torch.Tensor, ...]) -> ExportedProgram:
    gm = torch.export.export(copy.deepcopy(model).eval(), x).module()
    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True))
    prepared = quantize_pt2e.prepare_pt2e(gm, quantizer)
    prepared(*x)
    return torch.export.export(quantize_pt2e.convert_pt2e(prepared), x)


def _step(program: ExportedProgram) -> float:
    """The output quantize's scale (the last quantize_per_tensor of the program)."""
    qs = [n for n in program.graph.nodes if str(n.target).endswith("quantize_per_tensor.default")]
    return float(qs[-1].args[1])


def _convs(program: ExportedProgram) -> list[torch.fx.Node]:
    return [n for n in program.graph.nodes if n.op == "call_function" and "conv" in str(n.target)]


def _weight(program: ExportedProgram, conv: torch.fx.Node) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The int8 weight, scales and range of the dequantize_per_channel a conv reads."""
    dq = conv.args[1]
    assert isinstance(dq, torch.fx.Node) and "dequantize_per_channel" in str(dq.target)
    wq, scales = (tensor(program, a) for a in dq.args[:2])  # type: ignore[arg-type]
    return wq, scales, int(dq.args[4]), int(dq.args[5])  # type: ignore[arg-type]


def _k(program: ExportedProgram, bn: torch.fx.Node) -> torch.Tensor:
    """k = gamma / sqrt(var + eps) of an aten batch_norm node."""
    gamma, var = bn.args[1], bn.args[4]
    assert isinstance(var, torch.fx.Node)
    v = tensor(program, var)
    g = tensor(program, gamma) if isinstance(gamma, torch.fx.Node) else torch.ones_like(v)
    return g / torch.sqrt(v + float(bn.args[7]))  # type: ignore[arg-type]


@pytest.mark.usefixtures("unfused")
def test_the_new_int8_weight_is_the_folded_weight_within_half_a_step_and_cadence_would_clip() -> None:
    program = _pt2e(ConvBn(), _x())
    before = {c.name: (_weight(program, c), _k(program, next(iter(c.users)))) for c in _convs(program)}
    outcome = adapters.transform(program, [fuse_qconv_bn]).unwrap()
    assert len(outcome.report.plans) == 2 and not outcome.report.rejections
    assert count(program, "batch_norm") == 0
    provenance = {n.name: n.provenance for n in outcome.report.after.nodes}
    clipped = 0
    for conv in _convs(program):
        source = provenance[conv.name]
        assert source is not None
        (wq, scales, low, high), k = before[source]
        folded = (wq.float() * scales.reshape(-1, 1, 1, 1)) * k.reshape(-1, 1, 1, 1)
        new_wq, new_scales, new_low, new_high = _weight(program, conv)
        assert new_wq.dtype == torch.int8 and (new_low, new_high) == (low, high) == (-127, 127)
        assert not isinstance(new_wq, nn.Parameter) and not isinstance(new_scales, nn.Parameter)  # (buffers)
        half = new_scales.reshape(-1, 1, 1, 1) / 2
        assert ((new_wq.float() * new_scales.reshape(-1, 1, 1, 1) - folded).abs() <= half * 1.0001).all()
        assert torch.allclose(new_scales, torch.clamp(scales * k.abs(), min=TINY), rtol=1e-6)
        assert torch.equal(new_wq.float(), wq.float() * k.sign().reshape(-1, 1, 1, 1))  # exact: the sign goes in
        # Cadence's requantization with the original scales clips every channel whose |k| > 1
        cadence = (folded / scales.reshape(-1, 1, 1, 1)).round().clamp(low, high) * scales.reshape(-1, 1, 1, 1)
        clipped += int(((cadence - folded).abs() > scales.reshape(-1, 1, 1, 1) / 2 * 1.0001).any(dim=(1, 2, 3)).sum())
    assert clipped >= 4  # (the channels of bn1 with |gamma| >= 2, at least)


@pytest.mark.usefixtures("unfused")
def test_a_channel_a_zero_gamma_silences_gets_the_floor_scale_and_zero_weights() -> None:
    model, x = ConvBn().eval(), _x()
    with torch.no_grad():
        model.bn1.weight[2] = 0.0
    program = _pt2e(model, x)
    expected = program.module()(*x)
    adapters.transform(program, [fuse_qconv_bn]).unwrap()
    new_wq, new_scales, _, _ = _weight(program, _convs(program)[0])
    assert new_scales[2] == TINY and not new_wq[2].any() and bool((new_scales > TINY).sum() == 7)
    assert torch.allclose(program.module()(*x), expected, atol=_step(program) * 1.01)


@pytest.mark.usefixtures("unfused")
@pytest.mark.parametrize("form", ["gm", "aten", "edge"])
def test_the_program_computes_what_it_did_and_leaves_no_dead_constant(form: str) -> None:
    x = _x()
    original = _pt2e(ConvBn(), x)
    want = run(original, x)
    prog: ExportedProgram | torch.fx.GraphModule = copy.deepcopy(original)
    if form == "edge":
        prog = to_edge(original).exported_program()
    elif form == "gm":
        prog = original.module()
    outcome = adapters.transform(prog, [fuse_qconv_bn]).unwrap()
    assert len(outcome.report.plans) == 2 and not outcome.report.rejections
    assert count(prog, "batch_norm") == 0 and count(prog, "dequantize_per_channel") == 2
    got = run(prog, x)
    # the outputs are quantized: a float difference in the last bits may move one to the next step
    step = _step(original)
    assert (got[0] - want[0]).abs().max().item() <= step * 1.0001
    assert (got[0] != want[0]).float().mean().item() < 0.02
    assert dead_constants(prog) == []
    if isinstance(prog, ExportedProgram):
        validate(prog)


@pytest.mark.usefixtures("unfused")
def test_the_edge_program_lowers_through_xnnpack_and_runs() -> None:
    x = _x()
    original = _pt2e(ConvBn(), x)
    want = run(original, x)
    edge = to_edge(copy.deepcopy(original)).transform([RulesPass([fuse_qconv_bn])])
    assert count(edge.exported_program(), "batch_norm") == 0
    lowered = edge.to_backend(XnnpackPartitioner())
    assert count(lowered.exported_program(), "convolution") == 0  # (each conv runs in the delegate)
    got = run_pte(lowered.to_executorch().buffer, x)
    step = _step(original)
    assert (got[0] - want[0]).abs().max().item() <= 2 * step * 1.0001


def test_training_mode_a_shared_conv_output_and_asymmetric_zero_points_are_declined() -> None:
    class Hand(nn.Module):
        """Convs of a PT2E-shaped int8 weight (zero points given), each followed by a batch norm."""

        def __init__(self, zp: int, *, shared: bool) -> None:
            super().__init__()
            w = torch.randn(4, 3, 3, 3, generator=torch.Generator().manual_seed(0))
            scale = w.abs().amax(dim=(1, 2, 3)) / 127
            self.register_buffer("scale", scale)
            self.register_buffer("zp", torch.full((4,), zp, dtype=torch.int64))
            self.register_buffer("wq", qd.quantize_per_channel(w, scale, self.zp, 0, -127, 127, torch.int8))
            self.bn, self.shared = nn.BatchNorm2d(4), shared

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = qd.dequantize_per_channel(self.wq, self.scale, self.zp, 0, -127, 127, torch.int8)
            y = nn.functional.conv2d(x, w)
            out: torch.Tensor = self.bn(y) + y if self.shared else self.bn(y)
            return out

    x = _x()
    cases = [
        (Hand(0, shared=False).train(), "bn-training-mode"),
        (Hand(0, shared=True).eval(), "conv-output-shared"),
        (Hand(3, shared=False).eval(), "asymmetric-weight"),
    ]
    for model, code in cases:
        program = torch.export.export(model, x)
        outcome = adapters.transform(program, [fuse_qconv_bn]).unwrap()
        assert not outcome.changed and [j.reason.code for j in outcome.report.rejections] == [code], code
    # and a weight all of whose zero points are 0 is folded, the old int8 weight gone
    program = torch.export.export(Hand(0, shared=False).eval(), x)
    want = run(program, x)
    outcome = adapters.transform(program, [fuse_qconv_bn]).unwrap()
    assert len(outcome.report.plans) == 1 and dead_constants(program) == []
    assert torch.allclose(run(program, x)[0], want[0], atol=1e-5)

"""The outside author's ``bn-to-depthwise`` rule (``tests/bn_to_depthwise.py``) and
``fuse-or-depthwise`` on exported programs: every form computes what the model did, no batch norm
and no dead constant is left, and the edge program lowers through XNNPACK, which runs every conv, and runs."""

from __future__ import annotations

import pytest
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import to_edge
from torch import nn

import adapters
from adapters.passes import RulesPass
from fxpure.pattern import PatternRule
from tests.bn_to_depthwise import FUSE_OR_DEPTHWISE, bn_to_depthwise
from tests.programs import FORMS, assert_close, assert_sound, build, count, run_pte


def _stats(bn: nn.BatchNorm2d, g: torch.Generator) -> nn.BatchNorm2d:
    c = bn.num_features
    assert bn.running_mean is not None and bn.running_var is not None  # (tracked)
    with torch.no_grad():
        bn.running_mean.copy_(torch.rand(c, generator=g) * 2 - 1)
        bn.running_var.copy_(torch.rand(c, generator=g) + 0.5)
        if bn.affine:
            bn.weight.copy_(torch.rand(c, generator=g) + 0.5)
            bn.bias.copy_(torch.rand(c, generator=g) * 2 - 1)
    return bn


class Standalone(nn.Module):
    """A batch norm of the input, one after a conv, one after a relu (no affine), and a residual's."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn_in, self.bn_conv = _stats(nn.BatchNorm2d(3), g), _stats(nn.BatchNorm2d(8), g)
        self.bn_relu, self.bn_sum = _stats(nn.BatchNorm2d(8, affine=False), g), _stats(nn.BatchNorm2d(8), g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn_relu(torch.relu(self.bn_conv(self.conv(self.bn_in(x)))))
        out: torch.Tensor = self.bn_sum(y + 1.0)
        return out


def _x() -> tuple[torch.Tensor, ...]:
    return (torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1)),)


@pytest.mark.parametrize("made", [bn_to_depthwise, FUSE_OR_DEPTHWISE], ids=lambda r: r.name)
@pytest.mark.parametrize("form", FORMS)
def test_every_batch_norm_goes_and_the_program_computes_what_the_model_did(form: str, made: PatternRule) -> None:
    model, x = Standalone().eval(), _x()
    program = build(model, x, form)
    with torch.no_grad():
        want = [model(*x)]
    outcome = adapters.transform(program, [made]).unwrap()
    assert len(outcome.report.plans) == 4 and not outcome.report.rejections
    assert count(program, "batch_norm") == 0
    # bn-to-depthwise: a conv of its own for each; fuse-or-depthwise: bn_conv folded into the conv
    assert count(program, "conv") == (5 if made is bn_to_depthwise else 4)
    assert_sound(program, x, want)  # within 1e-5 of the model, no dead constant, validates


def test_a_batch_norm_in_training_mode_and_a_batchnorm1d_stay_and_are_reported() -> None:
    class Kept(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn2, self.bn1 = nn.BatchNorm2d(3), nn.BatchNorm1d(3)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.bn2(x), self.bn1(x.flatten(2))

    model, x = Kept(), _x()  # (the 2d one in training mode: batch statistics)
    model.bn1.eval()
    program = torch.export.export(model, x)
    outcome = adapters.transform(program, [bn_to_depthwise]).unwrap()
    assert not outcome.changed and not outcome.report.plans
    assert sorted(j.reason.code for j in outcome.report.rejections) == ["bn-training-mode", "unsupported-rank"]


def test_the_edge_program_lowers_through_xnnpack_and_the_runtime_computes_the_same() -> None:
    model, x = Standalone().eval(), _x()
    with torch.no_grad():
        want = [model(*x)]
    edge = to_edge(torch.export.export(model, x)).transform([RulesPass([FUSE_OR_DEPTHWISE])])
    assert count(edge.exported_program(), "batch_norm") == 0 and count(edge.exported_program(), "convolution") == 4
    lowered = edge.to_backend(XnnpackPartitioner())
    assert count(lowered.exported_program(), "convolution") == 0  # (each conv runs in the delegate)
    assert_close(run_pte(lowered.to_executorch().buffer, x), want)
